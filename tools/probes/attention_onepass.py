"""Probe: the v3 attention backward, two passes (dK/dV + dQ, the default) against the one-pass
kernel (attention/flash_v3_bwd1.cu), at the d12 shape (B=64 NH=12 T=1024 hd=64, bf16) and a
d48-like one (B=16 NH=25). Timed in alternation (medians); TFLOP/s counted as 2.5x the causal
forward, as `gpucore bench attention` does. Run:  PYTHONPATH=. python3 tools/probes/attention_onepass.py
"""
import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import time_interleaved
from gpucore.ops import attention as attn

T, hd = 1024, 64
rng = np.random.default_rng(0)
for B, NH in ((64, 12), (16, 25)):
    qkv = cp.asarray(rng.standard_normal((B, T, 3 * NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
    dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
    out, lse = gpucore.attention_forward(qkv, NH)
    dqkv = cp.empty_like(qkv)
    rows = [("two-pass (default)", lambda: attn.backward_v3(dout, qkv, out, lse, NH, dqkv))]
    rows += [(f"one-pass, {g} warpgroup(s)", lambda g=g: attn.backward_v3_onepass(dout, qkv, out, lse, NH, dqkv, wgs=g))
             for g in attn.ONEPASS_WGS]
    ms = time_interleaved([f for _, f in rows], rounds=9)
    flops = 2.5 * 4.0 * B * NH * T * T * hd / 2
    for (name, _), t in zip(rows, ms):
        print(f"B={B} NH={NH}  {name:<26} {t:7.3f} ms  {flops / t / 1e9:6.1f} TFLOP/s")

# What the one-pass kernel's time is made of: the same kernel compiled without the dQ^T
# read-modify-write (skip 1) and also without the dQ^T product and dS^T staging (skip 2).
from gpucore import runtime  # noqa: E402

B, NH = 64, 12
qkv = cp.asarray(rng.standard_normal((B, T, 3 * NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
out, lse = gpucore.attention_forward(qkv, NH)
dqkv = cp.empty_like(qkv)
D = attn._preprocess(dout, out, NH)
dqacc = cp.empty((B * NH, T // 64, hd, 64), dtype=np.float32)


def launcher(skip, g, part=0):
    k = runtime.get_kernel("attention/flash_v3_bwd1", f"attention_backward_onepass_kernel_v3_hd64_g{g}_bf16",
                           options=attn.v3_compile_options() + (f"-DV3_BWD1_SKIP={skip}", f"-DV3_BWD1_PART={part}"),
                           arch=attn.V3_ARCH)
    return lambda: runtime.launch(k, B * NH, 128 * g, (dqkv, dqacc, qkv, dout, lse, D, np.int32(T), np.int32(NH),
                                                       np.float32(0.125)), shared_mem=attn.v3_onepass_smem(hd, g))


for g in attn.ONEPASS_WGS:
    ms = time_interleaved([launcher(0, g), launcher(1, g), launcher(2, g), launcher(0, g, 1), launcher(0, g, 2)],
                          rounds=9)
    for name, t in zip(("kernel alone", "without the dQ RMW", "without dQ product + RMW",
                        "RMW without the staging copies", "RMW without its global stores"), ms):
        print(f"B={B} NH={NH}  one-pass g{g} {name:<32} {t:7.3f} ms")
