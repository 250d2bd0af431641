"""Probe: the FP8 LM head's backward for one chunk with the dx GEMM writing dlogits8's transpose itself.

Today (`fp8_lm_head_dx_transposes=0`): cuBLASLt's dx GEMM reads dlogits8 (8192 x 50304 E5M2), then
fp8_transpose reads it again and writes the token-contiguous copy the dwte GEMM wants. With the
setting on, kernels_cu/fp8_matmul.cu does the dx product and writes the copy from the tiles it
has loaded anyway. This times, on realistic thinned dlogits (the classifier's rule, the rows of
tools/probes/head_sparse_dlogits.py), under NVML's counter at the power cap:
  - "lt+T":    cuBLASLt dx (exact accumulation, today's) + fp8_transpose
  - "ours":    the transposing GEMM, exact (promoted) accumulation -- the new default
  - "ours-f":  the same on fast accumulation
  - "ours noT", "ours-f noT": the GEMM alone (no transposed copy)
  - "ours nohint": without the L2 policy on B's loads (evict_last)
  - "ours nostores": the transposer's loads and turns without its stores (wrong a_t: a switch)
  - "ours early": the transposer frees each stage before reading it (wrong a_t: a switch)
  - "lt", "T": cuBLASLt's dx alone, the transpose alone
  - "... +dW": each with the chunk's dwte GEMM after it (the head's whole backward but the classifier)
and checks the outputs: the transposed bytes equal, dx within the accumulations' rounding.
Run (GPU):  PYTHONPATH=. python3 tools/probes/head_dx_transposes.py [seconds=1] [rounds=2] [rows=8192]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import power
from gpucore.ops.classifier import dlogits_fp8_scale, sparse_tau_of
from gpucore.ops.fp8 import _fp8_matmul_at, fp8_matmul, fp8_quantize, fp8_transpose

opts = dict(seconds="1", rounds="2", rows="8192", a="1.0", s="3.0")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
R, V, C, TOKENS = int(opts["rows"]), 50304, 768, 65536
BF = gpucore.bfloat16


def thinned_dlogits8(rng, scale):
    """E5M2 dlogits8 (R, V) of realistic rows thinned below p = 2^-13, as the FP8 head writes them."""
    v = cp.arange(V, dtype=cp.float32)
    z = -float(opts["a"]) * cp.log1p(v)[None, :] + float(opts["s"]) * rng.standard_normal((R, V), dtype=cp.float32)
    z -= z.max(axis=1, keepdims=True)
    p = cp.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    u = rng.random((R, 1), dtype=cp.float32)
    target = cp.minimum((cp.cumsum(p, axis=1) < u).sum(axis=1), V - 1)
    p[cp.arange(R), target] -= 1.0
    d = p * (scale / TOKENS)                                  # the scaled dlogits, before E5M2
    tau = sparse_tau_of(2.0 ** -13, 1.0 / TOKENS, scale)
    keep = rng.random(d.shape, dtype=cp.float32) * tau < cp.abs(d)
    d = cp.where(cp.abs(d) < tau, cp.where(keep, cp.sign(d) * tau, 0.0), d).astype(cp.float32)
    d8 = cp.empty((R, V), cp.uint8)
    fp8_quantize(d.astype(BF), "e5m2", cp.asarray([1.0], cp.float32), out=d8)
    return d8


def main():
    meter = power.require_meter()
    sync = cp.cuda.Device().synchronize
    rng = cp.random.default_rng(0)
    scale = dlogits_fp8_scale(1.0 / TOKENS)
    d8 = thinned_dlogits8(rng, scale)
    w8t, x8t = cp.empty((C, V), cp.uint8), cp.empty((C, R), cp.uint8)
    fp8_quantize((0.02 * rng.standard_normal((C, V), dtype=cp.float32)).astype(BF), "e4m3",
                 cp.asarray([4096.0], cp.float32), out=w8t)
    fp8_quantize(rng.standard_normal((C, R), dtype=cp.float32).astype(BF), "e4m3",
                 cp.asarray([64.0], cp.float32), out=x8t)
    inv, one = cp.asarray([1.0 / scale], cp.float32), cp.ones(1, cp.float32)
    d8t = cp.empty((V, R), cp.uint8)
    dx = {k: cp.empty((R, C), BF) for k in ("lt", "ours", "ours-f")}
    dw = cp.zeros((V, C), BF)

    def lt_dx(key="lt", fast=False):
        fp8_matmul(d8, w8t, "e5m2", "e4m3", inv, one, out=dx[key], fast_accum=fast)

    def transpose():
        fp8_transpose(d8, out=d8t)

    def ours(fast=False):
        fp8_matmul(d8, w8t, "e5m2", "e4m3", inv, one, out=dx["ours-f" if fast else "ours"], fast_accum=fast,
                   a_t_out=d8t)

    def own(fast=False, transpose=True, options=()):
        _fp8_matmul_at(d8, w8t, "e5m2", inv, one, dx["ours-f" if fast else "ours"], d8t if transpose else None,
                       fast, options)

    def dwte():
        fp8_matmul(d8t, x8t, "e5m2", "e4m3", inv, one, out=dw, accumulate=True)

    runs = {
        "lt+T": lambda: (lt_dx(), transpose()),
        "ours": lambda: ours(),
        "ours-f": lambda: ours(True),
        "ours noT": lambda: own(transpose=False),
        "ours-f noT": lambda: own(True, transpose=False),
        "ours nohint": lambda: own(options=("-DFT_NO_HINTS",)),
        "ours nostores": lambda: own(options=("-DFT_NO_T_STORES",)),
        "ours early": lambda: own(options=("-DFT_EARLY_RELEASE",)),
        "lt": lambda: lt_dx(),
        "T": transpose,
        "lt+T +dW": lambda: (lt_dx(), transpose(), dwte()),
        "ours +dW": lambda: (ours(), dwte()),
        "ours-f +dW": lambda: (ours(True), dwte()),
    }
    # correctness first
    transpose()
    want_t = d8t.copy()
    d8t.fill(0)
    ours()
    ours(True)
    lt_dx()
    sync()
    same_t = bool((d8t == want_t).all())
    ref = dx["lt"].astype(cp.float32)
    errs = {k: float(cp.linalg.norm(dx[k].astype(cp.float32) - ref) / cp.linalg.norm(ref)) for k in ("ours", "ours-f")}
    zeros = float(((d8 & 0x7F) == 0).mean())
    print(f"dlogits8: {R} x {V}, {zeros:.3f} zeros; transposed bytes equal: {same_t}; dx vs cuBLASLt exact "
          f"(relative Frobenius): ours {errs['ours']:.2e}, ours fast {errs['ours-f']:.2e}")

    seconds = float(opts["seconds"])
    last = {}
    for _ in range(int(opts["rounds"])):
        for key, fn in runs.items():
            power.measure(fn, meter, min_seconds=seconds / 2, sync=sync)      # settle
            last[key] = power.measure(fn, meter, min_seconds=seconds, sync=sync)
    flops = 2.0 * R * V * C
    print(f"one {R}-row chunk, {seconds:g} s a variant, round {opts['rounds']} of {opts['rounds']}")
    print(f"{'variant':12s} {'ms':>7s} {'dx TFLOP/s':>10s} {'J/call':>7s} {'W':>5s} {'MHz':>5s}")
    for key, r in last.items():
        ms = 1e3 * r.seconds / r.calls
        print(f"{key:12s} {ms:7.4f} {flops / ms / 1e9:10.0f} {r.joules_per_call:7.4f} {r.watts:5.0f} {r.sm_mhz:5.0f}")


if __name__ == "__main__":
    main()
