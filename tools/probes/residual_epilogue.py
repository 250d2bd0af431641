"""Probe: the residual add in the projection GEMM's epilogue (cuBLASLt's C matrix) against today's
fused residual + layernorm, at d12's and d48's attproj (K = C) and fcproj (K = 4C) shapes, timed in
alternation.

    today:  proj = x @ W^T + b;            residual2, ln = fused_residual_layernorm(residual, proj)
    new:    residual2 = x @ W^T + b + residual (C read in the GEMM's epilogue);  ln = layernorm(residual2)

Bytes a value of the (N, C) stream: today the GEMM writes proj (2), the layernorm reads residual and
proj (4) and writes residual2 and its output (4; FP8: x8 + x8T, 2); new: the GEMM reads C and writes D
(4), the layernorm reads 2 and writes 2 (FP8 2). One 2-byte pass less; what the epilogue's read costs
inside a compute-bound GEMM is the question. Predicted (H100, ~2.9 TB/s copy): at most 0.035 ms a
d12 call (24 a step: ~0.8 ms), 0.018 ms a d48 call (96: ~1.7 ms), less what the epilogue read costs.
Run:  PYTHONPATH=. python3 tools/probes/residual_epilogue.py
"""
import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import copy_bandwidth_gbps, time_interleaved
from gpucore.ops.fp8 import fp8_matmul
from gpucore.ops.layernorm import fused_residual_layernorm_forward, layernorm_forward, layernorm_forward_fp8
from gpucore.ops.matmul import matmul_forward

copy = copy_bandwidth_gbps()
print(f"device-to-device copy: {copy:.0f} GB/s (read + written)")
rng = np.random.default_rng(0)
bf = gpucore.bfloat16


def rand(*shape, s=1.0, mean=0.0):
    return cp.asarray(rng.standard_normal(shape, dtype=np.float32) * s + mean).astype(bf)


for name, N, C, calls in (("d12", 65536, 768, 12), ("d48", 16384, 1600, 48)):
    res = rand(N, C)
    lnw, lnb = rand(C, s=0.1, mean=1.0), rand(C, s=0.1)
    mean, rstd = cp.empty(N, np.float32), cp.empty(N, np.float32)
    ln, proj, res2, res2b = (cp.empty((N, C), bf) for _ in range(4))
    x8, x8t = cp.empty((N, C), np.uint8), cp.empty((C, N), np.uint8)
    s8, amax = cp.full(1, 100.0, np.float32), cp.zeros(1, np.float32)
    for what, K in (("attproj", C), ("fcproj", 4 * C)):
        x, w, b = rand(N, K), rand(C, K, s=0.02), rand(C, s=0.02)
        a8 = cp.asarray(rng.integers(0, 120, (N, K), dtype=np.uint8))
        w8 = cp.asarray(rng.integers(0, 120, (C, K), dtype=np.uint8))
        one = cp.full(1, 0.01, np.float32)
        fns = {
            "bf16 gemm": lambda: matmul_forward(x, w, b, out=proj),
            "bf16 gemm + C": lambda: matmul_forward(x, w, b, out=res2b, residual=res),
            "bf16 ln fused": lambda: fused_residual_layernorm_forward(res, proj, lnw, lnb, residual=res2, out=ln,
                                                                      mean=mean, rstd=rstd),
            "bf16 ln plain": lambda: layernorm_forward(res2b, lnw, lnb, out=ln, mean=mean, rstd=rstd),
            "fp8 gemm": lambda: fp8_matmul(a8, w8, "e4m3", "e4m3", one, one, out=proj, bias=b, fast_accum=True),
            "fp8 gemm + C": lambda: fp8_matmul(a8, w8, "e4m3", "e4m3", one, one, out=res2b, bias=b,
                                               fast_accum=True, residual=res),
            "fp8 ln fused": lambda: layernorm_forward_fp8(res, lnw, lnb, s8, b=proj, residual=res2, out8=x8,
                                                          out8_t=x8t, amax=amax, mean=mean, rstd=rstd),
            "fp8 ln plain": lambda: layernorm_forward_fp8(res2b, lnw, lnb, s8, out8=x8, out8_t=x8t, amax=amax,
                                                          mean=mean, rstd=rstd),
        }
        # correctness first: the new residual2 against today's (bf16: one rounding instead of two)
        for dt in ("bf16", "fp8"):
            fns[f"{dt} gemm"](), fns[f"{dt} ln fused"](), fns[f"{dt} gemm + C"]()
            d = cp.abs(res2.astype(cp.float32) - res2b.astype(cp.float32)).max()
            m = cp.abs(res2.astype(cp.float32)).max()
            print(f"{name} {what} {dt}: residual2 max |new - today| {float(d):.3g} (max |value| {float(m):.3g})")
        ms = dict(zip(fns, time_interleaved(list(fns.values()))))
        for dt in ("bf16", "fp8"):
            today = ms[f"{dt} gemm"] + ms[f"{dt} ln fused"]
            new = ms[f"{dt} gemm + C"] + ms[f"{dt} ln plain"]
            print(f"{name} {what} ({N} x {C} x {K}) {dt}: gemm {ms[f'{dt} gemm']:.4f} -> +C {ms[f'{dt} gemm + C']:.4f}, "
                  f"ln fused {ms[f'{dt} ln fused']:.4f} -> plain {ms[f'{dt} ln plain']:.4f}; "
                  f"pair {today:.4f} -> {new:.4f} ms (x{today / new:.3f}, {(today - new) * calls:.2f} ms a step)")
