"""Probe: the one-pass attention backward (attention/flash_v3_bwd1.cu, 128 keys x 64 queries a
visit) against the wide one (attention/flash_v3_bwd1w.cu, 128 x 128 visits) at the d12 shape
(B=64 NH=12 T=1024 hd=64, bf16) and a d48-like one (B=16 NH=25): medians of alternating rounds,
TFLOP/s counted as 2.5x the causal forward (as `gpucore bench attention`), and how far the wide
kernel's dqkv lies from the one-pass kernel's (relative to its rms).
Run:  PYTHONPATH=. python3 tools/probes/attention_wide.py [--once]
--once: one launch of each at the d12 shape, nothing timed (for ncu -k regex:backward).
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import time_interleaved
from gpucore.ops import attention as attn

T, hd = 1024, 64
rng = np.random.default_rng(0)
once = "--once" in sys.argv
for B, NH in ((64, 12), (16, 25)):
    qkv = cp.asarray(rng.standard_normal((B, T, 3 * NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
    dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
    out, lse = gpucore.attention_forward(qkv, NH)
    D = attn._preprocess(dout, out, NH)
    one, wide = cp.empty_like(qkv), cp.empty_like(qkv)
    attn.backward_v3_onepass(dout, qkv, out, lse, NH, one, D=D)
    attn.backward_v3_wide(dout, qkv, out, lse, NH, wide, D=D)
    if once:
        cp.cuda.get_current_stream().synchronize()
        print("once each: one-pass, wide")
        break
    a, w = one.astype(np.float32), wide.astype(np.float32)
    C = NH * hd
    for s, name in enumerate("qkv"):
        x, y = a[..., s * C:(s + 1) * C], w[..., s * C:(s + 1) * C]
        rms = float(cp.sqrt((x * x).mean()))
        print(f"B={B} NH={NH}  d{name}: max |wide - one-pass| / rms {float(cp.abs(y - x).max()) / rms:.3e}, "
              f"rms of the difference / rms {float(cp.sqrt(((y - x) ** 2).mean())) / rms:.3e}")
    again = cp.empty_like(qkv)
    attn.backward_v3_wide(dout, qkv, out, lse, NH, again, D=D)
    print(f"B={B} NH={NH}  wide kernel twice: {'bitwise equal' if bool((again.view(np.uint16) == wide.view(np.uint16)).all()) else 'DIFFER'}")
    rows = [("one-pass (64-query visits)", lambda: attn.backward_v3_onepass(dout, qkv, out, lse, NH, one, D=D)),
            ("wide (128 x 128 visits)", lambda: attn.backward_v3_wide(dout, qkv, out, lse, NH, wide, D=D))]
    ms = time_interleaved([f for _, f in rows], rounds=9)
    flops = 2.5 * 4.0 * B * NH * T * T * hd / 2
    for (name, _), t in zip(rows, ms):
        print(f"B={B} NH={NH}  {name:<28} {t:7.3f} ms  {flops / t / 1e9:6.1f} TFLOP/s")
