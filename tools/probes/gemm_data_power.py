"""Probe: does a GEMM's power depend on the numbers it multiplies?

tools/probes/step_ablation.py found steps running 13% faster at a higher clock when a skipped op
left the backward GEMMs multiplying zeros. This measures the effect directly: one d12-shaped bf16
GEMM (the fcproj dx shape, M x N x K = 65536 x 768 x 3072, through gpucore.matmul_backward as the
model calls it) on operands drawn in different ways, each run back to back under NVML's energy
counter (gpucore/power.py), the variants in rotation over `rounds` rounds (the last round's
figures are printed for each, after the earlier rounds warmed everything):

  normal      N(0, 1) bf16 (random mantissas: the most bit toggling)
  small       N(0, 1e-3): the same mantissas' entropy, smaller exponents
  half-zero   N(0, 1) with every other K element zero
  few-bits    N(0, 1) rounded to 3 significant bits (bf16 keeps 8)
  zeros       all zero
  realistic   a gradient-like dout (N(0, 1) x 1e-4, as the model's dout) against weights N(0, 0.02)

Run (GPU):  PYTHONPATH=. python3 tools/probes/gemm_data_power.py [seconds=0.5] [rounds=2]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import power
from gpucore.ops.matmul import matmul_backward

opts = dict(seconds="0.5", rounds="2")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
M, N, K = 65536, 768, 3072          # dx (M, K) = dout (M, N) @ W (N, K): fcproj's dx at d12 B=64
BF = gpucore.bfloat16


def operands(kind, rng):
    def normal(shape, s=1.0):
        return (s * rng.standard_normal(shape, dtype=np.float32))
    if kind == "zeros":
        return np.zeros((M, N), np.float32), np.zeros((N, K), np.float32)
    if kind == "realistic":
        return normal((M, N), 1e-4), normal((N, K), 0.02)
    dout, w = normal((M, N)), normal((N, K))
    if kind == "small":
        dout, w = dout * 1e-3, w * 1e-3
    elif kind == "half-zero":
        dout[:, 1::2] = 0.0
        w[1::2, :] = 0.0
    elif kind == "few-bits":
        def round_bits(x, bits=3):
            m, e = np.frexp(x)
            return np.ldexp(np.round(m * 2 ** bits) / 2 ** bits, e).astype(np.float32)
        dout, w = round_bits(dout), round_bits(w)
    return dout, w


def main():
    meter = power.require_meter()
    sync = cp.cuda.Device().synchronize
    rng = np.random.default_rng(0)
    x = cp.empty((M, K), BF)               # only its shape is read (need_dweight=False)
    dx = cp.empty((M, K), BF)
    kinds = ["normal", "small", "half-zero", "few-bits", "zeros", "realistic"]
    runs = {}
    for kind in kinds:
        d, w = operands(kind, rng)
        dout, weight = cp.asarray(d).astype(BF), cp.asarray(w).astype(BF)
        runs[kind] = (lambda dout=dout, weight=weight:
                      matmul_backward(dout, x, weight, dx=dx, need_dweight=False, need_dbias=False))
        runs[kind]()
    sync()
    seconds = float(opts["seconds"])
    last = {}
    for _ in range(int(opts["rounds"])):
        for kind in kinds:
            power.measure(runs[kind], meter, min_seconds=seconds / 2, sync=sync)      # settle
            r = power.measure(runs[kind], meter, min_seconds=seconds, sync=sync)
            last[kind] = r
    flops = 2.0 * M * N * K
    base = last["normal"]
    print(f"bf16 GEMM {M}x{N}x{K} (fcproj dx, d12 B=64), {seconds:.1f} s per variant, round {opts['rounds']}")
    print(f"{'operands':12s} {'ms':>7s} {'TFLOP/s':>8s} {'J/call':>7s} {'W':>5s} {'MHz':>5s} {'J vs normal':>11s}")
    for kind in kinds:
        r = last[kind]
        ms = 1e3 * r.seconds / r.calls
        print(f"{kind:12s} {ms:7.4f} {flops / ms / 1e9:8.0f} {r.joules_per_call:7.4f} {r.watts:5.0f} "
              f"{r.sm_mhz:5.0f} {r.joules_per_call / base.joules_per_call:10.2f}x")


if __name__ == "__main__":
    main()
