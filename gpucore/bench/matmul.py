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
  cublas dx+dW+db              raw cuBLAS doing the same work as a backward with a bias
                               gradient (db += ones^T @ dout by gemmEx)
  matmul_backward (dx+dW [+db]) vs raw cuBLAS doing the same work                target 95%
                               (vs_dx+dW_alone= gives the ratio to the two GEMMs, which do not
                               read dout a third time; fp32 and bf16 dW / dbias)
  gemm v1..v3 fp32             the ladder (gpucore/ladder/gemm.py) vs cuBLAS fp32 (SGEMM, no
                               TF32) at 4096^3; v3 must reach 15 TFLOP/s, so its target is
                               15 / cuBLAS-fp32 TFLOP/s
  gemm v4 / v4b / v4c / v5-v8 vs cuBLAS bf16 on the same NN layout    target 50% (4096^3)
                               (v4b, v4c: 64x64 warps with register-double-buffered fragments;
                               v5: Hopper wgmma, skipped on other GPUs; v6: v5 warp-specialized,
                               producer warpgroup + mbarriers; v7: v6 with TMA loads and stores;
                               v8: v7 with ping-pong consumer warpgroups)
Options: --version all|train|1|2|3|4|4b|4c|5|6|7|8 (comma lists work), --opt shapes=MxKxN,...
v1/v2 run at 4096^3 only (at the GPT-2 shapes they take seconds per call).
"""
from __future__ import annotations

from .. import cublas, dtypes, settings
from ..cublas import gemm_ex
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
        return ["train", 1, 2, 3, 4, "4b", "4c", 5, 6, 7, 8]
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


def _bench_train(M, K, N, with_bias):
    """Forward and backward of a linear layer x (M, K) @ W (N, K)^T against raw gemmEx."""
    import cupy

    import gpucore
    x, w = _rand((M, K), "bf16"), _rand((N, K), "bf16", 0.02)
    b = _rand((N,), "bf16") if with_bias else None
    out = _rand((M, N), "bf16")
    shape = f"{M}x{K}x{N}"
    fl = _flops(M, K, N)
    rows = []
    # raw and path timed in alternation (time_interleaved): back-to-back runs drift by 5-10%
    raw_ms, ms = time_interleaved([lambda: gemm_ex(x, w, out, M, N, K, transpose_b=True),
                                   lambda: gpucore.matmul_forward(x, w, b, out=out)])
    raw = Result(f"cublas gemmEx bf16 NT {shape}", raw_ms, flops=fl)
    rows.append(raw)
    path = "cublasLt" if cublas.lt_binding() is not None else f"gemmEx ({cublas.lt_status()})"
    extra = {"path": path}
    if not with_bias:
        extra["algo"] = cublas.plan_choice(M, N, K, transpose_b=True)
    rows.append(Result(f"matmul_forward {'+bias' if with_bias else 'no bias'} {shape}", ms, flops=fl,
                       ref_tflops=raw.tflops, target=0.95, extra=extra))
    if cublas.lt_binding() is not None and settings.current().lt_autotune:   # what the race gains
        with settings.using(lt_autotune=False):
            ms = time_ms(lambda: gpucore.matmul_forward(x, w, b, out=out))
        rows.append(Result(f"matmul_forward {'+bias' if with_bias else 'no bias'} {shape} (Lt heuristic #1)",
                           ms, flops=fl, ref_tflops=raw.tflops))
    if with_bias and cublas.lt_binding() is not None:   # what the Lt bias epilogue saves over the fallback
        with settings.using(cublaslt=False):
            ms = time_ms(lambda: gpucore.matmul_forward(x, w, b, out=out))
        rows.append(Result(f"matmul_forward +bias {shape} (bias fill + gemmEx beta=1)", ms, flops=fl,
                           ref_tflops=raw.tflops))
    # backward: dx (M, K) = dout @ W, dW (N, K) += dout^T @ x, db += colsum(dout)
    dout = out
    dx = _rand((M, K), "bf16")
    ones = cupy.ones((1, M), dtype=dtypes.bfloat16) if with_bias else None
    for gdt in ("float32", "bf16") if with_bias else ("float32",):
        dw = _rand((N, K), gdt)
        db = _rand((N,), gdt) if with_bias else None
        tag = "" if gdt == "float32" else " bf16 grads"

        def raw_backward():
            gemm_ex(dout, w, dx, M, K, N)
            gemm_ex(dout, x, dw, N, K, M, transpose_a=True, beta=1.0)

        def raw_backward_db():          # raw cuBLAS doing the same work: db += ones^T @ dout by gemmEx
            raw_backward()
            gemm_ex(ones, dout, db, 1, N, M, beta=1.0)

        def path_backward():
            gpucore.matmul_backward(dout, x, w, dx=dx, dweight=dw, dbias=db, need_dbias=with_bias)

        fns = [raw_backward, path_backward] + ([raw_backward_db] if with_bias else [])
        raw_ms, ms, *db_ms = time_interleaved(fns)
        raw_bwd = Result(f"cublas gemmEx bf16 dx+dW{tag} {shape}", raw_ms, flops=2 * fl)
        rows.append(raw_bwd)
        ref, extra = raw_bwd, {}
        if with_bias:
            # The bias gradient is work the two GEMMs do not do (one more read of dout): the target
            # compares with raw cuBLAS doing it too; the ratio to the GEMMs alone is printed as well.
            ref = Result(f"cublas dx+dW+db{tag} {shape} (db: gemmEx ones^T @ dout)", db_ms[0], flops=2 * fl,
                         ref_tflops=raw_bwd.tflops)
            rows.append(ref)
            extra["vs_dx+dW_alone"] = f"{raw_bwd.ms / ms:.1%}"
        rows.append(Result(f"matmul_backward {'+dbias' if with_bias else 'no bias'}{tag} {shape}", ms,
                           flops=2 * fl, ref_tflops=ref.tflops, target=0.95, extra=extra))
        del dw, db
    del x, w, b, out, dx
    _free()
    return rows


def _bench_ladder(version, M, K, N, refs):
    """Our gemm vN against cuBLAS on the same (NN) layout and dtype. refs caches the printed cuBLAS
    row per shape; the % of each version is against cuBLAS timed in alternation with it (v1/v2,
    seconds per call: against the cached row)."""
    import gpucore
    from ..ladder import gemm as ladder
    dt = "bf16" if version in ladder.TC_VERSIONS else "float32"
    a, b = _rand((M, K), dt), _rand((K, N), dt)
    c = _rand((M, N), dt)
    shape = f"{M}x{K}x{N}"
    fl = _flops(M, K, N)
    rows = []
    key = (dt, M, K, N)
    if key not in refs:
        ms = time_ms(lambda: gemm_ex(a, b, c, M, N, K))
        refs[key] = Result(f"cublas gemmEx {dtypes.name(a.dtype)} NN {shape}", ms, flops=fl)
        rows.append(refs[key])
    ref = refs[key]

    def ours():
        gpucore.gemm(a, b, out=c, version=version)

    target, extra = None, {}
    if version in (1, 2):               # seconds per call: timed alone, against the cached reference
        ms = time_ms(ours, warmup=1, repeat=3)
    else:                               # timed in alternation with cuBLAS: clocks drift 5-10% between runs
        ref_ms, ms = time_interleaved([lambda: gemm_ex(a, b, c, M, N, K), ours], rounds=5, repeat=10)
        ref = Result(ref.name, ref_ms, flops=fl)
        extra["cublas"] = f"{ref.tflops:.1f}TFLOP/s"
    if version in ladder.TC_VERSIONS and (M, K, N) == SQUARE:
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
    from ..ladder import gemm as ladder
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
            arch = ladder.VERSION_ARCH.get(v)
            if arch is not None and runtime.device_arch() != arch[:-1]:
                continue
            results += _bench_ladder(v, M, K, N, refs)
    return results
