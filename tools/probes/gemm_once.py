"""Probe: one warm call of our GEMM at a shape, for profilers (ncu -k regex:gemm_forward_kernel_v).
Run:  PYTHONPATH=. python3 tools/probes/gemm_once.py VERSION [M K N]
"""
import sys

import cupy as cp

import gpucore

version = int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1]
M, K, N = (int(v) for v in sys.argv[2:5]) if len(sys.argv) >= 5 else (4096, 4096, 4096)
bf16 = gpucore.dtypes.bfloat16
rng = cp.random.default_rng(0)
a = rng.standard_normal((M, K), dtype=cp.float32).astype(bf16)
b = rng.standard_normal((K, N), dtype=cp.float32).astype(bf16)
for _ in range(3):
    out = gpucore.gemm(a, b, version=version)
cp.cuda.Device().synchronize()
print(f"gemm v{version} {M}x{K}x{N} done")
