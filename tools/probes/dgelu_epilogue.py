"""Probe: the GELU backward inside the fcproj dx GEMM (cuBLASLt's DGELU_BGRAD epilogue), for issue 15.

bf16 training today: the fcproj dx GEMM writes dg = dres @ W (bf16), then gelu_backward reads dg and
fch and writes dfch = dg * gelu'(fch) with the fc bias gradient (its column sums) on the way: 2 + 2
bytes read and 2 written per value after the GEMM's 2. With DGELU_BGRAD the GEMM's epilogue reads
fch and writes dfch and the column sums itself: dg never exists. The second session measured the
DGELU epilogue with a separate column sum (no faster, an H100, 2026-11-25); this times the BGRAD
form too, raced as the training path races, at d12 and d48 shapes, in alternation, and checks what
it writes against today's path (and bit for bit against itself).
Run:  PYTHONPATH=. python3 tools/probes/dgelu_epilogue.py [models=d12,d48] [search=0]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import cublas, settings
from gpucore.bench import time_interleaved
from gpucore.ops.colsum import colsum
from gpucore.ops.gelu import gelu_backward
from gpucore.ops.matmul import _train_gemm      # the training path's GEMM (Lt, or gemmEx if it won the race)

opts = dict(models="d12,d48", search="0")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
BF = gpucore.bfloat16
rng = np.random.default_rng(0)
MODELS = {"d12": (65536, 768), "d48": (16384, 1600)}


def rnd(shape, s=1.0):
    return cp.asarray((s * rng.standard_normal(shape)).astype(np.float32)).astype(BF)


with settings.using(lt_search=int(opts["search"]), lt_tune_cache="/tmp/dgelu_epilogue.json"):
    for model in opts["models"].split(","):
        N, C = MODELS[model]
        M4 = 4 * C
        dres, w, fch = rnd((N, C), 1e-4), rnd((C, M4), 0.02), rnd((N, M4))
        dg, dfch, dfch2 = cp.empty((N, M4), BF), cp.empty((N, M4), BF), cp.empty((N, M4), BF)
        db_a, db_c = cp.zeros(M4, np.float32), cp.zeros(M4, np.float32)
        db_b = {t: cp.zeros(M4, t) for t in (np.float32, BF)}

        def today():
            _train_gemm(dres, w, dg, N, M4, C)
            gelu_backward(dg, fch, dx=dg, dbias=db_a)

        def dgelu_colsum():
            assert cublas.lt_gemm(dres, w, dfch2, N, M4, C, dgelu_of=fch)
            colsum(db_c, dfch2)

        fns = {"today: GEMM, then gelu_backward(dbias=)": today, "DGELU, then colsum": dgelu_colsum}
        for t, db in db_b.items():
            def bgrad(db=db, out=dfch):
                if not cublas.lt_gemm(dres, w, out, N, M4, C, dgelu_of=fch, dgelu_dbias=db):
                    raise RuntimeError("no algorithm")
            try:
                bgrad()
                fns[f"DGELU_BGRAD, {np.dtype(t).name} dbias"] = bgrad
            except Exception as e:      # noqa: BLE001 -- report, go on with the others
                print(f"{model}: DGELU_BGRAD with a {np.dtype(t).name} dbias: {e}")
        today()
        dgelu_colsum()
        cp.cuda.Device().synchronize()
        ref = dg.astype(np.float32)     # today's dfch (in place over dg)
        scale = float(cp.abs(ref).max())
        for name in [k for k in fns if k.startswith("DGELU_BGRAD")]:
            t = np.float32 if "float32" in name else BF
            db_a.fill(0)
            today()
            fns[name]()
            first = dfch.copy(), db_b[t].copy()
            fns[name]()
            same = bool((first[0].view(np.uint16) == dfch.view(np.uint16)).all()) and \
                bool((first[1].astype(np.float32) == db_b[t].astype(np.float32)).all())
            gap = float(cp.abs(dfch.astype(np.float32) - ref).max()) / scale
            dbs = db_b[t].astype(np.float32)
            dgap = float(cp.abs(dbs - db_a).max() / cp.abs(db_a).max())
            print(f"{model} {name}: dfch max gap {gap:.2e} of max |dfch|; dbias max gap {dgap:.2e} of max; "
                  f"run to run bitwise {same}")
        gap = float(cp.abs(dfch2.astype(np.float32) - ref).max()) / scale
        print(f"{model} DGELU: dfch max gap {gap:.2e} of max |dfch|")
        times = time_interleaved(list(fns.values()), rounds=9, repeat=10)
        for name, t in zip(fns, times):
            print(f"  {model} {N}x{M4}x{C} {name:<40} {t:.4f} ms  (x{times[0] / t:.3f} vs today)")
