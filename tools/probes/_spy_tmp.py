import numpy as np, cupy as cp
import gpucore.model as gm
from gpucore.model import GPT2, GPT2Config
calls = []
real = gm.layernorm_backward_fp8
gm.layernorm_backward_fp8 = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
m = GPT2(GPT2Config.from_preset("d12"), xp=cp, dtype="bfloat16", seed=1, fp8="adaptive")
x = cp.asarray(np.random.default_rng(0).integers(0, 50257, (4, 1024), dtype=np.int32))
m.zero_grad(); m.forward(x, x, for_backward=True); m.backward(); cp.cuda.Device().synchronize()
print("d12 layernorm_backward_fp8 calls:", len(calls))
