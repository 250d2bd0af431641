"""Probe: the v3 attention backward, classic kernels against their persistent twins (one block per
SM walking the work items; tools/notes/attention.md), at the d12 shape (B=64 NH=12 T=1024 hd=64,
bf16), with the dQ pass on a side stream or not. Timed in alternation (medians); TFLOP/s counted
as 2.5x the causal forward, as `gpucore bench attention` does. Run:
    PYTHONPATH=. python3 tools/probes/attention_persistent.py [B]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import time_interleaved
from gpucore.ops import attention as attn

B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
NH, T, hd = 12, 1024, 64
rng = np.random.default_rng(0)
qkv = cp.asarray(rng.standard_normal((B, T, 3 * NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
out, lse = gpucore.attention_forward(qkv, NH)
dqkv = cp.empty_like(qkv)
RA = attn.V3_RA
rows = [("classic default (dkdv (2,64,RA), dq (2,128))", dict(persistent=False)),
        ("classic dkdv (2,64,RA), dq (2,64,RA)", dict(dkdv_config=(2, 64, RA), dq_config=(2, 64, RA), persistent=False))]
for dq in attn.V3_PERSISTENT["dq"][64]:
    for streams in (True, False):
        rows.append((f"persistent dq {dq} streams={streams}",
                     dict(dkdv_config=(2, 64, RA), dq_config=dq, persistent=True, streams=streams)))
fns = [lambda kw=kw: attn.backward_v3(dout, qkv, out, lse, NH, dqkv, **kw) for _, kw in rows]
ms = time_interleaved(fns, rounds=9)
flops = 2.5 * 4.0 * B * NH * T * T * hd / 2
for (name, _), t in zip(rows, ms):
    print(f"{name:<50} {t:7.3f} ms  {flops / t / 1e9:6.1f} TFLOP/s")
