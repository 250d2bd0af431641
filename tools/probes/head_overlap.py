"""Probe: the FP8 LM head's dlogits8 transpose beside its dx GEMM instead of after it.

Since the dlogits are thinned (forty-ninth session), the head's backward runs below the 700 W cap:
its GEMMs at ~1620-1830 MHz, the transpose (memory-bound, ~0.25 ms a d12 chunk) at 490-559 W. The
dx GEMM and the transpose both only read dlogits8, so they could run at once: cuBLASLt's SM count
target (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET) sizes the GEMM for S SMs and leaves the rest to the
transpose on a side stream; the dwte GEMM then waits for both. This times 8 chunks (d12 B=64's
65536 rows) of realistic thinned dlogits, back to back under NVML's counter at the cap:
  - "serial":   dx GEMM, transpose, dwte GEMM (today)
  - "serial S": the same with the dx GEMM sized for S SMs (its cost alone)
  - "overlap S": the transpose on a side stream beside the S-SM dx GEMM, then dwte
Run (GPU):  PYTHONPATH=. python3 tools/probes/head_overlap.py [seconds=1] [rounds=2] [sms=100,116,124]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import power
from gpucore.ops.classifier import dlogits_fp8_scale, sparse_tau_of
from gpucore.ops.fp8 import fp8_matmul, fp8_quantize, fp8_transpose

opts = dict(seconds="1", rounds="2", sms="100,116,124", chunks="8")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
R, V, C, TOKENS = 8192, 50304, 768, 65536
BF = gpucore.bfloat16


def thinned_dlogits8(rng, scale):
    """E5M2 dlogits8 (R, V) of realistic rows thinned below p = 2^-13, as the FP8 head writes them."""
    v = cp.arange(V, dtype=cp.float32)
    z = -cp.log1p(v)[None, :] + 3.0 * rng.standard_normal((R, V), dtype=cp.float32)
    z -= z.max(axis=1, keepdims=True)
    p = cp.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    u = rng.random((R, 1), dtype=cp.float32)
    target = cp.minimum((cp.cumsum(p, axis=1) < u).sum(axis=1), V - 1)
    p[cp.arange(R), target] -= 1.0
    d = p * (scale / TOKENS)
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
    dx, dw = cp.empty((R, C), BF), cp.zeros((V, C), BF)
    main_stream = cp.cuda.get_current_stream()
    side = cp.cuda.Stream(non_blocking=True)
    chunks = int(opts["chunks"])

    def serial(sm=0):
        for _ in range(chunks):
            fp8_matmul(d8, w8t, "e5m2", "e4m3", inv, one, out=dx, sm_count=sm)
            fp8_transpose(d8, out=d8t)
            fp8_matmul(d8t, x8t, "e5m2", "e4m3", inv, one, out=dw, accumulate=True)

    def overlap(sm):
        for _ in range(chunks):
            fork = main_stream.record()
            side.wait_event(fork)
            with side:
                fp8_transpose(d8, out=d8t)
            join = side.record()
            fp8_matmul(d8, w8t, "e5m2", "e4m3", inv, one, out=dx, sm_count=sm)
            main_stream.wait_event(join)
            fp8_matmul(d8t, x8t, "e5m2", "e4m3", inv, one, out=dw, accumulate=True)

    runs = {"serial": serial}
    for sm in (int(v) for v in opts["sms"].split(",")):
        runs[f"serial {sm}"] = lambda sm=sm: serial(sm)
        runs[f"overlap {sm}"] = lambda sm=sm: overlap(sm)
    # correctness: the overlapped path gives the serial one's bytes
    dw.fill(0)
    serial()
    want = (dx.copy(), dw.copy(), d8t.copy())
    for key, fn in runs.items():
        dw.fill(0)
        d8t.fill(0)
        fn()
        sync()
        same = all(bool((a == b).all()) for a, b in zip((dx, dw, d8t), want))
        print(f"{key:12s} outputs equal to serial's: {same}")
    seconds = float(opts["seconds"])
    last = {}
    for _ in range(int(opts["rounds"])):
        for key, fn in runs.items():
            power.measure(fn, meter, min_seconds=seconds / 2, sync=sync)
            last[key] = power.measure(fn, meter, min_seconds=seconds, sync=sync)
    print(f"{chunks} chunks of {R} rows (dx GEMM, dlogits8 transpose, dwte GEMM), {seconds:g} s a variant, "
          f"round {opts['rounds']}")
    print(f"{'variant':12s} {'ms/chunk':>9s} {'J/chunk':>8s} {'W':>5s} {'MHz':>5s}")
    for key, r in last.items():
        ms = 1e3 * r.seconds / r.calls / chunks
        print(f"{key:12s} {ms:9.4f} {r.joules_per_call / chunks:8.4f} {r.watts:5.0f} {r.sm_mhz:5.0f}")


if __name__ == "__main__":
    main()
