"""Probe: the LM head's forward GEMM and the fused classifier over one logits chunk (d12: 8192 rows x
50304 bf16 = 824 MB), as the model runs them (the GEMM writes the whole chunk, then the classifier
reads it back from DRAM and writes dlogits in place), against the same two ops in sub-chunks of R
rows, each sub-chunk's classifier right after its GEMM, so that it reads logits the GEMM has just left
in the L2 (50 MB on an H100/H200: 256 rows are 25.8 MB). Each variant is one CUDA graph (as the
training step replays them), timed in alternation; dlogits and losses are compared with the whole
chunk's (a sub-chunk's GEMM of another M may take another cuBLASLt algorithm, so bits may differ).

Why: the classifier is 4.6 ms of a d12 B=64 bf16 step at ~95% of copy bandwidth -- its read of the
logits is half of its bytes. The fourteenth session measured the same idea for the GELU passes (2048-
8192-row chunks) and lost to the smaller GEMMs' tails; the LM head's GEMMs are 16x wider (N = 50304).
Run:  PYTHONPATH=. python3 tools/probes/lm_head_l2_chunks.py [R ...]   (default 2048 1024 512 256)
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import time_interleaved
from gpucore.ops.classifier import fused_classifier
from gpucore.ops.matmul import matmul_forward

ROWS, C, V, Vp = 8192, 768, 50257, 50304
subs = [int(a) for a in sys.argv[1:]] or [2048, 1024, 512, 256]
rng = np.random.default_rng(0)
lnf = cp.asarray((rng.standard_normal((ROWS, C)) * 1.0).astype(np.float32).astype(gpucore.bfloat16))
wte = cp.asarray((rng.standard_normal((Vp, C)) * 0.02).astype(np.float32).astype(gpucore.bfloat16))
tgt = cp.asarray(rng.integers(0, V, ROWS).astype(np.int32))
chunk = cp.empty((ROWS, Vp), dtype=gpucore.bfloat16)
losses = cp.empty((ROWS,), dtype=np.float32)


def head(sub):
    for r0 in range(0, ROWS, sub):
        r1 = min(ROWS, r0 + sub)
        matmul_forward(lnf[r0:r1], wte, None, out=chunk[r0:r1])
        fused_classifier(chunk[r0:r1], tgt[r0:r1], vocab_size=V, grad_scale=1.0 / 65536, losses=losses[r0:r1],
                         check_targets=False)


def graphed(sub):
    head(sub)                                   # eager first: compiles, races the GEMM's algorithms
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()   # as step_graph.py captures
    cp.cuda.get_current_stream().synchronize()
    with cp.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        head(sub)
        graph = stream.end_capture()
    keep.append((stream, pool, graph))
    return lambda: graph.launch(cp.cuda.get_current_stream())


variants = [ROWS] + subs
keep = []
results = {}
for sub in variants:
    head(sub)
    cp.cuda.get_current_stream().synchronize()
    results[sub] = (cp.asnumpy(chunk).view(np.uint16), cp.asnumpy(losses))
base_d, base_l = results[ROWS]
for sub in subs:
    d, l = results[sub]
    same = np.array_equal(d, base_d) and np.array_equal(l.view(np.uint32), base_l.view(np.uint32))
    dd = np.abs(d.view(gpucore.bfloat16).astype(np.float32) - base_d.view(gpucore.bfloat16).astype(np.float32)).max()
    print(f"R={sub:5d}: dlogits/losses {'bitwise equal to' if same else 'differ from'} the whole chunk's"
          f" (max |d dlogits| {dd:.2e}, max |d loss| {np.abs(l - base_l).max():.2e})")
fns = [graphed(sub) for sub in variants]
ms = time_interleaved(fns, rounds=9, repeat=5)
for sub, t in zip(variants, ms):
    print(f"R={sub:5d}: {ROWS // sub:3d} x (GEMM + classifier)  {t:7.3f} ms a chunk  x{ms[0] / t:.3f}"
          f"  ({8 * t:6.2f} ms a d12 B=64 step)")
