"""Probe: the dqkv cast (E5M2, both orientations, amax) with its column sums (the qkv bias gradient)
in the same pass, against the plain cast followed by colsum's two-pass column sum, at d12's and d48's
dqkv shapes, timed in alternation. Answers whether fp8_quantize(dbias=) saves what the colsum pass
cost. Run:  PYTHONPATH=. python3 tools/probes/fp8_cast_colsum.py
"""
import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import copy_bandwidth_gbps, time_interleaved
from gpucore.ops.colsum import colsum
from gpucore.ops.fp8 import fp8_quantize

copy = copy_bandwidth_gbps()
print(f"device-to-device copy: {copy:.0f} GB/s (read + written)")
rng = np.random.default_rng(0)
for name, N, C in (("d12", 65536, 3 * 768), ("d48", 16384, 3 * 1600)):
    x = cp.asarray(rng.standard_normal((N, C), dtype=np.float32) * 0.01).astype(gpucore.bfloat16)
    scale, amax = cp.full(1, 1000.0, np.float32), cp.zeros(1, np.float32)
    o, ot = cp.empty((N, C), np.uint8), cp.empty((C, N), np.uint8)
    db1, db2 = cp.zeros(C, np.float32), cp.zeros(C, np.float32)
    fns = [lambda: fp8_quantize(x, "e5m2", scale, out=o, out_t=ot, amax=amax),
           lambda: colsum(db1, x),
           lambda: fp8_quantize(x, "e5m2", scale, out=o, out_t=ot, amax=amax, dbias=db2)]
    ms = time_interleaved(fns)
    cast_gbs = 4 * N * C / ms[0] / 1e6
    print(f"{name} {N} x {C}: cast {ms[0]:.4f} ms ({100 * cast_gbs / copy:.1f}% of copy), colsum {ms[1]:.4f}, "
          f"cast + colsum {ms[0] + ms[1]:.4f}; cast with the sums {ms[2]:.4f} ms")
