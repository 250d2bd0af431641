"""Probe: our FP8 GEMM (kernels_cu/fp8_matmul.cu, settings.fp8_own_gemm) against cuBLASLt's raced
FP8 GEMM on every fast-accumulation shape of a d12 B=64 and a d48 B=16 FP8 step, timed in alternation.

    forward  x8 (M, K) @ W8 (N, K)^T + bias, E4M3 x E4M3   (qkv, attproj, fc, fcproj; the projections'
             residual add stays cuBLASLt's C in the step: timed here without it)
    dx       g8 (M, K) @ W8T (N, K)^T, E5M2 x E4M3
    logits   lnf8 chunk (8192, C) @ wte8 (Vp, C)^T, E4M3 (d12)
Prediction (47th session, the fc shape): ours 7-18% faster at K = 768, less at larger K.
Run:  PYTHONPATH=. python3 tools/probes/fp8_own_gemm.py
"""
import cupy as cp
import numpy as np

import gpucore
from gpucore import settings
from gpucore.bench import time_interleaved
from gpucore.ops.fp8 import fp8_matmul

rng = np.random.default_rng(0)
print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode())


def codes(shape):
    x = cp.asarray(rng.integers(0, 0x7b, shape, dtype=np.uint8))      # finite codes in both formats
    return x ^ cp.asarray(rng.integers(0, 2, shape, dtype=np.uint8) << 7)


def shapes(name, M, C, layers):
    yield f"{name} qkv fwd", M, 3 * C, C, "e4m3", True, layers
    yield f"{name} attproj fwd", M, C, C, "e4m3", True, layers
    yield f"{name} fc fwd", M, 4 * C, C, "e4m3", True, layers
    yield f"{name} fcproj fwd", M, C, 4 * C, "e4m3", True, layers
    yield f"{name} qkv dx", M, C, 3 * C, "e5m2", False, layers
    yield f"{name} attproj dx", M, C, C, "e5m2", False, layers
    yield f"{name} fc dx", M, C, 4 * C, "e5m2", False, layers
    yield f"{name} fcproj dx", M, 4 * C, C, "e5m2", False, layers


todo = list(shapes("d12", 65536, 768, 12)) + [("d12 logits chunk", 8192, 50304, 768, "e4m3", False, 8)] \
    + list(shapes("d48", 16384, 1600, 48))
total = {}
for label, M, N, K, fmt, with_bias, calls in todo:
    a8, b8 = codes((M, K)), codes((N, K))
    bias = cp.asarray(rng.standard_normal(N).astype(np.float32)).astype(gpucore.bfloat16) if with_bias else None
    sa, sb = cp.full(1, 1 / 256, np.float32), cp.full(1, 1 / 512, np.float32)
    out = cp.empty((M, N), gpucore.bfloat16)

    def run(own):
        def fn():
            with settings.using(fp8_own_gemm=own):
                fp8_matmul(a8, b8, fmt, "e4m3", sa, sb, out=out, bias=bias, fast_accum=True)
        return fn

    lt, ours = time_interleaved([run("off"), run("all")])
    tf = 2.0 * M * N * K / 1e9
    model = label.split()[0]
    t = total.setdefault(model, [0.0, 0.0])
    t[0] += lt * calls
    t[1] += ours * calls
    print(f"{label:20s} {M:6d} x {N:5d} x {K:5d} {fmt}: cuBLASLt {lt:.4f} ms ({tf / lt:5.0f} TFLOP/s), "
          f"ours {ours:.4f} ({tf / ours:5.0f}): x{lt / ours:.3f}, {(lt - ours) * calls:+.2f} ms a step")
for model, (lt, ours) in total.items():
    print(f"{model}: these GEMMs {lt:.2f} ms a step on cuBLASLt, {ours:.2f} on ours (x{lt / ours:.3f})")
