"""Probe: the layernorm backward that also writes the residual gradient's E5M2 bytes (both
orientations, amax; layernorm_backward_fp8) against the plain backward followed by the cast it
replaces, at d12's and d48's shapes, with the dx column sum, timed in alternation. Also checks that
both give the same dx and bytes. Run:  PYTHONPATH=. python3 tools/probes/layernorm_backward_fp8.py
"""
import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import copy_bandwidth_gbps, time_interleaved
from gpucore.ops.fp8 import fp8_quantize
from gpucore.ops.layernorm import layernorm_backward, layernorm_backward_fp8, layernorm_forward

copy = copy_bandwidth_gbps()
print(f"device-to-device copy: {copy:.0f} GB/s (read + written)")
rng = np.random.default_rng(0)
for name, N, C in (("d12", 65536, 768), ("d48", 16384, 1600)):
    bf = lambda *s: cp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(gpucore.bfloat16)  # noqa: E731
    x, dout, w = bf(N, C), bf(N, C), bf(C)
    _, mean, rstd = layernorm_forward(x, w, bf(C))
    scale, amax = cp.full(1, 1000.0, np.float32), cp.zeros(1, np.float32)
    outs = []
    for _ in range(2):
        outs.append((bf(N, C), cp.zeros(C, np.float32), cp.zeros(C, np.float32), cp.zeros(C, np.float32),
                     cp.empty((N, C), np.uint8), cp.empty((C, N), np.uint8)))
    (dx1, dw1, db1, cs1, o1, t1), (dx2, dw2, db2, cs2, o2, t2) = outs

    def plain():
        layernorm_backward(dout, x, w, mean, rstd, dx=dx1, dweight=dw1, dbias=db1, dx_colsum=cs1)
        fp8_quantize(dx1, "e5m2", scale, out=o1, out_t=t1, amax=amax)

    def fused():
        layernorm_backward_fp8(dout, x, w, mean, rstd, scale, dx=dx2, dweight=dw2, dbias=db2, dx_colsum=cs2,
                               out8=o2, out8_t=t2, amax=amax)

    def bwd_only():
        layernorm_backward(dout, x, w, mean, rstd, dx=dx1, dweight=dw1, dbias=db1, dx_colsum=cs1)

    ms = time_interleaved([plain, fused, bwd_only])
    dx1[...] = dx2[...] = 0
    plain()
    fused()
    same = bool((dx1 == dx2).all()) and bool((o1 == o2).all()) and bool((t1 == t2).all())
    gbs = (4 * 2 + 2) * N * C / ms[1] / 1e6
    print(f"{name} {N} x {C}: backward + cast {ms[0]:.4f} ms (backward alone {ms[2]:.4f}), "
          f"fused {ms[1]:.4f} ms ({100 * gbs / copy:.1f}% of copy); same dx and bytes: {same}")
