"""Probe: the LM head's dx with the classifier's backward in the GEMM's operand path (experiment).

Run:  PYTHONPATH=. python3 tools/probes/lmhead_dx.py [M]

kernels_cu/ladder/gemm/lmhead_dx.cu computes dx = dlogits @ W for one head chunk (M x 50304 @
50304 x 768). "fused" reads the logits and makes dlogits in registers (exp(logit - lse) - onehot,
scaled, bf16); "control" reads a dlogits the classifier wrote, through the same register path.
Printed:
each against cuBLAS gemmEx on the classifier's dlogits (max |diff| / max |ref|), then timings in
alternation with gemmEx, v7 (128 x 192, A from shared memory) and the classifier itself.
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import runtime
from gpucore.bench import time_interleaved
from gpucore.cublas import gemm_ex
from gpucore.ladder import gemm as lg

bf16 = gpucore.dtypes.bfloat16
M = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
V, K, N = 50257, 50304, 768
SMEM = 5 * (128 * 64 + 64 * 192) * 2 + 2 * 64 * 64 * 2 + 1024

rng = cp.random.default_rng(0)
logits = (rng.standard_normal((M, K), dtype=cp.float32) * 2.0).astype(bf16)
W = (rng.standard_normal((K, N), dtype=cp.float32) * 0.02).astype(bf16)
targets = rng.integers(0, V, size=M, dtype=cp.int32)
targets[::97] = -1                                   # ignored rows: zero gradient
scale = 1.0 / 65536
lf = logits[:, :V].astype(cp.float32)
mx = lf.max(axis=1)
lse = (mx + cp.log(cp.exp(lf - mx[:, None]).sum(axis=1))).astype(cp.float32)
del lf
dlogits = logits.copy()
gpucore.fused_classifier(dlogits, targets, vocab_size=V, grad_scale=scale)
ref = cp.empty((M, N), bf16)
gemm_ex(dlogits, W, ref, M, N, K)
refmax = float(cp.abs(ref.astype(cp.float32)).max())


def variant(name, a):
    kernel = runtime.get_kernel("ladder/gemm/lmhead_dx", f"lmhead_dx_{name}_kernel", arch="90a")
    kernel.max_dynamic_shared_size_bytes = SMEM
    out = cp.zeros((M, N), bf16)
    maps = lg._tma_maps(a, W, out)
    grid = (min(-(-M // 128) * (N // 192), runtime.sm_count()),)
    args = (out, maps, lse, targets, np.float32(scale), np.int32(M), np.int32(N), np.int32(K), np.int32(V))
    return out, lambda: kernel(grid, (384,), args, shared_mem=SMEM)


rows = []
for name in ("fused", "control"):
    out, fn = variant(name, logits if name.startswith("fused") else dlogits)
    fn()
    err = float(cp.abs(out.astype(cp.float32) - ref.astype(cp.float32)).max()) / refmax
    rows.append((name, fn, err))
v7out = cp.zeros((M, N), bf16)
scratch = logits.copy()
fns = [lambda: gemm_ex(dlogits, W, ref, M, N, K), lambda: lg._gemm_v7(dlogits, W, v7out, 192)]
fns += [fn for _, fn, _ in rows]
fns.append(lambda: gpucore.fused_classifier(scratch, targets, vocab_size=V, grad_scale=scale, check_targets=False))
times = time_interleaved(fns, rounds=7, repeat=5)
flop = 2.0 * M * K * N
print(f"M={M} K={K} N={N} (one LM head chunk), {gpucore.bench.device_name()}")
names = ["cuBLAS gemmEx NN on dlogits", "v7 128x192 on dlogits (A from smem)"] + [r[0] for r in rows] + ["classifier (fused_classifier)"]
errs = [None, None] + [r[2] for r in rows] + [None]
for name, ms, err in zip(names, times, errs):
    tf = "" if name.startswith("classifier") else f"{flop / ms / 1e9:8.1f} TFLOP/s {times[0] / ms:6.1%} of gemmEx"
    print(f"{name:>38} {ms:8.3f} ms {tf}" + ("" if err is None else f"  err {err:.1e}"))
print(f"{'classifier + gemmEx dx':>38} {times[0] + times[-1]:8.3f} ms")
