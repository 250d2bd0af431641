"""Probe: the one-pass attention backward (attention/flash_v3_bwd1.cu, 128 keys x 64 queries a
visit) against the wide one (attention/flash_v3_bwd1w.cu, 128 x 128 visits) at the d12 shape
(B=64 NH=12 T=1024 hd=64, bf16) and a d48-like one (B=16 NH=25): medians of alternating rounds,
TFLOP/s counted as 2.5x the causal forward (as `gpucore bench attention`), and how far the wide
kernel's dqkv lies from the one-pass kernel's (relative to its rms).
Each further argument (`-DNAME=VALUE`, or several in one quoted argument) adds a variant: this
tree's wide kernel compiled with those NVRTC options, timed in the same rounds, its dqkv compared
bit for bit with the default build's.
Run:  PYTHONPATH=. python3 tools/probes/attention_wide.py [--once] [-DNAME=VALUE ...]
--once: one launch of each at the d12 shape, nothing timed (for ncu -k regex:backward).
"""
import math
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import runtime
from gpucore.bench import time_interleaved
from gpucore.ops import attention as attn

T, hd = 1024, 64
rng = np.random.default_rng(0)
once = "--once" in sys.argv
variants = []
for arg in (a for a in sys.argv[1:] if a.startswith("-D")):
    mod = runtime.load_module(runtime.KERNEL_DIR / "attention/flash_v3_bwd1w.cu",
                              attn.v3_compile_options() + tuple(arg.split()), attn.V3_ARCH)
    variants.append((arg, mod.get_function("attention_backward_wide_kernel_v3_hd64_bf16")))


def run_variant(kernel, dout, qkv, lse, D, NH, dqkv):
    B = qkv.shape[0]
    dqacc = cp.empty((B * NH, -(-T // 128) * 128, hd), dtype=np.float32)
    runtime.launch(kernel, B * NH, 256, (dqkv, dqacc, qkv, dout, lse, D, np.int32(T), np.int32(NH),
                                         np.float32(1.0 / math.sqrt(hd))), shared_mem=attn.v3_wide_smem(hd))

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
    for name, kernel in variants:
        v = cp.empty_like(qkv)
        run_variant(kernel, dout, qkv, lse, D, NH, v)
        same = bool((v.view(np.uint16) == wide.view(np.uint16)).all())
        print(f"B={B} NH={NH}  wide {name}: dqkv {'bitwise equal' if same else 'DIFFERS'}")
        rows.append((f"wide {name}", lambda k=kernel, v=v: run_variant(k, dout, qkv, lse, D, NH, v)))
    ms = time_interleaved([f for _, f in rows], rounds=9)
    flops = 2.5 * 4.0 * B * NH * T * T * hd / 2
    for (name, _), t in zip(rows, ms):
        print(f"B={B} NH={NH}  {name:<28} {t:7.3f} ms  {flops / t / 1e9:6.1f} TFLOP/s")
