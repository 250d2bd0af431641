"""Probe: search cuBLASLt's whole algorithm space for the dW GEMM with the BGRADB epilogue.

Issue 4's last line: matmul_backward + dbias at 65536x768x{2304,3072} runs at ~88-93% of the
two raw GEMMs, because the bias gradient needs one more pass over dout. The only way to get it
without that pass from cuBLAS is the BGRADB epilogue on the dW GEMM, and the heuristic offers
at most 8 BGRADB algorithms (which measured 90.8-96.8%). This probe asks for *every* algorithm
(cublasLtMatmulAlgoGetIds -> AlgoInit -> caps -> config: tile, stages, split-K, reduction,
swizzle, cluster -> AlgoCheck), times the valid ones and prints the best few beside
  raw:   gemmEx dx + gemmEx dW (beta=1)            -- the bench's reference
  path:  gpucore.matmul_backward with the dbias kernel (the default)
  heur:  dx + the heuristic's BGRADB candidates (best of them)
  best:  dx + the best enumerated BGRADB configuration
Run:  PYTHONPATH=. python3 tools/probes/lt_bgrad_search.py [ROWS IN OUT ...]   (default 65536 768 2304 65536 768 3072)

Measured (H200, cuBLASLt 13.1, 2026-11-24; tools/notes/matmul.md "Fourth session"): the
heuristic's BGRADB picks (all id 66) cost 0.10-0.16 ms more than the same configurations
without the epilogue; the best of ~4000 timed id-66 configurations, 0.45 ms (2304) / 0.56 ms
(3072) against 0.38 / 0.44 for the plain dW GEMM, gives dx + dW + db at 89.8-91.8% of dx + dW:
no better than the dbias kernel (87.6-91.2% in the same runs). The legacy ids (5-58) were
40% slower still.
"""
import ctypes
import itertools
import sys
import time

import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import time_interleaved
from gpucore.ops import matmul as mm

vp, i32, sz, u32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint32
CAP_SPLITK, CAP_REDUCTION_MASK, CAP_SWIZZLE, CAP_TILE_IDS, CAP_CUSTOM_MAX = 0, 1, 2, 6, 7
CAP_EPILOGUE_MASK, CAP_STAGES_IDS = 12, 13
CFG_ID, CFG_TILE, CFG_SPLITK, CFG_REDUCTION, CFG_SWIZZLE, CFG_CUSTOM, CFG_STAGES = 0, 1, 2, 3, 4, 5, 6
CFG_CLUSTER = 8
CLUSTERS = (0, 2, 3, 5)                 # AUTO, 1x1x1, 2x1x1, 1x2x1
SPLITS = (1, 2, 3, 4, 6, 8)
MAX_TIMED = 4000                        # configurations timed once per shape (after the cheap check)
ALGO_IDS = (66,)                        # H200, cuBLASLt 13.1: the heuristic's BGRADB picks are all id 66
                                        # (nvjet: 634 tile ids); the legacy ids (5-58) measured 40% slower


def bind(lib):
    for name, args in {
            "cublasLtMatmulAlgoGetIds": [vp, i32, i32, i32, i32, i32, i32, i32, vp, ctypes.POINTER(i32)],
            "cublasLtMatmulAlgoInit": [vp, i32, i32, i32, i32, i32, i32, i32, vp],
            "cublasLtMatmulAlgoCapGetAttribute": [vp, i32, vp, sz, ctypes.POINTER(sz)],
            "cublasLtMatmulAlgoConfigSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoConfigGetAttribute": [vp, i32, vp, sz, ctypes.POINTER(sz)],
            "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, vp, vp]}.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, i32


def cap(lib, algo, attr, ctype=u32):
    v, n = ctype(), sz()
    st = lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.addressof(algo), attr, ctypes.addressof(v),
                                               ctypes.sizeof(v), ctypes.byref(n))
    return v.value if st == 0 else None


def cap_list(lib, algo, attr):
    n = sz()
    lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.addressof(algo), attr, None, 0, ctypes.byref(n))
    count = n.value // 4
    if count == 0:
        return []
    arr = (u32 * count)()
    lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.addressof(algo), attr, ctypes.addressof(arr), n.value,
                                          ctypes.byref(n))
    return list(arr)


def cfg_get(lib, algo_ptr, attr, ctype=u32):
    v, n = ctype(), sz()
    lib.cublasLtMatmulAlgoConfigGetAttribute(algo_ptr, attr, ctypes.addressof(v), ctypes.sizeof(v), ctypes.byref(n))
    return v.value


def describe(lib, algo_ptr):
    return (f"id={cfg_get(lib, algo_ptr, CFG_ID, ctypes.c_int32)} tile={cfg_get(lib, algo_ptr, CFG_TILE)} "
            f"stages={cfg_get(lib, algo_ptr, CFG_STAGES)} splitk={cfg_get(lib, algo_ptr, CFG_SPLITK)} "
            f"red={cfg_get(lib, algo_ptr, CFG_REDUCTION)} swz={cfg_get(lib, algo_ptr, CFG_SWIZZLE)} "
            f"custom={cfg_get(lib, algo_ptr, CFG_CUSTOM)} cluster={cfg_get(lib, algo_ptr, CFG_CLUSTER, ctypes.c_uint16)}")


def search(rows, k_in, n_out, grad_dtype):
    lt = mm._lt()
    lib = lt.lib
    bind(lib)
    dev, handle, ws = lt.device_state()
    bf16 = gpucore.dtypes.bfloat16
    rng = cp.random.default_rng(0)
    x = rng.standard_normal((rows, k_in), dtype=cp.float32).astype(bf16)
    w = (0.02 * rng.standard_normal((n_out, k_in), dtype=cp.float32)).astype(bf16)
    dout = rng.standard_normal((rows, n_out), dtype=cp.float32).astype(bf16)
    dx = cp.empty((rows, k_in), bf16)
    dw = cp.zeros((n_out, k_in), grad_dtype)
    db = cp.zeros((n_out,), grad_dtype)
    scratch = cp.zeros((n_out,), cp.float32 if grad_dtype == cp.float32 else bf16)
    shape = f"{rows}x{k_in}x{n_out} grads={cp.dtype(grad_dtype).name}"

    # The BGRADB plan exactly as the training path builds it (dW = dout^T @ x, beta = 1).
    mm._lt_gemm_rowmajor(dout, x, dw, n_out, k_in, rows, transpose_a=True, beta=1.0, bgrad=scratch)
    key = [k for k in lt.plans if k[11] == mm._LT_EPILOGUE_BGRADB and k[3:6] == (n_out, k_in, rows)
           and k[10] == mm._cuda_type(dw.dtype)]
    plan = lt.plans[key[-1]]
    if plan is None:
        print(f"{shape}: no BGRADB plan")
        return
    al, be = ctypes.c_float(1.0), ctypes.c_float(1.0)
    stream = cp.cuda.get_current_stream().ptr
    scratch_dw = cp.zeros_like(dw)

    def launch_algo(algo_ptr):
        st = lib.cublasLtMatmul(handle, plan.desc, ctypes.addressof(al), x.data.ptr, plan.lay_b, dout.data.ptr,
                                plan.lay_a, ctypes.addressof(be), scratch_dw.data.ptr, plan.lay_c,
                                scratch_dw.data.ptr, plan.lay_c, algo_ptr, ws.data.ptr, mm.LT_WORKSPACE_BYTES,
                                stream)
        if st != 0:
            raise RuntimeError(f"status {st}")

    # Enumerate.
    ta = tb = mm._cuda_type(bf16)
    tc = mm._cuda_type(dw.dtype)
    ids = (i32 * 256)()
    n_ids = i32()
    lib.cublasLtMatmulAlgoGetIds(handle, mm._CUBLAS_COMPUTE_32F, cp.cuda.runtime.CUDA_R_32F, ta, tb, tc, tc, 256,
                                 ctypes.addressof(ids), ctypes.byref(n_ids))
    t0 = time.time()
    valid = []                          # (algo bytes, waves)
    for algo_id in [i for i in list(ids)[:n_ids.value] if i in ALGO_IDS]:
        base = (ctypes.c_ubyte * 64)()
        if lib.cublasLtMatmulAlgoInit(handle, mm._CUBLAS_COMPUTE_32F, cp.cuda.runtime.CUDA_R_32F, ta, tb, tc, tc,
                                      algo_id, ctypes.addressof(base)) != 0:
            continue
        epi = cap(lib, base, CAP_EPILOGUE_MASK)
        if epi is None or not epi & mm._LT_EPILOGUE_BGRADB:
            continue
        tiles = cap_list(lib, base, CAP_TILE_IDS) or [0]
        stages = cap_list(lib, base, CAP_STAGES_IDS) or [0]
        splitk_ok = cap(lib, base, CAP_SPLITK, ctypes.c_int32)
        red_mask = cap(lib, base, CAP_REDUCTION_MASK) or 0
        swz = (0, 1) if cap(lib, base, CAP_SWIZZLE) else (0,)
        custom_max = min(cap(lib, base, CAP_CUSTOM_MAX, ctypes.c_int32) or 0, 3)
        reds = [r for r in (1, 2, 4) if red_mask & r]
        print(f"  algo {algo_id}: {len(tiles)} tiles, {len(stages)} stages, splitk={splitk_ok}, "
              f"red_mask={red_mask}, swizzle={swz}, custom<= {custom_max}")
        for tile, stage, split, s, custom, cluster in itertools.product(
                tiles, stages, SPLITS if splitk_ok else (1,), swz, range(custom_max + 1), CLUSTERS):
            for red in (reds if split > 1 else [0]):
                algo = (ctypes.c_ubyte * 64)()
                ctypes.memmove(algo, base, 64)
                ptr = ctypes.addressof(algo)
                for attr, val, ct in ((CFG_TILE, tile, u32), (CFG_STAGES, stage, u32), (CFG_SPLITK, split, u32),
                                      (CFG_REDUCTION, red, u32), (CFG_SWIZZLE, s, u32), (CFG_CUSTOM, custom, u32),
                                      (CFG_CLUSTER, cluster, ctypes.c_uint16)):
                    v = ct(val)
                    lib.cublasLtMatmulAlgoConfigSetAttribute(ptr, attr, ctypes.addressof(v), ctypes.sizeof(v))
                res = (ctypes.c_ubyte * mm._LT_HEURISTIC_BYTES)()
                if lib.cublasLtMatmulAlgoCheck(handle, plan.desc, plan.lay_b, plan.lay_a, plan.lay_c, plan.lay_c,
                                               ptr, ctypes.addressof(res)) != 0:
                    continue
                ws_need = int.from_bytes(bytes(res[64:72]), "little")
                if ws_need > mm.LT_WORKSPACE_BYTES:
                    continue
                waves = np.frombuffer(bytes(res[76:80]), np.float32)[0]
                valid.append((algo, float(waves)))
    print(f"{shape}: {len(valid)} valid BGRADB configurations ({time.time() - t0:.1f} s to enumerate)")
    # Coarse timing: one warm call, one timed call each; drop the slow.
    coarse = []
    for algo, waves in valid[:MAX_TIMED]:
        ptr = ctypes.addressof(algo)
        try:
            launch_algo(ptr)
        except RuntimeError:
            continue
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        launch_algo(ptr)
        e.record()
        e.synchronize()
        coarse.append((cp.cuda.get_elapsed_time(s, e), algo, waves))
        if len(coarse) >= MAX_TIMED:
            break
    coarse.sort(key=lambda t: t[0])
    print(f"  timed {len(coarse)} once; fastest {coarse[0][0]:.4f} ms" if coarse else "  none ran")

    # The references and the best 8 configurations, in alternation.
    def raw():
        mm._gemm_rowmajor(dout, w, dx, rows, k_in, n_out)
        mm._gemm_rowmajor(dout, x, dw, n_out, k_in, rows, transpose_a=True, beta=1.0)

    def path():
        gpucore.matmul_backward(dout, x, w, dx=dx, dweight=dw, dbias=db)

    def dx_only():
        mm._train_gemm(dout, w, dx, rows, k_in, n_out)

    def dw_raw():
        mm._gemm_rowmajor(dout, x, dw, n_out, k_in, rows, transpose_a=True, beta=1.0)

    heur = [lambda i=i: launch_algo(plan.algo_ptr(i)) for i in plan.candidates]
    # The same GEMM without the epilogue (its own plan): what the BGRADB epilogue costs at equal configs.
    mm._lt_gemm_rowmajor(dout, x, dw, n_out, k_in, rows, transpose_a=True, beta=1.0)
    plain_key = [k for k in lt.plans if k[11] == mm._LT_EPILOGUE_DEFAULT and k[3:6] == (n_out, k_in, rows)
                 and k[10] == mm._cuda_type(dw.dtype)]
    plain = lt.plans[plain_key[-1]]

    def launch_plain(algo_ptr):
        lt._ok(lib.cublasLtMatmul(handle, plain.desc, ctypes.addressof(al), x.data.ptr, plain.lay_b, dout.data.ptr,
                                  plain.lay_a, ctypes.addressof(be), scratch_dw.data.ptr, plain.lay_c,
                                  scratch_dw.data.ptr, plain.lay_c, algo_ptr, ws.data.ptr, mm.LT_WORKSPACE_BYTES,
                                  stream), "plain")
    plain_fns = [lambda i=i: launch_plain(plain.algo_ptr(i)) for i in plain.candidates]
    top = coarse[:8]
    best_fns = [lambda p=ctypes.addressof(a): launch_algo(p) for _, a, _ in top]
    times = time_interleaved([raw, path, dx_only, dw_raw] + heur + best_fns + plain_fns)
    raw_ms, path_ms, dx_ms, dw_ms = times[:4]
    heur_ms = times[4:4 + len(heur)]
    best_ms = times[4 + len(heur):4 + len(heur) + len(best_fns)]
    plain_ms = times[4 + len(heur) + len(best_fns):]
    print(f"  raw dx+dW {raw_ms:.4f} ms | path (dbias kernel) {path_ms:.4f} ms = {raw_ms / path_ms:.1%} | "
          f"dx {dx_ms:.4f} | dW gemmEx {dw_ms:.4f}")
    for i, t in zip(plan.candidates, heur_ms):
        print(f"  heuristic #{i}: dW+BGRADB {t:.4f} ms -> dx+that {raw_ms / (dx_ms + t):.1%}  "
              f"{describe(lib, plan.algo_ptr(i))}")
    for (_, a, waves), t in sorted(zip(top, best_ms), key=lambda p: p[1]):
        print(f"  enumerated: dW+BGRADB {t:.4f} ms -> dx+that {raw_ms / (dx_ms + t):.1%}  waves={waves:.2f}  "
              f"{describe(lib, ctypes.addressof(a))}")
    for i, t in zip(plain.candidates, plain_ms):
        print(f"  no epilogue, heuristic #{i}: dW {t:.4f} ms  {describe(lib, plain.algo_ptr(i))}")
    del x, w, dout, dx, dw, db, scratch, scratch_dw
    cp.get_default_memory_pool().free_all_blocks()


def main():
    args = [int(v) for v in sys.argv[1:]] or [65536, 768, 2304, 65536, 768, 3072]
    print(f"cuBLASLt {mm._lt().version}, {gpucore.runtime.device_properties()['name']}")
    for rows, k_in, n_out in zip(args[0::3], args[1::3], args[2::3]):
        for gdt in (gpucore.dtypes.bfloat16, cp.float32):
            search(rows, k_in, n_out, gdt)


if __name__ == "__main__":
    main()
