"""Probe: v3 attention backward, every (dK/dV config, dQ config) pair of the ladder tables at the bench
shape, timed in alternation (time_interleaved: drift between back-to-back runs is ~5-10%), TFLOP/s
counted as 2.5x the causal forward.  Run:  PYTHONPATH=. python3 tools/probes/attention_bwd_combos.py [hd]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import time_interleaved
from gpucore.ladder import attention as ladder

B, NH, T = 64, 12, 1024
hd = int(sys.argv[1]) if len(sys.argv) > 1 else 64
rng = np.random.default_rng(0)
qkv = cp.asarray(rng.standard_normal((B, T, 3 * NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
out, lse = gpucore.attention_forward(qkv, NH)
dqkv = cp.empty_like(qkv)
flops = 2.5 * 4.0 * B * NH * T * T * hd / 2
combos = [(kv, q) for kv in ladder.V3_DKDV_CONFIGS[hd] for q in ladder.V3_DQ_CONFIGS[hd]]
fns = [lambda kv=kv, q=q: ladder.backward_v3(dout, qkv, out, lse, NH, dqkv, dkdv_config=kv, dq_config=q)
       for kv, q in combos]
for (kv, q), ms in sorted(zip(combos, time_interleaved(fns, rounds=5)), key=lambda r: r[1]):
    print(f"v3 backward dkdv={kv} dq={q}: {ms:.4f} ms {flops / ms / 1e9:6.1f} TFLOP/s")
