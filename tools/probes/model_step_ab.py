"""Probe: A/B of model-level switches on the d12 training step (forward + backward, no optimizer),
B=64 T=1024 bf16, random tokens, timed in alternation (time_interleaved) so that drift between
runs does not decide. Switches: gpucore.model.FUSED_BIAS_GRADS, gpucore.ops.matmul.DBIAS_STREAM.
Run:  PYTHONPATH=. python3 tools/probes/model_step_ab.py
"""
import cupy as cp
import numpy as np

import gpucore.model as model_mod
from gpucore.bench import time_interleaved
from gpucore.model import GPT2, GPT2Config
from gpucore.ops import matmul as mm

B, T = 64, 1024
cfg = GPT2Config.from_preset("d12")
model = GPT2(cfg, xp=cp, dtype="bfloat16", seed=1)
rng = np.random.default_rng(0)
x = cp.asarray(rng.integers(0, cfg.vocab_size, size=(B, T)).astype(np.int32))
y = cp.asarray(rng.integers(0, cfg.vocab_size, size=(B, T)).astype(np.int32))
settings = [(True, "last"), (True, ""), (True, "first"), (False, "")]


def step(fused, stream):
    def fn():
        model_mod.FUSED_BIAS_GRADS, mm.DBIAS_STREAM = fused, stream
        model.zero_grad()
        model.forward(x, y, for_backward=True, grad_scale=1.0 / x.size, check_tokens=False)
        model.backward()
    return fn


for (fused, stream), ms in zip(settings, time_interleaved([step(*s) for s in settings], rounds=5, repeat=3)):
    print(f"d12 forward+backward fused_bias_grads={fused} dbias_stream={stream or 'after'}: {ms:.2f} ms")
