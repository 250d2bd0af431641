"""Probe: what the sparse E5M2 dlogits cost the FP8 classifier, and what they save its GEMMs.

One 8192-row LM-head chunk (d12's default), V = 50257 (Vp 50304), realistic rows (a Zipf-like prior
plus noise: tools/probes/head_sparse_dlogits.py's, mean loss ~4.9). Times in alternation
(interleaved medians, ms):
  - the FP8 classifier writing dense E5M2 dlogits, and sparse at each tau (probability units);
  - the LM head's dx + dwte FP8 GEMMs on each variant's bytes (their transpose included).
Prints the zeros' fraction of each. Run (GPU): PYTHONPATH=. python3 tools/probes/classifier_sparse_cost.py
"""
import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import time_interleaved
from gpucore.ops.classifier import dlogits_fp8_scale, fused_classifier, sparse_tau_of
from gpucore.ops.fp8 import fp8_matmul, fp8_quantize, fp8_transpose

R, V, Vp, C, TOKENS = 8192, 50257, 50304, 768, 65536
BF = gpucore.bfloat16
rng = cp.random.default_rng(0)
z = -cp.log1p(cp.arange(Vp, dtype=cp.float32))[None, :] + 3.0 * rng.standard_normal((R, Vp), dtype=cp.float32)
z[:, V:] = -30.0
logits0 = z.astype(BF)
del z
targets = cp.asarray(np.random.default_rng(1).integers(0, 200, R).astype(np.int32))   # frequent tokens
gs = 1.0 / TOKENS
s8 = dlogits_fp8_scale(gs)
seed = cp.asarray([7], np.uint32)
work, losses = cp.empty_like(logits0), cp.empty(R, np.float32)
lnf = rng.standard_normal((R, C), dtype=cp.float32).astype(BF)
wte = (0.02 * rng.standard_normal((Vp, C), dtype=cp.float32)).astype(BF)
x8, w8t = cp.empty((R, C), cp.uint8), cp.empty((C, Vp), cp.uint8)
fp8_quantize(lnf, "e4m3", cp.asarray([64.0], cp.float32), out=x8)
fp8_quantize(wte.T.copy(), "e4m3", cp.asarray([4096.0], cp.float32), out=w8t)
x8t = fp8_transpose(x8)
one = cp.ones(1, cp.float32)
inv = cp.asarray([1.0 / s8], cp.float32)
dx, dw = cp.empty((R, C), BF), cp.zeros((Vp, C), BF)
d8t = cp.empty((Vp, R), cp.uint8)

variants = {"dense": 0.0, **{f"sparse p<{p:g}": p for p in (2.0 ** -16, 2.0 ** -13, 2.0 ** -10)}}
cls_fns, gemm_fns, zeros = [], [], {}
for name, p in variants.items():
    tau = sparse_tau_of(p, gs, s8)
    d8 = cp.empty((R, Vp), cp.uint8)

    def cls(d8=d8, tau=tau):
        fused_classifier(work, targets, vocab_size=V, grad_scale=gs, losses=losses, check_targets=False,
                         dlogits8=d8, dlogits8_scale=s8, write_dlogits=False, sparse_tau=tau,
                         sparse_seed=seed if tau else None)

    def gemms(d8=d8):
        fp8_matmul(d8, w8t, "e5m2", "e4m3", inv, one, out=dx)
        fp8_transpose(d8, out=d8t)
        fp8_matmul(d8t, x8t, "e5m2", "e4m3", inv, one, out=dw, accumulate=True)

    work[...] = logits0
    cls()
    zeros[name] = (float(((d8 & 0x7F) == 0).mean()), tau)
    cls_fns.append(cls)
    gemm_fns.append(gemms)
cp.cuda.Device().synchronize()
work[...] = logits0
t_cls = time_interleaved(cls_fns, rounds=9)
t_gemm = time_interleaved(gemm_fns, rounds=9)
print(f"one {R}-row chunk, V={V}: FP8 classifier and the head's backward (dx GEMM, transpose, dwte GEMM), "
      "interleaved medians")
print(f"{'variant':18s} {'tau':>7s} {'zeros':>6s} {'classifier ms':>14s} {'GEMMs+T ms':>11s} {'sum':>7s}")
for (name, _), tc, tg in zip(variants.items(), t_cls, t_gemm):
    zf, tau = zeros[name]
    print(f"{name:18s} {tau:7g} {zf:6.3f} {tc:14.4f} {tg:11.4f} {tc + tg:7.4f}")
