"""Probe: the layernorm backward writing the residual gradient's E5M2 bytes itself (one pass,
layernorm_backward_fp8) against today's two passes (layernorm_backward, then fp8_quantize of dx):
interleaved medians of CUDA-event timings, and whether the bytes, dx and the amax are the same bits.
Measured: tools/notes/fp8.md, thirtieth session.
Run (GPU):  PYTHONPATH=. python3 tools/probes/layernorm_backward_fp8.py [rows=65536] [C=768] [rounds=7] [reps=20]
"""
import sys

import cupy as cp
import numpy as np

from gpucore import dtypes
from gpucore.ops.fp8 import fp8_quantize, fp8_transpose
from gpucore.ops.layernorm import layernorm_backward, layernorm_backward_fp8, layernorm_forward

opts = dict(rows="65536", C="768", rounds="7", reps="20")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
R, C, rounds, reps = (int(opts[k]) for k in ("rows", "C", "rounds", "reps"))
bf16 = dtypes.bfloat16
rng = cp.random.default_rng(0)
x = rng.standard_normal((R, C), dtype=cp.float32).astype(bf16)
w = (1 + 0.1 * rng.standard_normal(C, dtype=cp.float32)).astype(bf16)
b = (0.1 * rng.standard_normal(C, dtype=cp.float32)).astype(bf16)
_, mean, rstd = layernorm_forward(x, w, b)
dout = (1e-3 * rng.standard_normal((R, C), dtype=cp.float32)).astype(bf16)
dx0 = (1e-3 * rng.standard_normal((R, C), dtype=cp.float32)).astype(bf16)
scale = cp.full((1,), 4096.0, cp.float32)


def buffers():
    return dict(dx=dx0.copy(), dw=cp.zeros(C, cp.float32), db=cp.zeros(C, cp.float32),
                cs=cp.zeros(C, bf16), o8=cp.empty((R, C), cp.uint8), o8t=cp.empty((C, R), cp.uint8),
                am=cp.zeros(1, cp.float32))


def two_pass(s):
    layernorm_backward(dout, x, w, mean, rstd, dx=s["dx"], dweight=s["dw"], dbias=s["db"], dx_colsum=s["cs"])
    fp8_quantize(s["dx"], "e5m2", scale, out=s["o8"], out_t=s["o8t"], amax=s["am"])


def fused(rw, hint=False):
    return lambda s: layernorm_backward_fp8(dout, x, w, mean, rstd, scale, dx=s["dx"], dweight=s["dw"], dbias=s["db"],
                                            dx_colsum=s["cs"], out8=s["o8"], out8_t=s["o8t"], amax=s["am"],
                                            run_rows=rw, _hint=hint)


def fused_rows_only(s):        # the row-major bytes only (no transposed store)
    layernorm_backward_fp8(dout, x, w, mean, rstd, scale, dx=s["dx"], dweight=s["dw"], dbias=s["db"],
                           dx_colsum=s["cs"], out8=s["o8"], amax=s["am"], run_rows=16)


def fused_rows_then_transpose(s):
    fused_rows_only(s)
    fp8_transpose(s["o8"], out=s["o8t"])


def fused_t_only(s):
    layernorm_backward_fp8(dout, x, w, mean, rstd, scale, dx=s["dx"], dweight=s["dw"], dbias=s["db"],
                           dx_colsum=s["cs"], out8_t=s["o8t"], amax=s["am"], run_rows=16)


def backward_only(s):
    layernorm_backward(dout, x, w, mean, rstd, dx=s["dx"], dweight=s["dw"], dbias=s["db"], dx_colsum=s["cs"])


variants = {"backward + cast (today)": two_pass, "fused, runs of 8": fused(8), "fused, runs of 16": fused(16),
            "fused, runs of 32": fused(32), "runs of 8, evict_last": fused(8, True),
            "runs of 16, evict_last": fused(16, True), "fused rows only (no out8_t)": fused_rows_only,
            "fused rows + fp8_transpose": fused_rows_then_transpose, "fused out8_t only": fused_t_only,
            "backward alone": backward_only}

ref = buffers()
two_pass(ref)
for name in [n for n in variants if "run" in n] + ["fused rows + fp8_transpose"]:
    got = buffers()
    variants[name](got)
    same = {k: bool(cp.array_equal(got[k].view(cp.uint8), ref[k].view(cp.uint8))) for k in ("dx", "o8", "o8t", "am")}
    rel = {k: float(cp.abs(got[k].astype(cp.float64) - ref[k].astype(cp.float64)).max()
                    / cp.abs(ref[k].astype(cp.float64)).max()) for k in ("dw", "db", "cs")}
    print(f"{name}: bit for bit {same}; max rel diff of the sums {rel}")

state = {n: buffers() for n in variants}
times = {n: [] for n in variants}
start, stop = cp.cuda.Event(), cp.cuda.Event()
for n, f in variants.items():        # warm-up: compile, allocate
    f(state[n])
for _ in range(rounds):
    for n, f in variants.items():
        start.record()
        for _ in range(reps):
            f(state[n])
        stop.record()
        stop.synchronize()
        times[n].append(cp.cuda.get_elapsed_time(start, stop) / reps)
print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}  rows={R} C={C}  ms a call, median of {rounds} rounds")
for n in variants:
    t = np.array(times[n])
    print(f"  {n:28s} {np.median(t):.4f}  (min {t.min():.4f}, max {t.max():.4f})")
