"""Probe: fp8_transpose's bandwidth per tile width (64-column tiles per block: 1, 2, 4) at the LM
head's shapes -- one logits chunk of dlogits8 (8192 x 50304) and its lnf8 rows (8192 x 768) --
against the device-to-device copy of the same bytes. Run:  PYTHONPATH=. python3 tools/probes/fp8_transpose.py
"""
import cupy as cp
import numpy as np

from gpucore.bench import copy_bandwidth_gbps, time_interleaved
from gpucore.ops.fp8 import fp8_transpose

copy = copy_bandwidth_gbps()
print(f"device-to-device copy: {copy:.0f} GB/s (read + written)")
for R, C in ((8192, 50304), (8192, 768), (65536, 3072)):
    x8 = cp.asarray(np.random.default_rng(0).integers(0, 256, (R, C), dtype=np.uint8))
    out = cp.empty((C, R), np.uint8)
    tiles = (1, 2, 4)
    ms = time_interleaved([lambda t=t: fp8_transpose(x8, out=out, tiles=t) for t in tiles])
    for t, m in zip(tiles, ms):
        gbs = 2 * R * C / m / 1e6
        print(f"{R:>6} x {C:<6} tiles {t}: {m:.4f} ms  {gbs:7.0f} GB/s  {100 * gbs / copy:5.1f}% of copy")
