"""Probe: A/B of settings.fused_bias_grads on the d12 training step (forward + backward, no
optimizer), B=64 T=1024 bf16, random tokens, timed in alternation (time_interleaved) so that drift
between runs does not decide. fused: the fcproj/fc/attproj bias grads are summed by the layernorm /
gelu backward that writes their dout; unfused: by matmul_backward's column-sum kernels (one more
read of each dout).
Run:  PYTHONPATH=. python3 tools/probes/model_step_ab.py
"""
import cupy as cp
import numpy as np

from gpucore import settings
from gpucore.bench import time_interleaved
from gpucore.model import GPT2, GPT2Config

B, T = 64, 1024
cfg = GPT2Config.from_preset("d12")
model = GPT2(cfg, xp=cp, dtype="bfloat16", seed=1)
rng = np.random.default_rng(0)
x = cp.asarray(rng.integers(0, cfg.vocab_size, size=(B, T)).astype(np.int32))
y = cp.asarray(rng.integers(0, cfg.vocab_size, size=(B, T)).astype(np.int32))
choices = (True, False)


def step(fused):
    def fn():
        with settings.using(fused_bias_grads=fused):
            model.zero_grad()
            model.forward(x, y, for_backward=True, grad_scale=1.0 / x.size, check_tokens=False)
            model.backward()
    return fn


for fused, ms in zip(choices, time_interleaved([step(f) for f in choices], rounds=5, repeat=3)):
    print(f"d12 forward+backward fused_bias_grads={fused}: {ms:.2f} ms")
