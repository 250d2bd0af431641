"""Probe: the FP8 layernorm forward (residual variant, E4M3 out in both orientations, amax) with 32-
and 64-row blocks at d12's and d48's shapes, timed in alternation, with their share of the copy
bandwidth and a check that both write the same bytes. Answers ops/layernorm.py fp8_block_rows.
Run:  PYTHONPATH=. python3 tools/probes/layernorm_fp8_rows.py
"""
import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import copy_bandwidth_gbps, time_interleaved
from gpucore.ops.layernorm import layernorm_forward_fp8

copy = copy_bandwidth_gbps()
print(f"device-to-device copy: {copy:.0f} GB/s (read + written)")
rng = np.random.default_rng(0)
for name, N, C in (("d12", 65536, 768), ("d48", 16384, 1600)):
    bf = lambda *s: cp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(gpucore.bfloat16)  # noqa: E731
    x, b, w, bias = bf(N, C), bf(N, C), bf(C), bf(C)
    scale, amax = cp.full(1, 16.0, np.float32), cp.zeros(1, np.float32)
    outs = {}
    fns = []
    for rows in (32, 64):
        o = (cp.empty((N, C), gpucore.bfloat16), cp.empty((N, C), np.uint8), cp.empty((C, N), np.uint8),
             cp.empty(N, np.float32), cp.empty(N, np.float32))
        outs[rows] = o
        fns.append(lambda rows=rows, o=o: layernorm_forward_fp8(x, w, bias, scale, b=b, residual=o[0], out8=o[1],
                                                                out8_t=o[2], amax=amax, mean=o[3], rstd=o[4],
                                                                block_rows=rows))
    ms = time_interleaved(fns)
    same = all(bool((outs[32][i] == outs[64][i]).all()) for i in range(1, 3))
    for rows, m in zip(outs, ms):
        gbs = (2 + 2 + 2 + 1 + 1) * N * C / m / 1e6     # x, b read; residual, out8, out8_t written
        print(f"{name} C={C} rows {rows}: {m:.4f} ms  {gbs:6.0f} GB/s  {100 * gbs / copy:5.1f}% of copy")
    print(f"{name} same bytes: {same}")
