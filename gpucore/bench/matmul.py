"""`gpucore bench matmul`: the cuBLAS training path and our GEMM ladder, in TFLOP/s and % of cuBLAS.

Shapes are M x K x N (C (M, N) = A (M, K) @ B (K, N)): 4096^3 and the GPT-2
124M linear layers at B*T = 65536 rows: qkv 65536x768x2304, fc 65536x768x3072,
fcproj 65536x3072x768, lm_head 65536x768x50304 (the attention projection
65536x768x768 is not in the list of the issue; add it with --opt shapes=...).

Rows printed (--version all, the default):
  cublas gemmEx bf16 NT        raw cuBLAS on the forward's layout x @ W^T: the reference
  matmul_forward (+bias / -)   our training path vs that reference      target 95%
                               (path=cublasLt: bias fused in the epilogue, algorithm chosen
                               by a one-time timing race, algo= says which won; also shown:
                               the heuristic's first choice untimed, and the gemmEx fallback,
                               bias-fill kernel + GEMM with beta=1)
  cublas gemmEx bf16 dx+dW     raw cuBLAS: the two backward GEMMs
  cublas dx+dW+db (db: ...)    raw cuBLAS doing the same work as a backward with a bias
                               gradient: db by gemmEx (ones^T @ dout), or by cuBLASLt's BGRADB
                               epilogue on the dW GEMM (the heuristic's first algorithm)
  matmul_backward (dx+dW [+db]) vs raw cuBLAS doing the same work                target 95%
                               (no bias: vs the two GEMMs; +dbias: vs the fastest "dx+dW+db"
                               row, vs_dx+dW_alone= gives the ratio to the two GEMMs, which do
                               not read dout a third time; dbias= says how db was made; also
                               shown: the dbias kernel's other places (DBIAS_STREAM) and the
                               BGRADB path raced over its candidates; fp32 and bf16 dW / dbias)
  gemm v1..v3 fp32             vs cuBLAS fp32 (SGEMM, no TF32) at 4096^3; v3 must reach
                               15 TFLOP/s, so its target is 15 / cuBLAS-fp32 TFLOP/s
  gemm v4 / v4w / v4b / v4c / v5 / v6 vs cuBLAS bf16 on the same NN layout    target 50% (4096^3)
                               (v4w: the 128x256-tile, 64x64-warp variant of v4; v4b, v4c:
                               gemm_tc2.cu, 64x64 warps with register-double-buffered fragments;
                               v5: gemm_wgmma.cu, Hopper wgmma, skipped on other GPUs; v6: v5
                               warp-specialized, producer warpgroup + mbarriers)
Options: --version all|train|1|2|3|4|4w|4b|4c|5|6 (comma lists work), --opt shapes=MxKxN,...
v1/v2 run at 4096^3 only (at the GPT-2 shapes they take seconds per call).
"""
from __future__ import annotations

import contextlib

from .. import dtypes
from . import Result, benchmark, random_array, time_interleaved, time_ms

SQUARE = (4096, 4096, 4096)
GPT2_SHAPES = [(65536, 768, 2304), (65536, 768, 3072), (65536, 3072, 768), (65536, 768, 50304)]
V3_GOAL_TFLOPS = 15.0


_rand = random_array


def _parse_shapes(shapes):
    if shapes is None:
        return [SQUARE] + GPT2_SHAPES
    if isinstance(shapes, str):
        shapes = shapes.split(",")
    return [tuple(int(v) for v in str(s).lower().split("x")) for s in shapes]


def _parse_versions(version):
    if version in (None, "all"):
        return ["train", 1, 2, 3, 4, "4w", "4b", "4c", 5, 6]
    out = []
    for v in str(version).split(","):
        v = v.strip()
        out.append(int(v) if v.isdigit() else v)
    return out


def _flops(M, K, N):
    return 2.0 * M * K * N


def _free():
    import cupy
    cupy.get_default_memory_pool().free_all_blocks()


def _lt_choice(mm, M, K, N):
    """Which algorithm the timing race picked for the no-bias forward GEMM x (M, K) @ W (N, K)^T."""
    lt = mm._lt()
    if lt is None:
        return "-"
    for key, plan in lt.plans.items():
        # key = (dev, op_a, op_b, M, N, K, ..., epilogue (11), ..., beta != 0 (last)); forward: op_b = T
        if plan is None or key[1:6] != (0, 1, M, N, K) or key[11] != mm._LT_EPILOGUE_DEFAULT or key[-1]:
            continue
        c = plan.choice
        if c is None:
            return "untuned"
        return "gemmEx" if c == mm.GEMMEX else f"lt#{plan.candidates.index(c) + 1}/{len(plan.candidates)}"
    return "?"


@contextlib.contextmanager
def _settings(module, **values):
    """Set module-level switches (e.g. LT_BGRAD=True) for a with-block, then put them back.
    A value of None leaves that switch as it is."""
    values = {k: v for k, v in values.items() if v is not None}
    saved = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def _bench_train(M, K, N, with_bias):
    """Forward and backward of a linear layer x (M, K) @ W (N, K)^T against raw gemmEx."""
    import cupy

    import gpucore
    from ..ops import matmul as mm
    x, w = _rand((M, K), "bf16"), _rand((N, K), "bf16", 0.02)
    b = _rand((N,), "bf16") if with_bias else None
    out = _rand((M, N), "bf16")
    shape = f"{M}x{K}x{N}"
    fl = _flops(M, K, N)
    rows = []
    # raw and path timed in alternation (time_interleaved): back-to-back runs drift by 5-10%
    raw_ms, ms = time_interleaved([lambda: mm._gemm_rowmajor(x, w, out, M, N, K, transpose_b=True),
                                   lambda: gpucore.matmul_forward(x, w, b, out=out)])
    raw = Result(f"cublas gemmEx bf16 NT {shape}", raw_ms, flops=fl)
    rows.append(raw)
    path = "cublasLt" if mm._lt() is not None else f"gemmEx ({mm.LT_STATUS})"
    extra = {"path": path}
    if not with_bias:
        extra["algo"] = _lt_choice(mm, M, K, N)
    rows.append(Result(f"matmul_forward {'+bias' if with_bias else 'no bias'} {shape}", ms, flops=fl,
                       ref_tflops=raw.tflops, target=0.95, extra=extra))
    if mm._lt() is not None and mm.LT_AUTOTUNE:     # what the timing race gains over the heuristic
        with _settings(mm, LT_AUTOTUNE=False):
            ms = time_ms(lambda: gpucore.matmul_forward(x, w, b, out=out))
        rows.append(Result(f"matmul_forward {'+bias' if with_bias else 'no bias'} {shape} (Lt heuristic #1)",
                           ms, flops=fl, ref_tflops=raw.tflops))
    if with_bias and mm._lt() is not None:       # what the Lt bias epilogue saves over the fallback
        with _settings(mm, USE_CUBLASLT=False):
            ms = time_ms(lambda: gpucore.matmul_forward(x, w, b, out=out))
        rows.append(Result(f"matmul_forward +bias {shape} (bias fill + gemmEx beta=1)", ms, flops=fl,
                           ref_tflops=raw.tflops))
    # backward: dx (M, K) = dout @ W, dW (N, K) += dout^T @ x, db += colsum(dout)
    dout = out
    dx = _rand((M, K), "bf16")
    for gdt in ("float32", "bf16") if with_bias else ("float32",):
        dw = _rand((N, K), gdt)
        db = _rand((N,), gdt) if with_bias else None
        tag = "" if gdt == "float32" else " bf16 grads"
        def raw_backward():
            mm._gemm_rowmajor(dout, w, dx, M, K, N)
            mm._gemm_rowmajor(dout, x, dw, N, K, M, transpose_a=True, beta=1.0)

        def raw_backward_db_gemm():     # raw cuBLAS doing the same work: db += ones^T @ dout by gemmEx
            raw_backward()
            mm._gemm_rowmajor(ones, dout, db, 1, N, M, beta=1.0)

        def raw_backward_db_bgradb():   # ... or db from Lt's BGRADB epilogue, the heuristic's first choice
            mm._gemm_rowmajor(dout, w, dx, M, K, N)
            with _settings(mm, LT_BGRAD=True, LT_AUTOTUNE=False):
                if mm._dweight_dbias_fused(db, dout, x, dw, N, K, M, 1.0) is None:
                    raise RuntimeError("no BGRADB algorithm")

        def path_backward(stream_mode=None, bgrad=None):
            with _settings(mm, DBIAS_STREAM=stream_mode, LT_BGRAD=bgrad):
                gpucore.matmul_backward(dout, x, w, dx=dx, dweight=dw, dbias=db, need_dbias=with_bias)

        # With a bias: the same-work raw references, the dbias kernel's other places (DBIAS_STREAM)
        # and the other dbias path (LT_BGRAD); all timed in the same rounds.
        same_work, variants = [], []    # (label, fn)
        if with_bias:
            ones = cupy.ones((1, M), dtype=dtypes.bfloat16)
            same_work = [("gemmEx ones^T @ dout", raw_backward_db_gemm)]
            try:
                raw_backward_db_bgradb()
                same_work.append(("Lt BGRADB epilogue, heuristic #1", raw_backward_db_bgradb))
            except RuntimeError:
                pass                    # no Lt, or no BGRADB algorithm for this layout
            variants = [(f"dbias kernel {m or 'after the GEMMs'}{' on a side stream' if m else ''}",
                         lambda m=m: path_backward(stream_mode=m))
                        for m in ("", "first", "last") if m != mm.DBIAS_STREAM]
            if mm._lt() is not None:
                other = "dbias kernel" if mm.LT_BGRAD else "BGRADB epilogue, raced"
                variants.append((other, lambda: path_backward(bgrad=not mm.LT_BGRAD)))
                variants[-1][1]()       # the race among its candidates happens here, untimed
        raw_ms, ms, *other_ms = time_interleaved([raw_backward, path_backward] + [f for _, f in same_work]
                                                 + [f for _, f in variants])
        same_ms, variant_ms = other_ms[:len(same_work)], other_ms[len(same_work):]
        raw_bwd = Result(f"cublas gemmEx bf16 dx+dW{tag} {shape}", raw_ms, flops=2 * fl)
        rows.append(raw_bwd)
        ref = raw_bwd
        if with_bias:
            # The bias gradient is work the two GEMMs do not do (one more read of dout, unless it is
            # fused into a GEMM): the target compares with the fastest raw cuBLAS way to do it too.
            for (how, _), t in zip(same_work, same_ms):
                rows.append(Result(f"cublas dx+dW+db{tag} {shape} (db: {how})", t, flops=2 * fl,
                                   ref_tflops=raw_bwd.tflops))
            ref = min(rows[-len(same_work):], key=lambda r: r.ms)
        extra = {}
        if with_bias:                   # one more call, to learn which dbias path it took
            scratch = mm._dweight_dbias_fused(db, dout, x, dw, N, K, M, 1.0)
            extra["dbias"] = f"BGRADB-epilogue,{scratch}-scratch" if scratch else "kernel"
            extra["dbias_stream"] = mm.DBIAS_STREAM or "after"
            extra["vs_dx+dW_alone"] = f"{raw_bwd.ms / ms:.1%}"
        rows.append(Result(f"matmul_backward {'+dbias' if with_bias else 'no bias'}{tag} {shape}", ms,
                           flops=2 * fl, ref_tflops=ref.tflops, target=0.95, extra=extra))
        for (suffix, _), v_ms in zip(variants, variant_ms):
            rows.append(Result(f"matmul_backward +dbias{tag} {shape} ({suffix})", v_ms, flops=2 * fl,
                               ref_tflops=ref.tflops))
        del dw, db
    del x, w, b, out, dx
    _free()
    return rows


def _bench_ladder(version, M, K, N, refs):
    """Our gemm vN against cuBLAS on the same (NN) layout and dtype. refs caches the printed cuBLAS
    row per shape; the % of each version is against cuBLAS timed in alternation with it (v1/v2,
    seconds per call: against the cached row)."""
    import gpucore
    from ..ops import matmul as mm
    dt = "bf16" if version in mm.TC_VERSIONS else "float32"
    a, b = _rand((M, K), dt), _rand((K, N), dt)
    c = _rand((M, N), dt)
    shape = f"{M}x{K}x{N}"
    fl = _flops(M, K, N)
    rows = []
    key = (dt, M, K, N)
    if key not in refs:
        ms = time_ms(lambda: mm._gemm_rowmajor(a, b, c, M, N, K))
        refs[key] = Result(f"cublas gemmEx {dtypes.name(a.dtype)} NN {shape}", ms, flops=fl)
        rows.append(refs[key])
    ref = refs[key]

    def ours():
        gpucore.gemm(a, b, out=c, version=version)

    target, extra = None, {}
    if version in (1, 2):               # seconds per call: timed alone, against the cached reference
        ms = time_ms(ours, warmup=1, repeat=3)
    else:                               # timed in alternation with cuBLAS: clocks drift 5-10% between runs
        ref_ms, ms = time_interleaved([lambda: mm._gemm_rowmajor(a, b, c, M, N, K), ours], rounds=5, repeat=10)
        ref = Result(ref.name, ref_ms, flops=fl)
        extra["cublas"] = f"{ref.tflops:.1f}TFLOP/s"
    if version in mm.TC_VERSIONS and (M, K, N) == SQUARE:
        target = 0.5
    if version == 3:
        target = V3_GOAL_TFLOPS / ref.tflops if ref.tflops else None
        extra["goal"] = f"{V3_GOAL_TFLOPS:.0f}TFLOP/s"
    rows.append(Result(f"gemm v{version} {dtypes.name(a.dtype)} {shape}", ms, flops=fl,
                       ref_tflops=ref.tflops, target=target, extra=extra))
    del a, b, c
    _free()
    return rows


@benchmark("matmul")
def bench_matmul(version=None, shapes=None, **_):
    from .. import runtime
    from ..ops import matmul as mm
    versions = _parse_versions(version)
    shape_list = _parse_shapes(shapes)
    results, refs = [], {}
    if "train" in versions:
        for (M, K, N) in shape_list:
            for with_bias in ((True, False) if N != 50304 else (False,)):   # the lm_head has no bias
                results += _bench_train(M, K, N, with_bias)
    for v in versions:
        if v == "train":
            continue
        for (M, K, N) in shape_list:
            if v in (1, 2) and (M, K, N) != SQUARE:
                continue
            if max(M * K, K * N, M * N) >= 2**31:   # our kernels index with 32-bit ints
                continue
            if v in mm._ARCH and runtime.device_arch() != mm._ARCH[v][:-1]:
                continue
            results += _bench_ladder(v, M, K, N, refs)
    return results
