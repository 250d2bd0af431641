"""fp8_matmul_gelu (kernels_cu/fp8_matmul.cu): the fc layer's FP8 GEMM with fcproj's E4M3 input
made in its epilogue.

CPU: the NumPy path is fp8_matmul's reference rounded to bf16, then fp8_gelu_quantize of it; bad
input gets one clear error. GPU (pytest -m cuda, sm_90): out against the float64 reference of the
same FP8 bytes (fast accumulation: within a few bf16 ulps) and against cuBLASLt's fp8_matmul; out8,
out8_t and amax bit for bit what fp8_gelu_quantize makes of the kernel's own out -- on edge tiles
(M, N not multiples of 128, K not a multiple of 128), one tile, and the d12 fc shape.
"""
import ml_dtypes
import numpy as np
import pytest

from gpucore import runtime
from gpucore.dtypes import bfloat16
from gpucore.ops.fp8 import fp8_gelu_quantize, fp8_matmul, fp8_matmul_reference
from gpucore.ops.fp8_matmul import fp8_matmul_gelu
from conftest import to_cpu

F32 = np.float32


def _e4m3(rng, shape, spread):
    """E4M3 bytes of normal values of this spread (finite, no NaN codes)."""
    return rng.normal(0, spread, shape).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _case(rng, M, N, K):
    a8, b8 = _e4m3(rng, (M, K), 2.0), _e4m3(rng, (N, K), 0.5)
    bias = rng.normal(0, 0.5, N).astype(bfloat16)
    return a8, b8, bias, np.array([0.125], F32), np.array([0.0625], F32), np.array([96.0], F32)


def test_fp8_matmul_gelu_numpy_is_the_two_passes(rng):
    M, N, K = 48, 32, 64
    a8, b8, bias, sa, sb, gs = _case(rng, M, N, K)
    out, out8, out8_t, amax = np.zeros((M, N), bfloat16), np.zeros((M, N), np.uint8), np.zeros((N, M), np.uint8), np.zeros(1, F32)
    fp8_matmul_gelu(a8, b8, sa, sb, gs, out=out, out8=out8, out8_t=out8_t, bias=bias, amax=amax)
    want = fp8_matmul_reference(a8, b8, "e4m3", "e4m3", 0.125, 0.0625, bias).astype(bfloat16)
    assert out.tobytes() == want.tobytes()
    w8, w8t, wamax = np.zeros_like(out8), np.zeros_like(out8_t), np.zeros(1, F32)
    fp8_gelu_quantize(want, gs, out=w8, out_t=w8t, amax=wamax)
    assert out8.tobytes() == w8.tobytes() and out8_t.tobytes() == w8t.tobytes()
    assert amax[0] == wamax[0] > 0


@pytest.mark.cuda
def test_gpu_fp8_matmul_bias_is_the_fused_kernels_out(rng):
    """fp8_matmul_bias (the same kernel, GELU outputs off) writes the fused kernel's out bit for bit."""
    if runtime.device_arch() != "90":
        pytest.skip("fp8_matmul_gelu is Hopper's (sm_90)")
    from gpucore.ops.fp8_matmul import fp8_matmul_bias
    cp = runtime.cupy
    d = [cp.asarray(v) for v in _case(rng, 400, 272, 640)]
    a, b = cp.empty((400, 272), bfloat16), cp.empty((400, 272), bfloat16)
    fp8_matmul_gelu(d[0], d[1], d[3], d[4], d[5], out=a, out8=cp.empty((400, 272), np.uint8), bias=d[2])
    fp8_matmul_bias(d[0], d[1], d[3], d[4], out=b, bias=d[2])
    assert bool((a.view(np.uint16) == b.view(np.uint16)).all())


def test_fp8_matmul_gelu_bad_input(rng):
    a8, b8, bias, sa, sb, gs = _case(rng, 32, 16, 32)
    out, out8 = np.zeros((32, 16), bfloat16), np.zeros((32, 16), np.uint8)
    with pytest.raises(ValueError, match="b8"):
        fp8_matmul_gelu(a8, b8[:, :16], sa, sb, gs, out=out, out8=out8)
    with pytest.raises(ValueError, match="out8, out8_t"):
        fp8_matmul_gelu(a8, b8, sa, sb, gs, out=out)
    with pytest.raises(ValueError, match="out8_t"):
        fp8_matmul_gelu(a8, b8, sa, sb, gs, out=out, out8_t=np.zeros((32, 16), np.uint8))
    with pytest.raises((TypeError, ValueError), match="out"):
        fp8_matmul_gelu(a8, b8, sa, sb, gs, out=np.zeros((32, 16), np.float32), out8=out8)
    with pytest.raises((TypeError, ValueError), match="bias"):
        fp8_matmul_gelu(a8, b8, sa, sb, gs, out=out, out8=out8, bias=np.zeros(8, bfloat16))


@pytest.mark.cuda
@pytest.mark.parametrize("M,N,K,with_bias", [(128, 128, 128, True), (272, 144, 160, True), (400, 384, 768, False),
                                             (1024, 3072, 768, True), (65536, 3072, 768, True)])
def test_gpu_fp8_matmul_gelu(rng, M, N, K, with_bias):
    from test_fp8 import _need_fp8
    _need_fp8()
    if runtime.device_arch() != "90":
        pytest.skip("fp8_matmul_gelu is Hopper's (sm_90)")
    cp = runtime.cupy
    a8, b8, bias, sa, sb, gs = _case(rng, M, N, K)
    bias = bias if with_bias else None
    d = {k: cp.asarray(v) for k, v in dict(a8=a8, b8=b8, sa=sa, sb=sb, gs=gs).items()}
    dbias = None if bias is None else cp.asarray(bias)
    out = cp.full((M, N), 7, bfloat16)
    out8, out8_t = cp.full((M, N), 0xAB, np.uint8), cp.full((N, M), 0xAB, np.uint8)
    amax = cp.zeros(1, F32)
    fp8_matmul_gelu(d["a8"], d["b8"], d["sa"], d["sb"], d["gs"], out=out, out8=out8, out8_t=out8_t, bias=dbias, amax=amax)
    got = to_cpu(out).astype(np.float64)
    # against the float64 reference of the same bytes (rows sampled at the big shape)
    rows = np.arange(M) if M <= 4096 else rng.choice(M, 512, replace=False)
    ref = fp8_matmul_reference(a8[rows], b8, "e4m3", "e4m3", 0.125, 0.0625, bias)
    # ... and cuBLASLt's fast-accumulation GEMM of the same bytes beside it: errors relative to each
    # element plus the output's rms (fast accumulation's error scales with the sums, not the result)
    lt = cp.empty((M, N), bfloat16)
    fp8_matmul(d["a8"], d["b8"], "e4m3", "e4m3", d["sa"], d["sb"], out=lt, bias=dbias, fast_accum=True)
    lt = to_cpu(lt).astype(np.float64)
    scale = np.abs(ref) + np.sqrt(np.mean(ref ** 2))
    ours, theirs = float(np.max(np.abs(got[rows] - ref) / scale)), float(np.max(np.abs(lt[rows] - ref) / scale))
    assert ours <= max(2 * theirs, 2.0 ** -8), (ours, theirs)
    # the FP8 outputs: bit for bit the two-pass cast of the kernel's own out
    w8, w8t, wamax = cp.zeros((M, N), np.uint8), cp.zeros((N, M), np.uint8), cp.zeros(1, F32)
    fp8_gelu_quantize(out, d["gs"], out=w8, out_t=w8t, amax=wamax)
    assert bool((out8 == w8).all()), "out8 differs from fp8_gelu_quantize(out)"
    assert bool((out8_t == w8t).all()), "out8_t differs from fp8_gelu_quantize(out)'s transpose"
    assert float(amax[0]) == float(wamax[0]) > 0
