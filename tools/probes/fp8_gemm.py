"""Probe: the d12 step's linear-layer GEMMs in bf16 (the training path) vs FP8 (cuBLASLt, with and
without fast accumulation), and the FP8 cast kernel's bandwidth, at B*T = 65536. Answers: what can
FP8 save per step before any fusion? Run:  PYTHONPATH=. python3 tools/probes/fp8_gemm.py [N]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import copy_bandwidth_gbps, time_interleaved
from gpucore.ops.fp8 import fp8_matmul, fp8_quantize
from gpucore.ops.matmul import _train_gemm

N = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
C = 768
BF = gpucore.bfloat16
rng = np.random.default_rng(0)


def rnd(shape, s=1.0):
    return cp.asarray((s * rng.standard_normal(shape)).astype(np.float32)).astype(BF)


one = cp.ones(1, np.float32)
# (name, M, N, K, a_fmt, b_fmt) of out (M, N) = a (M, K) @ b (N, K)^T, per layer, x12 layers
shapes = []
for name, out_f, in_f in (("qkv", 3 * C, C), ("attproj", C, C), ("fc", 4 * C, C), ("fcproj", C, 4 * C)):
    shapes += [(f"{name} fwd", N, out_f, in_f, "e4m3", "e4m3"),
               (f"{name} dx", N, in_f, out_f, "e5m2", "e4m3"),
               (f"{name} dW", out_f, in_f, N, "e5m2", "e4m3")]
tot = {"bf16": 0.0, "fp8": 0.0, "fp8 fast": 0.0}
print(f"{'GEMM':<14}{'M':>7}{'N':>6}{'K':>7}  {'bf16 ms':>8} {'fp8 ms':>8} {'fast ms':>8}  TFLOP/s bf16/fp8/fast")
for name, M, Nn, K, fa, fb in shapes:
    a, b, out = rnd((M, K)), rnd((Nn, K), 0.05), cp.empty((M, Nn), BF)
    a8, b8 = cp.empty((M, K), np.uint8), cp.empty((Nn, K), np.uint8)
    fp8_quantize(a, fa, cp.asarray([4.0], np.float32), out=a8)
    fp8_quantize(b, fb, cp.asarray([64.0], np.float32), out=b8)
    acc = name.endswith("dW")
    fns = [lambda: _train_gemm(a, b, out, M, Nn, K, transpose_b=True, beta=1.0 if acc else 0.0),
           lambda: fp8_matmul(a8, b8, fa, fb, one, one, out=out, accumulate=acc),
           lambda: fp8_matmul(a8, b8, fa, fb, one, one, out=out, accumulate=acc, fast_accum=True)]
    ms = time_interleaved(fns, rounds=5)
    fl = 2.0 * M * Nn * K
    for k, t in zip(tot, ms):
        tot[k] += 12 * t
    print(f"{name:<14}{M:>7}{Nn:>6}{K:>7}  {ms[0]:8.3f} {ms[1]:8.3f} {ms[2]:8.3f}  "
          + "/".join(f"{fl / t / 1e9:.0f}" for t in ms))
print("per step (x12 layers): " + ", ".join(f"{k} {v:.1f} ms" for k, v in tot.items()))

copy = copy_bandwidth_gbps()
for R, Cc, both in ((N, C, False), (N, 4 * C, False), (N, 4 * C, True), (4 * C, C, True)):
    x = rnd((R, Cc))
    o, ot = cp.empty((R, Cc), np.uint8), cp.empty((Cc, R), np.uint8)
    am = cp.zeros(1, np.float32)
    fn = (lambda: fp8_quantize(x, "e5m2", one, out=o, out_t=ot, amax=am)) if both else \
        (lambda: fp8_quantize(x, "e4m3", one, out=o, amax=am))
    t = time_interleaved([fn], rounds=5)[0]
    nbytes = R * Cc * (2 + (2 if both else 1))
    print(f"cast {R}x{Cc}{' +transposed' if both else ''}: {t:.3f} ms, {nbytes / t / 1e6:.0f} GB/s "
          f"({100 * nbytes / t / 1e6 / copy:.0f}% of copy {copy:.0f})")
