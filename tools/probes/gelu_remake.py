"""Probe: the GELU output remade inside the GELU backward's pass (keep_gelu off, d48) against the
separate recompute pass it replaced, at d12's and d48's MLP shapes, timed in alternation.

    bf16: gelu(fch) -> fch_gelu, then gelu_backward(dfch, fch, dbias=)    vs  gelu_backward(..., gelu_out=)
    FP8:  fp8_gelu_quantize(fch, out_t=x8t), then fp8_gelu_backward(...)  vs  fp8_gelu_backward(..., gelu_t=)

Bytes a value: bf16 pair 10 (recompute 2 read + 2 written, backward 4 + 2), fused 8 (4 + 4); FP8 pair 9
(2 + 1, 4 + 2), fused 7 (4 + 3). Predicted on an H100 (~2.9 TB/s copy): 0.07 ms a d48 layer either way,
~3.4 ms a d48 B=16 step (48 layers): 1.1% of bf16's ~320 ms, 1.4% of FP8's ~245.
Run:  PYTHONPATH=. python3 tools/probes/gelu_remake.py
"""
import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import copy_bandwidth_gbps, time_interleaved
from gpucore.ops.fp8 import fp8_gelu_backward, fp8_gelu_quantize
from gpucore.ops.gelu import gelu, gelu_backward

copy = copy_bandwidth_gbps()
print(f"device-to-device copy: {copy:.0f} GB/s (read + written)")
rng = np.random.default_rng(0)
for name, N, C in (("d12", 65536, 4 * 768), ("d48", 16384, 4 * 1600)):
    fch = cp.asarray(rng.standard_normal((N, C), dtype=np.float32)).astype(gpucore.bfloat16)
    dfch = cp.asarray(rng.standard_normal((N, C), dtype=np.float32) * 1e-3).astype(gpucore.bfloat16)
    dx, g = cp.empty_like(fch), cp.empty_like(fch)
    db = cp.zeros(C, np.float32)
    bf16 = [lambda: (gelu(fch, out=g), gelu_backward(dfch, fch, dx=dx, dbias=db)),
            lambda: gelu_backward(dfch, fch, dx=dx, dbias=db, gelu_out=g)]
    s, sg, amax = cp.full(1, 3000.0, np.float32), cp.full(1, 60.0, np.float32), cp.zeros(1, np.float32)
    g8, g8t, x8t = cp.empty((N, C), np.uint8), cp.empty((C, N), np.uint8), cp.empty((C, N), np.uint8)
    fp8 = [lambda: (fp8_gelu_quantize(fch, sg, out_t=x8t),
                    fp8_gelu_backward(dfch, fch, s, out=g8, out_t=g8t, amax=amax, dbias=db)),
           lambda: fp8_gelu_backward(dfch, fch, s, out=g8, out_t=g8t, amax=amax, dbias=db, gelu_t=x8t, gelu_scale=sg)]
    ms = time_interleaved(bf16 + fp8)
    for label, (a, b), (ba, bb) in (("bf16", ms[:2], (10, 8)), ("fp8 ", ms[2:], (9, 7))):
        print(f"{name} {N} x {C} {label}: recompute + backward {a:.4f} ms ({ba} bytes a value), "
              f"fused {b:.4f} ms ({bb}; {100 * bb * N * C / b / 1e6 / copy:.1f}% of copy): x{a / b:.3f}, "
              f"{(a - b) * (12 if name == 'd12' else 48):.2f} ms a step")
