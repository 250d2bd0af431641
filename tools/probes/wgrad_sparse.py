"""Probe: would the FP8 linears' GEMMs run faster at the power cap on operands thinned without bias?

The forty-ninth session's lever (tools/notes/fp8.md): the LM head's dlogits, ~97% tiny, thinned
without bias (|v| < tau -> sign(v) tau with probability |v| / tau, else 0) ran the head's backward
GEMMs 16% faster at the cap. The linears' operands are not mostly tiny, but a weight gradient
dW = g^T x sums over the batch's 65536 tokens, and thinning noise there is small against the
gradient's own token-to-token noise: at tau = 0.5 sigma a Gaussian operand gets ~38% zeros for
~1.7% more variance per element. This measures the ceiling before anything is built: the d12 fc
layer's three FP8 GEMMs (as the model calls them: forward x8 @ W8^T fast, dx = g8 @ W8T^T fast,
dW += g8T @ x8T^T exact) on N(0, 1) and Laplace operands, dense and thinned at tau = k sigma,
back to back under NVML's counter (gpucore/power.py), in rotation over `rounds` rounds.

Run (GPU):  PYTHONPATH=. python3 tools/probes/wgrad_sparse.py [seconds=0.6] [rounds=2] [taus=0.25,0.5,1]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import power
from gpucore.ops.fp8 import fp8_matmul, fp8_quantize

opts = dict(seconds="0.6", rounds="2", taus="0.25,0.5,1")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
T, C, H = 65536, 768, 3072          # tokens, fc's input and output features (d12 B=64)
BF = gpucore.bfloat16


def thin(v, tau, rng):
    """Unbiased: |v| < tau -> sign(v) tau with probability |v| / tau, else 0."""
    a = cp.abs(v)
    keep = rng.random(v.shape, dtype=cp.float32) * tau < a
    return cp.where(a < tau, cp.where(keep, cp.sign(v) * tau, 0.0), v).astype(cp.float32)


def q(v, fmt, scale):
    out = cp.empty(v.shape, cp.uint8)
    fp8_quantize(v.astype(BF), fmt, cp.asarray([scale], cp.float32), out=out)
    return out


def main():
    meter = power.require_meter()
    sync = cp.cuda.Device().synchronize
    rng = cp.random.default_rng(0)
    w8 = q(0.02 * rng.standard_normal((H, C), dtype=cp.float32), "e4m3", 4096.0)      # W (H, C)
    w8t = cp.ascontiguousarray(w8.T)
    one = cp.ones(1, cp.float32)
    s_g, s_x = cp.asarray([1.0 / 1024], cp.float32), cp.asarray([1.0 / 64], cp.float32)
    out_y, out_dx, out_dw = cp.empty((T, H), BF), cp.empty((T, C), BF), cp.zeros((H, C), BF)

    def draw(kind, shape):
        if kind == "laplace":         # unit variance: b = 1 / sqrt(2), a random sign on an exponential
            sign = cp.where(rng.random(shape, dtype=cp.float32) < 0.5, -1.0, 1.0).astype(cp.float32)
            return sign * rng.standard_exponential(shape, dtype=cp.float32) / np.float32(np.sqrt(2.0))
        return rng.standard_normal(shape, dtype=cp.float32)

    variants, zeros = {}, {}
    for kind in ("normal", "laplace"):
        g = draw(kind, (T, H))
        x = draw(kind, (T, C))
        cases = [("dense", g, x)] + [(f"tau {t} g", thin(g, float(t), rng), x) for t in opts["taus"].split(",")]
        cases += [(f"tau {t} g+x", thin(g, float(t), rng), thin(x, float(t), rng)) for t in opts["taus"].split(",")]
        for name, gg, xx in cases:
            g8, x8 = q(gg, "e5m2", 1024.0), q(xx, "e4m3", 64.0)
            g8t, x8t = cp.ascontiguousarray(g8.T), cp.ascontiguousarray(x8.T)
            zeros[(kind, name)] = (float(((g8 & 0x7F) == 0).mean()), float(((x8 & 0x7F) == 0).mean()))

            def dw(g8t=g8t, x8t=x8t):
                fp8_matmul(g8t, x8t, "e5m2", "e4m3", s_g, s_x, out=out_dw, accumulate=True)

            def dx(g8=g8):
                fp8_matmul(g8, w8t, "e5m2", "e4m3", s_g, one, out=out_dx, fast_accum=True)

            def fwd(x8=x8):
                fp8_matmul(x8, w8, "e4m3", "e4m3", s_x, one, out=out_y, fast_accum=True)

            variants[(kind, name, "dW")] = dw
            variants[(kind, name, "dx")] = dx
            if name == "dense" or name.endswith("g+x"):
                variants[(kind, name, "fwd x")] = fwd
        del g, x

    seconds = float(opts["seconds"])
    last = {}
    for _ in range(int(opts["rounds"])):
        for key, fn in variants.items():
            power.measure(fn, meter, min_seconds=seconds / 2, sync=sync)
            last[key] = power.measure(fn, meter, min_seconds=seconds, sync=sync)
    print(f"d12 fc GEMMs, {T} tokens, {seconds:g} s a variant, round {opts['rounds']}: "
          "zeros of g8 / x8, ms, J a call, W, MHz, ms against dense")
    for (kind, name, gemm), r in last.items():
        ms = 1e3 * r.seconds / r.calls
        base = last[(kind, "dense", gemm)] if (kind, "dense", gemm) in last else None
        rel = "" if base is None else f"x{(1e3 * base.seconds / base.calls) / ms:.3f}"
        zg, zx = zeros[(kind, name)]
        print(f"{kind:8s} {name:14s} {gemm:6s} {zg:5.2f} {zx:5.2f} {ms:8.4f} {r.joules_per_call:7.4f} {r.watts:5.0f} "
              f"{r.sm_mhz:5.0f} {rel}")


if __name__ == "__main__":
    main()
