"""Probe: one call of each v3 attention kernel at the bench shape (B=64 NH=12 T=1024 hd=64, bf16),
for a profiler to read (ncu --kernel-name regex:"forward_kernel_v3|dkdv|dq_kernel_v3|onepass" ...).
The backward runs its two-pass default configs, then the register-A ones (V3_RA), one stream (no
overlap), so each kernel's counters are its own; then the one-pass backward.  Run:  PYTHONPATH=. python3 tools/probes/attention_once.py
"""
import cupy as cp
import numpy as np

import gpucore
from gpucore.ops import attention as attn

B, NH, T, hd = 64, 12, 1024, 64
rng = np.random.default_rng(0)
qkv = cp.asarray(rng.standard_normal((B, T, 3 * NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(np.float32).astype(gpucore.bfloat16))
out, lse = gpucore.attention_forward(qkv, NH)                   # default forward (v3 pipelined)
dqkv = cp.empty_like(qkv)
attn.backward_v3(dout, qkv, out, lse, NH, dqkv, streams=False)  # default configs (dK/dV register-A)
attn.backward_v3(dout, qkv, out, lse, NH, dqkv, dkdv_config=(2, 64, attn.V3_RA), dq_config=(2, 64, attn.V3_RA),
                 streams=False)
attn.backward_v3_onepass(dout, qkv, out, lse, NH, dqkv)
cp.cuda.get_current_stream().synchronize()
print("attention v3 forward + backward (two-pass default, register-A; one-pass) ran once")
