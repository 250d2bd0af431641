"""Probe: v3 attention forward and backward at the bench shape for several block-order head groups
(settings.attention_head_group, v3_block_order in kernels_cu/attention/flash_v3.cuh; 0 = head =
blockIdx.x, the old order), timed in alternation.
Run:  PYTHONPATH=. python3 tools/probes/attention_head_group.py [groups, e.g. 0,8,16,32]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import settings
from gpucore.bench import time_interleaved
from gpucore.ops import attention as attn

B, NH, T, hd = 64, 12, 1024, 64
groups = [int(g) for g in (sys.argv[1] if len(sys.argv) > 1 else "0,4,8,16,32,64").split(",")]
rng = np.random.default_rng(0)
qkv = cp.asarray(rng.standard_normal((B, T, 3 * NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
out, lse = gpucore.attention_forward(qkv, NH)
dqkv = cp.empty_like(qkv)
flops_f = 4.0 * B * NH * T * T * hd / 2


def with_group(g, fn):
    def run():
        with settings.using(attention_head_group=g):
            fn()
    return run


fwd = lambda: attn.forward_v3(qkv, NH, out, lse)                        # noqa: E731
bwd = lambda: attn.backward_v3(dout, qkv, out, lse, NH, dqkv)            # noqa: E731
ra = lambda: attn.backward_v3(dout, qkv, out, lse, NH, dqkv, dkdv_config=(2, 64, attn.V3_RA))   # noqa: E731
names = [(f"forward  group={g}", flops_f) for g in groups] + [(f"backward group={g}", 2.5 * flops_f) for g in groups] \
    + [(f"backward dkdv RA group={g}", 2.5 * flops_f) for g in groups]
fns = [with_group(g, fwd) for g in groups] + [with_group(g, bwd) for g in groups] + [with_group(g, ra) for g in groups]
for (name, fl), ms in zip(names, time_interleaved(fns, rounds=5)):
    print(f"v3 {name}: {ms:.4f} ms {fl / ms / 1e9:6.1f} TFLOP/s")
