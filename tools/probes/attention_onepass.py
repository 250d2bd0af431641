"""Probe: the v3 attention backward, two passes (dK/dV + dQ, the default) against the one-pass
kernel (attention/flash_v3_bwd1.cu), at the d12 shape (B=64 NH=12 T=1024 hd=64, bf16) and a
d48-like one (B=16 NH=25). Timed in alternation (medians); TFLOP/s counted as 2.5x the causal
forward, as `gpucore bench attention` does.

Each further argument adds a one-pass variant, timed in the same rounds and its dqkv compared bit
for bit with this tree's: a tree (e.g. `.old` from `git archive`: its
kernels_cu/attention/flash_v3_bwd1.cu, compiled with this tree's headers) or an NVRTC option
(`-DNAME=VALUE`, or several in one quoted argument: this tree's kernel compiled with them).
Run:  PYTHONPATH=. python3 tools/probes/attention_onepass.py [--once] [OLD_TREE | -DNAME=VALUE ...]
--once: one launch of this tree's one-pass kernel, then one of each variant's, at the d12 shape, and
nothing timed: for a profiler (ncu -k regex:onepass ...; the launches come in that order).
"""
import math
import sys
from pathlib import Path

import cupy as cp
import numpy as np

import gpucore
from gpucore import runtime
from gpucore.bench import time_interleaved
from gpucore.ops import attention as attn

HERE = Path(__file__).resolve().parents[2]
T, hd = 1024, 64
rng = np.random.default_rng(0)


def variant_onepass(kernel, dout, qkv, out, lse, NH, dqkv):
    """A variant's one-pass kernel, launched as backward_v3_onepass launches this tree's."""
    B = qkv.shape[0]
    D = attn._preprocess(dout, out, NH)
    dqacc = cp.empty((B * NH, -(-T // 64), hd, 64), dtype=np.float32)
    runtime.launch(kernel, B * NH, 256, (dqkv, dqacc, qkv, dout, lse, D, np.int32(T), np.int32(NH),
                                         np.float32(1.0 / math.sqrt(hd))), shared_mem=attn.v3_onepass_smem(hd, 2))


once = "--once" in sys.argv
variants = []
for arg in (a for a in sys.argv[1:] if a != "--once"):
    tree, opts = (HERE, tuple(arg.split())) if arg.startswith("-D") else (Path(arg).resolve(), ())
    mod = runtime.load_module(tree / "kernels_cu/attention/flash_v3_bwd1.cu", attn.v3_compile_options() + opts,
                              attn.V3_ARCH)
    variants.append((arg, mod.get_function("attention_backward_onepass_kernel_v3_hd64_g2_bf16")))

for B, NH in ((64, 12), (16, 25)):
    qkv = cp.asarray(rng.standard_normal((B, T, 3 * NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
    dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
    out, lse = gpucore.attention_forward(qkv, NH)
    dqkv = cp.empty_like(qkv)
    if once:
        attn.backward_v3_onepass(dout, qkv, out, lse, NH, dqkv)
        for name, kernel in variants:
            variant_onepass(kernel, dout, qkv, out, lse, NH, dqkv)
        cp.cuda.get_current_stream().synchronize()
        print(f"B={B} NH={NH}: the one-pass backward once, then {len(variants)} variant(s) once")
        break
    rows = [("two-pass (default)", lambda: attn.backward_v3(dout, qkv, out, lse, NH, dqkv))]
    rows += [(f"one-pass, {g} warpgroup(s)", lambda g=g: attn.backward_v3_onepass(dout, qkv, out, lse, NH, dqkv, wgs=g))
             for g in attn.ONEPASS_WGS]
    attn.backward_v3_onepass(dout, qkv, out, lse, NH, dqkv)
    new_bits = cp.asnumpy(dqkv).tobytes()
    for name, kernel in variants:
        rows.append((f"one-pass, {name}", lambda k=kernel: variant_onepass(k, dout, qkv, out, lse, NH, dqkv)))
        dqkv.fill(0)
        variant_onepass(kernel, dout, qkv, out, lse, NH, dqkv)
        same = cp.asnumpy(dqkv).tobytes() == new_bits
        print(f"B={B} NH={NH}  dqkv of this tree's one-pass kernel and {name}'s: {'bitwise equal' if same else 'DIFFER'}")
    ms = time_interleaved([f for _, f in rows], rounds=9)
    flops = 2.5 * 4.0 * B * NH * T * T * hd / 2
    for (name, _), t in zip(rows, ms):
        print(f"B={B} NH={NH}  {name:<34} {t:7.3f} ms  {flops / t / 1e9:6.1f} TFLOP/s")
