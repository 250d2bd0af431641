"""Probe: the fc layer's FP8 forward as one kernel (fp8_matmul_gelu: GELU, E4M3 casts and amax in the
GEMM's ping-pong epilogue) against today's two passes (cuBLASLt's fp8_matmul with the bias, then
fp8_gelu_quantize reading h back), at d12's and d48's fc shapes, timed in alternation.

Prediction (H100 figures of tools/notes/fp8.md, twelfth session): the pair takes 0.58 ms a d12
layer (GEMM 0.28, cast 0.30). The fused kernel hides the cast's arithmetic (~0.17 ms of issue) under
~0.28 ms of tensor work and drops the h read-back: ~0.30-0.40 ms, i.e. 2-3 ms a d12 step (12 layers).
Run:  PYTHONPATH=. python3 tools/probes/fp8_gelu_fused.py [once]   (once: each kernel once at d12, for ncu)
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import time_interleaved
from gpucore.ops.fp8 import fp8_gelu_quantize, fp8_matmul
from gpucore.ops.fp8_matmul import fp8_matmul_bias, fp8_matmul_gelu

rng = np.random.default_rng(0)
print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
for name, M, N, K, layers in (("d12", 65536, 3072, 768, 12), ("d48", 16384, 6400, 1600, 48)):
    a8 = cp.asarray(rng.integers(0, 0x7e, (M, K), dtype=np.uint8))   # positive E4M3 codes, no NaN
    a8 ^= cp.asarray(rng.integers(0, 2, (M, K), dtype=np.uint8) << 7)
    b8 = cp.asarray(rng.integers(0, 0x7e, (N, K), dtype=np.uint8))
    b8 ^= cp.asarray(rng.integers(0, 2, (N, K), dtype=np.uint8) << 7)
    bias = cp.asarray(rng.standard_normal(N).astype(np.float32)).astype(gpucore.bfloat16)
    sa, sb, gs = cp.full(1, 1 / 64, np.float32), cp.full(1, 1 / 512, np.float32), cp.full(1, 30.0, np.float32)
    h, x8, x8t, amax = cp.empty((M, N), gpucore.bfloat16), cp.empty((M, N), np.uint8), cp.empty((N, M), np.uint8), cp.zeros(1, np.float32)

    def two_pass():
        fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, out=h, bias=bias, fast_accum=True)
        fp8_gelu_quantize(h, gs, out=x8, out_t=x8t, amax=amax)

    def gemm_only():
        fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, out=h, bias=bias, fast_accum=True)

    def fused():
        fp8_matmul_gelu(a8, b8, sa, sb, gs, out=h, out8=x8, out8_t=x8t, bias=bias, amax=amax)

    def ours_gemm_only():
        fp8_matmul_bias(a8, b8, sa, sb, out=h, bias=bias)

    if sys.argv[1:] == ["once"]:
        for fn in (gemm_only, ours_gemm_only, fused, two_pass):
            fn()
        cp.cuda.get_current_stream().synchronize()
        break
    ms = time_interleaved([two_pass, fused, gemm_only, ours_gemm_only])
    tf = 2.0 * M * N * K / 1e9
    print(f"{name} {M} x {N} x {K}: cuBLASLt GEMM alone {ms[2]:.4f} ms ({tf / ms[2]:.0f} TFLOP/s), ours (h only) "
          f"{ms[3]:.4f} ({tf / ms[3]:.0f}); two passes {ms[0]:.4f}, fused {ms[1]:.4f} ({tf / ms[1]:.0f} TFLOP/s): "
          f"x{ms[0] / ms[1]:.3f}, {(ms[0] - ms[1]) * layers:.2f} ms a step ({layers} layers)")
