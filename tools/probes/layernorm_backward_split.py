"""Probe: the v2 layernorm backward (with the dx column sum, as the model runs it) with one warp a
row against two (layernorm.cu's S), at the d12 / d36 / d48 row lengths; interleaved medians, GB/s
counted as dout + x read, dx read and written. Answers: where does splitting a row pay (SPLIT_MIN_N)?
Run:  PYTHONPATH=. python3 tools/probes/layernorm_backward_split.py
"""
import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import copy_bandwidth_gbps, time_interleaved
from gpucore.ops import layernorm as ln

BF = gpucore.bfloat16
rng = np.random.default_rng(0)
copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f} GB/s")
for rows, C in ((65536, 768), (16384, 1024), (16384, 1280), (16384, 1600)):
    x = cp.asarray(rng.standard_normal((rows, C)).astype(np.float32)).astype(BF)
    dout = cp.asarray(rng.standard_normal((rows, C)).astype(np.float32)).astype(BF)
    w = cp.asarray(rng.standard_normal(C).astype(np.float32)).astype(BF)
    b = cp.zeros(C, BF)
    _, mean, rstd = gpucore.layernorm_forward(x, w, b)
    dx = cp.zeros((rows, C), BF)
    dw, db, cs = cp.zeros(C, np.float32), cp.zeros(C, np.float32), cp.zeros(C, np.float32)
    variants = {}
    P = 8
    n1 = -(-(C // P) // 32)
    variants[f"1 warp (n{n1})"] = lambda: ln._backward_v2(cp, dx, dout, x, w, mean, rstd, rows, C, n1, 1, True)
    S2, N2 = ln.backward_split(BF, C, 2)
    variants[f"2 warps (n{N2})"] = lambda: ln._backward_v2(cp, dx, dout, x, w, mean, rstd, rows, C, N2, 2, True)
    variants["whole call (default)"] = lambda: gpucore.layernorm_backward(dout, x, w, mean, rstd, dx=dx, dweight=dw,
                                                                          dbias=db, dx_colsum=cs)
    ms = time_interleaved(list(variants.values()), rounds=9, repeat=20)
    nbytes = 4 * rows * C * 2
    for (name, _), t in zip(variants.items(), ms):
        print(f"{rows}x{C:<6} {name:<24} {t * 1e3:8.1f} us  {nbytes / t / 1e6:7.0f} GB/s  {nbytes / t / 1e6 / copy:6.1%}")
    # the split's dx against the one-warp kernel's (different partial grouping, same math)
    d1, d2 = cp.zeros((rows, C), BF), cp.zeros((rows, C), BF)
    gpucore.layernorm_backward(dout, x, w, mean, rstd, dx=d1, warps_per_row=1)
    gpucore.layernorm_backward(dout, x, w, mean, rstd, dx=d2, warps_per_row=2)
    diff = float(cp.abs(d1.astype(np.float32) - d2.astype(np.float32)).max())
    print(f"{'':14} dx max |1 warp - 2 warps| = {diff:.3g} (max |dx| {float(cp.abs(d1.astype(np.float32)).max()):.3g})")
