"""Probe: the v3 pipelined forward at the bench shape under its compile-time option, the block order's
head group (settings.attention_head_group, compiled in as -DV3_HEAD_GROUP), and its two hd-64 ring
depths, timed in alternation.  Run:  PYTHONPATH=. python3 tools/probes/attention_fwd_options.py
"""
import itertools

import cupy as cp
import numpy as np

import gpucore
from gpucore import settings
from gpucore.bench import time_interleaved
from gpucore.ops import attention as attn

B, NH, T, hd = 64, 12, 1024, 64
rng = np.random.default_rng(0)
qkv = cp.asarray(rng.standard_normal((B, T, 3 * NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
out = cp.empty((B, T, NH * hd), gpucore.bfloat16)
lse = cp.empty((B, NH, T), np.float32)
flops = 4.0 * B * NH * T * T * hd / 2
combos = list(itertools.product((16, 64), [(2, 64, 3), (2, 64, 4)]))   # (head group, pipelined config)


def run(group, cfg):
    def fn():
        with settings.using(attention_head_group=group):
            attn.forward_v3(qkv, NH, out, lse, config=cfg)
    return fn


for (group, cfg), ms in sorted(zip(combos, time_interleaved([run(*c) for c in combos], rounds=7)),
                               key=lambda r: r[1]):
    print(f"v3 forward head_group={group} cfg={cfg}: {ms:.4f} ms {flops / ms / 1e9:6.1f} TFLOP/s")
