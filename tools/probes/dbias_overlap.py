"""Probe: the bias gradient beside the backward GEMMs instead of after them (DBIAS_STREAM="overlap").

For the linear-layer backward at the GPT-2 shapes (bf16 dout/x/W, bf16 grads), times in alternation:
raw gemmEx dx + dW (the bench's reference); the two Lt GEMMs planned for S - k SMs alone; the
persistent dbias kernel alone on k SMs (GB/s: what a few SMs can pull); the regular dbias kernel;
and matmul_backward with the dbias kernel after the GEMMs ("") and beside them ("overlap", k SMs).
Run:  PYTHONPATH=. python3 tools/probes/dbias_overlap.py [k ...]
"""
import sys

import cupy as cp

import gpucore
from gpucore import runtime
from gpucore.bench import time_interleaved
from gpucore.ops import matmul as mm

KS = [int(a) for a in sys.argv[1:]] or [4, 8, 12, 16]
SHAPES = [(65536, 768, 2304), (65536, 768, 3072), (65536, 3072, 768), (4096, 4096, 4096)]
S = runtime.sm_count()
bf16 = gpucore.dtypes.bfloat16
print(f"{runtime.device_properties()['name']}, {S} SMs, cuBLASLt {mm._lt().version}")
for (N, K, M) in SHAPES:               # rows, in features, out features: dout (N, M), x (N, K), W (M, K)
    rng = cp.random.default_rng(0)
    dout, x, w = (rng.standard_normal(s, dtype=cp.float32).astype(bf16) for s in ((N, M), (N, K), (M, K)))
    dx, dw, db = cp.empty((N, K), bf16), cp.zeros((M, K), bf16), cp.zeros((M,), bf16)

    def raw():
        mm._gemm_rowmajor(dout, w, dx, N, K, M)
        mm._gemm_rowmajor(dout, x, dw, M, K, N, transpose_a=True, beta=1.0)

    def gemms(k):
        def fn():
            mm._train_gemm(dout, w, dx, N, K, M, sm_target=S - k)
            mm._train_gemm(dout, x, dw, M, K, N, transpose_a=True, beta=1.0, sm_target=S - k)
        return fn

    def dbias_alone(k):
        return lambda: mm._bias_backward(db, dout, sms=k)

    def path(mode, k=0):
        def fn():
            old = mm.DBIAS_STREAM, mm.DBIAS_OVERLAP_SMS
            mm.DBIAS_STREAM, mm.DBIAS_OVERLAP_SMS = mode, k or old[1]
            try:
                gpucore.matmul_backward(dout, x, w, dx=dx, dweight=dw, dbias=db)
            finally:
                mm.DBIAS_STREAM, mm.DBIAS_OVERLAP_SMS = old
        return fn

    names = ["raw gemmEx dx+dW", "dbias kernel alone (all SMs)", "matmul_backward +dbias after"]
    fns = [raw, dbias_alone(0), path("")]
    for k in KS:
        names += [f"Lt GEMMs on {S - k} SMs", f"dbias persistent on {k} SMs", f"matmul_backward overlap k={k}"]
        fns += [gemms(k), dbias_alone(k), path("overlap", k)]
    ms = time_interleaved(fns, rounds=7, repeat=5)
    gb = dout.nbytes / 1e9
    print(f"\n{N}x{K}x{M}  (dout {gb * 1e3:.0f} MB)")
    for name, t in zip(names, ms):
        extra = f"{gb * 1e3 / t:7.0f} GB/s" if "dbias" in name and "matmul" not in name else f"{100 * ms[0] / t:6.1f}% of raw"
        print(f"  {name:40s} {t:8.4f} ms  {extra}")
    del dout, x, w, dx, dw, db
    cp.get_default_memory_pool().free_all_blocks()
