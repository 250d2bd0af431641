"""Our FP8 GEMM (kernels_cu/fp8_matmul.cu), fp8_matmul's sm_90 path when settings.fp8_own_gemm is on:
fast accumulation, E4M3 or E5M2 A, E4M3 B, optional bias, bf16 out.

CPU: the setting exists and leaves the NumPy reference alone. GPU (pytest -m cuda, sm_90): out against
the float64 reference of the same bytes, no further from it than twice cuBLASLt's fast-accumulation
GEMM (both measured beside each other), on edge tiles (M, N, K not multiples of 128), one tile, the
d12 shapes; the paths it must not take (+=, residual, exact accumulation) still go to cuBLASLt; and a
first call inside a CUDA graph's capture (its tensor maps copied as a graph node) replays right.
"""
import ml_dtypes
import numpy as np
import pytest

from gpucore import runtime, settings
from gpucore.dtypes import bfloat16
from gpucore.ops.fp8 import fp8_matmul, fp8_matmul_reference
from conftest import to_cpu

F32 = np.float32
FMT = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def _bytes(rng, shape, spread, fmt):
    return rng.normal(0, spread, shape).astype(np.float32).astype(FMT[fmt]).view(np.uint8)


def test_fp8_own_gemm_setting_keeps_the_numpy_reference(rng):
    a8, b8 = _bytes(rng, (32, 48), 1.0, "e4m3"), _bytes(rng, (16, 48), 1.0, "e4m3")
    sa, sb = np.array([0.5], F32), np.array([0.25], F32)
    want = fp8_matmul_reference(a8, b8, "e4m3", "e4m3", 0.5, 0.25).astype(bfloat16)
    with settings.using(fp8_own_gemm="all"):
        got = fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, fast_accum=True)
    assert got.tobytes() == want.tobytes()
    with settings.using(fp8_own_gemm="sometimes"), pytest.raises(ValueError, match="fp8_own_gemm"):
        fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, fast_accum=True)


def _need_hopper():
    from test_fp8 import _need_fp8
    _need_fp8()
    if runtime.device_arch() != "90":
        pytest.skip("our FP8 GEMM is Hopper's (sm_90a)")


def _errors(got, lt, ref):
    """Max error of ours and of cuBLASLt against the reference, relative to |ref| + its rms."""
    scale = np.abs(ref) + np.sqrt(np.mean(ref ** 2))
    return float(np.max(np.abs(got - ref) / scale)), float(np.max(np.abs(lt - ref) / scale))


@pytest.mark.cuda
@pytest.mark.parametrize("M,N,K,a_fmt,with_bias", [
    (128, 128, 128, "e4m3", True), (272, 144, 160, "e4m3", True), (400, 384, 768, "e5m2", False),
    (2000, 768, 3072, "e5m2", False), (65536, 3072, 768, "e4m3", True), (65536, 768, 2304, "e5m2", False)])
def test_gpu_our_fp8_gemm_against_reference_and_cublaslt(rng, M, N, K, a_fmt, with_bias):
    _need_hopper()
    cp = runtime.cupy
    a8, b8 = _bytes(rng, (M, K), 2.0 if a_fmt == "e4m3" else 1e-3, a_fmt), _bytes(rng, (N, K), 0.5, "e4m3")
    bias = rng.normal(0, 0.5, N).astype(bfloat16) if with_bias else None
    sa, sb = np.array([0.125 if a_fmt == "e4m3" else 64.0], F32), np.array([0.0625], F32)
    d = [cp.asarray(v) for v in (a8, b8, sa, sb)]
    dbias = None if bias is None else cp.asarray(bias)
    ours, lt = cp.full((M, N), 7, bfloat16), cp.full((M, N), 7, bfloat16)
    with settings.using(fp8_own_gemm="all"):
        fp8_matmul(d[0], d[1], a_fmt, "e4m3", d[2], d[3], out=ours, bias=dbias, fast_accum=True)
    with settings.using(fp8_own_gemm="off"):
        fp8_matmul(d[0], d[1], a_fmt, "e4m3", d[2], d[3], out=lt, bias=dbias, fast_accum=True)
    rows = np.arange(M) if M <= 4096 else rng.choice(M, 384, replace=False)
    ref = fp8_matmul_reference(a8[rows], b8, a_fmt, "e4m3", float(sa[0]), float(sb[0]), bias)
    e_ours, e_lt = _errors(to_cpu(ours)[rows].astype(np.float64), to_cpu(lt)[rows].astype(np.float64), ref)
    assert e_ours <= max(2 * e_lt, 2.0 ** -8), (e_ours, e_lt)
    assert not bool((ours == 7).all(axis=1).any()), "a row of out was never written"


@pytest.mark.cuda
def test_gpu_own_gemm_leaves_the_other_paths_to_cublaslt(rng):
    """+= , a residual and exact accumulation are not the kernel's: with the setting on they give the
    bits they give with it off (cuBLASLt, the same raced algorithm in one process)."""
    _need_hopper()
    cp = runtime.cupy
    M, N, K = 256, 384, 512
    a8, b8 = cp.asarray(_bytes(rng, (M, K), 1.0, "e4m3")), cp.asarray(_bytes(rng, (N, K), 1.0, "e4m3"))
    sa, sb = cp.asarray(np.array([0.25], F32)), cp.asarray(np.array([0.5], F32))
    res = cp.asarray(rng.normal(0, 1, (M, N)).astype(bfloat16))
    outs = {}
    for own in ("off", "all"):
        with settings.using(fp8_own_gemm=own):
            acc = cp.asarray(np.ones((M, N), bfloat16))
            fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, out=acc, accumulate=True, fast_accum=True)
            r = cp.empty((M, N), bfloat16)
            fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, out=r, residual=res, fast_accum=True)
            exact = fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, fast_accum=False)
            outs[own] = [to_cpu(x).tobytes() for x in (acc, r, exact)]
    assert outs["all"] == outs["off"]


@pytest.mark.cuda
def test_gpu_own_gemm_first_called_inside_a_graph_capture(rng):
    """Fresh buffers met first inside a capture: the tensor maps' copy is recorded with the graph, and
    replays write what an eager call writes."""
    _need_hopper()
    cp = runtime.cupy
    M, N, K = 384, 256, 256
    a8, b8 = cp.asarray(_bytes(rng, (M, K), 1.0, "e4m3")), cp.asarray(_bytes(rng, (N, K), 1.0, "e4m3"))
    sa, sb = cp.asarray(np.array([0.25], F32)), cp.asarray(np.array([0.5], F32))
    eager, graphed = cp.empty((M, N), bfloat16), cp.zeros((M, N), bfloat16)
    with settings.using(fp8_own_gemm="all"):
        fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, out=eager, fast_accum=True)
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, out=graphed, fast_accum=True)
            graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert bool((graphed.view(np.uint16) == eager.view(np.uint16)).all())
