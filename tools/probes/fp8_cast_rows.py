"""Probe: the FP8 casts' tile height (fp8.cu CAST_ROWS, GELU_BWD_ROWS: 64 or 128 rows x 64 columns) at the d12 B=64
step's cast shapes, both orientations written, amax on: time per variant (in alternation), its share
of the copy bandwidth, and that both variants write the same bytes. Run:
    PYTHONPATH=. python3 tools/probes/fp8_cast_rows.py
"""
import cupy as cp
import numpy as np

import gpucore
from gpucore import runtime
from gpucore.bench import copy_bandwidth_gbps, time_interleaved

N, C = 65536, 768
copy = copy_bandwidth_gbps()
print(f"device-to-device copy: {copy:.0f} GB/s (read + written)")
rng = np.random.default_rng(0)
scale, amax = cp.full(1, 8.0, np.float32), cp.zeros(1, np.float32)
null = np.uint64(0)
for name, kern, cols in (("atty / dres e4m3", "fp8_cast_kernel_e4m3", C), ("dqkv e5m2", "fp8_cast_kernel_e5m2", 3 * C),
                         ("gelu(fch) e4m3", "fp8_gelu_cast_kernel_e4m3", 4 * C)):
    x = cp.asarray(rng.standard_normal((N, cols), dtype=np.float32)).astype(gpucore.bfloat16)
    outs = {rows: (cp.empty((N, cols), np.uint8), cp.empty((cols, N), np.uint8)) for rows in (64, 128)}
    fns = []
    for rows, (o, ot) in outs.items():
        k = runtime.get_kernel("fp8", kern, options=(f"-DCAST_ROWS={rows}",))
        grid = (-(-cols // 64), -(-N // rows))
        fns.append(lambda k=k, grid=grid, o=o, ot=ot: runtime.launch(k, grid, 256, (o, ot, amax, x, scale, null,
                                                                                     np.int32(N), np.int32(cols))))
    ms = time_interleaved(fns)
    same = all(bool((outs[64][i] == outs[128][i]).all()) for i in range(2))
    for rows, m in zip(outs, ms):
        gbs = (2 + 1 + 1) * N * cols / m / 1e6
        print(f"{name:<18} rows {rows:>3}: {m:.4f} ms  {gbs:6.0f} GB/s  {100 * gbs / copy:5.1f}% of copy")
    print(f"{name:<18} same bytes: {same}")

# The fused GELU backward (dout, x -> E5M2 both orientations, amax, 64- or 128-row bias partials).
cols = 4 * C
dout = cp.asarray(rng.standard_normal((N, cols), dtype=np.float32) * 0.01).astype(gpucore.bfloat16)
x = cp.asarray(rng.standard_normal((N, cols), dtype=np.float32)).astype(gpucore.bfloat16)
outs, fns = {}, []
for rows in (64, 128):
    o, ot, part = cp.empty((N, cols), np.uint8), cp.empty((cols, N), np.uint8), cp.empty((N // rows, cols), np.float32)
    outs[rows] = (o, ot, part)
    k = runtime.get_kernel("fp8", "fp8_gelu_backward_kernel_e5m2", options=(f"-DGELU_BWD_ROWS={rows}",))
    grid = (cols // 64, N // rows)
    fns.append(lambda k=k, grid=grid, o=o, ot=ot, part=part: runtime.launch(
        k, grid, 256, (o, ot, amax, part, dout, x, scale, null, null, null, np.int32(N), np.int32(cols))))
ms = time_interleaved(fns)
same = all(bool((outs[64][i] == outs[128][i]).all()) for i in range(2))
sums = [outs[r][2].sum(axis=0) for r in (64, 128)]
for rows, m in zip(outs, ms):
    gbs = (2 + 2 + 1 + 1) * N * cols / m / 1e6
    print(f"{'gelu backward e5m2':<18} rows {rows:>3}: {m:.4f} ms  {gbs:6.0f} GB/s  {100 * gbs / copy:5.1f}% of copy")
print(f"{'gelu backward e5m2':<18} same bytes: {same}; bias sums agree to "
      f"{float(cp.abs(sums[0] - sums[1]).max() / cp.abs(sums[0]).max()):.2e}")
