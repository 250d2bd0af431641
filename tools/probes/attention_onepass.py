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

