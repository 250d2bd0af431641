"""Probe: each memory-bound op of a d12 B=64 T=1024 training step, called twice (a warm-up, then
the one to read), at the step's shapes -- for ncu, which says per kernel how far it is from the
DRAM bandwidth and what its warps wait on. Run (the device machine):
    PYTHONPATH=. ncu --clock-control none --csv --page raw --metrics <list> python3 tools/probes/memory_ops_once.py
tools/notes/kernels_perf.md has what it found.
"""
import cupy as cp
import numpy as np

import gpucore
from gpucore.ops.classifier import dlogits_fp8_scale
from gpucore.ops.fp8 import fp8_gelu_backward, fp8_gelu_quantize, fp8_quantize, fp8_transpose
from gpucore.ops.gelu import gelu_backward
from gpucore.ops.layernorm import layernorm_backward

N, C, Vp, V, ROWS = 65536, 768, 50304, 50257, 8192
BF = gpucore.bfloat16
rng = np.random.default_rng(0)


def rnd(shape, s=1.0):
    return cp.asarray((s * rng.standard_normal(shape, dtype=np.float32))).astype(BF)


def u8(shape):
    return cp.empty(shape, np.uint8)


scale, amax = cp.full(1, 8.0, np.float32), cp.zeros(1, np.float32)
fch, dfch = rnd((N, 4 * C)), rnd((N, 4 * C), 0.01)
dqkv = rnd((N, 3 * C), 0.01)
dout, x, dres = rnd((N, C), 0.01), rnd((N, C)), rnd((N, C), 0.01)
w = rnd((C,))
mean, rstd = cp.zeros(N, np.float32), cp.ones(N, np.float32)
dw, db, cs = cp.zeros(C, np.float32), cp.zeros(C, np.float32), cp.zeros(C, np.float32)
fcb = cp.zeros(4 * C, np.float32)
g8, g8t = u8((N, 4 * C)), u8((4 * C, N))
logits = rnd((ROWS, Vp), 3.0)
targets = cp.asarray(rng.integers(0, V, ROWS, dtype=np.int32))
d8, d8t = u8((ROWS, Vp)), u8((Vp, ROWS))
gs = 1.0 / N

ops = {
    "fp8_gelu_backward": lambda: fp8_gelu_backward(dfch, fch, scale, out=g8, out_t=g8t, amax=amax, dbias=fcb),
    "gelu_backward": lambda: gelu_backward(dfch, fch, dx=dfch, dbias=fcb),
    "fp8_quantize dqkv": lambda: fp8_quantize(dqkv, "e5m2", scale, out=g8.reshape(-1)[: N * 3 * C].reshape(N, 3 * C),
                                              out_t=g8t.reshape(-1)[: N * 3 * C].reshape(3 * C, N), amax=amax),
    "fp8_gelu_quantize": lambda: fp8_gelu_quantize(fch, scale, out=g8, out_t=g8t, amax=amax),
    "classifier bf16": lambda: gpucore.fused_classifier(logits, targets, vocab_size=V, grad_scale=gs, check_targets=False),
    "classifier fp8 only": lambda: gpucore.fused_classifier(logits, targets, vocab_size=V, grad_scale=gs, check_targets=False,
                                                           dlogits8=d8, dlogits8_scale=dlogits_fp8_scale(gs),
                                                           write_dlogits=False),
    "layernorm_backward": lambda: layernorm_backward(dout, x, w, mean, rstd, dx=dres, dweight=dw, dbias=db, dx_colsum=cs),
    "fp8_transpose": lambda: fp8_transpose(d8, out=d8t),
}
for name, fn in ops.items():
    for _ in range(2):
        fn()
    cp.cuda.Device().synchronize()
    print("ran", name, flush=True)
