"""Probe: the LM head's backward GEMMs of one chunk (d12: 8192 rows x Vp 50304 x C 768, bf16), for
issue 15. The step profile puts the head's backward at ~660 TFLOP/s against the forward's ~770:
is it the dlnf GEMM (a small 8192 x 768 output over K = 50304: few tiles, wave quantisation), and
would running dlnf and dwte on two streams (independent GEMMs) fill each other's tails?
Rows timed in alternation (time_interleaved, medians). Run:
    PYTHONPATH=. python3 tools/probes/lm_head_bwd.py [ROWS ...]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import runtime
from gpucore.bench import time_interleaved
from gpucore.ops.matmul import _train_gemm

C, V = 768, 50304
BF = gpucore.bfloat16
rng = np.random.default_rng(0)


def rnd(shape, s=1.0):
    return cp.asarray((s * rng.standard_normal(shape)).astype(np.float32)).astype(BF)


wte, dwte = rnd((V, C), 0.02), rnd((V, C), 0.01)
for R in [int(a) for a in sys.argv[1:]] or [8192, 16384]:
    dlogits, lnf, dlnf, logits = rnd((R, V), 1e-4), rnd((R, C)), cp.empty((R, C), BF), cp.empty((R, V), BF)
    side, fork, join = runtime.side_stream("probe lm head")
    main = cp.cuda.get_current_stream()

    def fwd():
        _train_gemm(lnf, wte, logits, R, V, C, transpose_b=True)

    def dx():
        _train_gemm(dlogits, wte, dlnf, R, C, V)

    def dw():
        _train_gemm(dlogits, lnf, dwte, V, C, R, transpose_a=True, beta=1.0)

    def both():
        dx()
        dw()

    def two_streams():
        fork.record(main)
        side.wait_event(fork)
        with side:
            dw()
        join.record(side)
        dx()
        main.wait_event(join)

    names = ["fwd (logits)", "dx (dlnf)", "dW (dwte +=)", "dx then dW", "dx || dW (2 streams)"]
    ms = time_interleaved([fwd, dx, dw, both, two_streams], rounds=9)
    fl = 2.0 * R * V * C
    for n, t in zip(names, ms):
        f = fl * (2 if n.startswith(("dx then", "dx ||")) else 1)
        print(f"rows {R:>6}  {n:<22} {t:7.3f} ms  {f / t / 1e9:6.0f} TFLOP/s")
