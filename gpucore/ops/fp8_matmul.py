"""The fc layer's FP8 forward as one kernel (kernels_cu/fp8_matmul.cu, Hopper):

    fp8_matmul_gelu(a8, b8, a_si, b_si, gelu_scale, out=, out8=, out8_t=, bias=, amax=)
        out  = bf16(a8 @ b8^T * a_si * b_si + bias)            the fc output h (what the backward keeps)
        out8 = E4M3(gelu(out) * gelu_scale), out8_t its transpose, amax |= max |gelu(out)|

The same values as fp8_matmul(..., fast_accum=True) followed by fp8_gelu_quantize(out, gelu_scale,
out=, out_t=, amax=): out equal to cuBLASLt's within the accumulation's rounding, and out8 / out8_t /
amax exactly what fp8_gelu_quantize makes of this out. Two passes become one: the GELU and the casts
run in the GEMM's epilogue, under the other consumer warpgroup's math, and h is never read back.

fp8_matmul_gelu_fits(M, N, K) says whether the kernel runs here (an sm_90 GPU, sizes multiples of
16); elsewhere the NumPy reference (CPU) or the two-pass path (callers) applies.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, profiler, runtime
from ._common import check_array
from .fp8 import _check_scalar, _require_fp8, fp8_gelu_quantize, fp8_matmul_reference

BF16 = dtypes.bfloat16
U8 = np.dtype(np.uint8)
TILE = 128                      # the kernel's block tile: 128 x 128 outputs, k-tiles of 128 bytes
THREADS = 640                   # warpgroups: the producer (one thread issues the TMA loads), 2 MMA, 2 epilogue
SMEM = 4 * 32768 + 2 * 32768 + 2 * 16384 + 1024   # 4 stages, 2 h buffers, 2 x8 tiles, alignment


def fp8_matmul_gelu_fits(M: int, N: int, K: int) -> bool:
    """True when the fused kernel runs for this shape on this machine (an sm_90 GPU)."""
    return (runtime.gpu_available() and runtime.device_arch() == "90"
            and M % 16 == 0 and N % 16 == 0 and K % 16 == 0 and min(M, N, K) > 0)


@profiler.profiled("fp8 matmul gelu", flops=lambda r, args, kw: 2.0 * args[0].shape[0] * args[1].shape[0] * args[0].shape[1])
def fp8_matmul_gelu(a8, b8, a_scale_inv, b_scale_inv, gelu_scale, *, out, out8=None, out8_t=None, bias=None,
                    amax=None):
    """out (M, N) bf16 = (a8 (M, K) @ b8 (N, K)^T) * a_scale_inv * b_scale_inv [+ bias (N,) bf16], and
    the E4M3 bytes of gelu(out) * gelu_scale into out8 (M, N) and/or out8_t (N, M) (uint8, at least one),
    amax (1,) float32, optional: max(amax, max |gelu(out)|). a8, b8: E4M3 bytes; the scales (1,) float32.
    Returns out."""
    check_array("a8", a8, dtype=U8, ndim=2, max_elements=None)
    check_array("b8", b8, dtype=U8, ndim=2, max_elements=None)
    M, K = a8.shape
    N = b8.shape[0]
    if b8.shape[1] != K:
        raise ValueError(f"b8: expected (N, {K}) to match a8's K, got {tuple(b8.shape)}")
    xp = runtime.array_module(a8, b8, a_scale_inv, b_scale_inv, gelu_scale, out, out8, out8_t, bias, amax)
    for name, s in (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv), ("gelu_scale", gelu_scale)):
        _check_scalar(name, s, xp)
    if amax is not None:
        _check_scalar("amax", amax, xp)
    check_array("out", out, dtype=BF16, shape=(M, N), max_elements=None)
    if out8 is None and out8_t is None:
        raise ValueError("out8, out8_t: give at least one FP8 output")
    if out8 is not None:
        check_array("out8", out8, dtype=U8, shape=(M, N), max_elements=None)
    if out8_t is not None:
        check_array("out8_t", out8_t, dtype=U8, shape=(N, M), max_elements=None)
    if bias is not None:
        check_array("bias", bias, dtype=BF16, shape=(N,))
    if xp is np:
        from .fp8 import _host_scalar
        r = fp8_matmul_reference(a8, b8, "e4m3", "e4m3", _host_scalar(a_scale_inv), _host_scalar(b_scale_inv), bias)
        out[...] = r.astype(BF16)
        fp8_gelu_quantize(out, gelu_scale, out=out8, out_t=out8_t, amax=amax)
        return out
    if not fp8_matmul_gelu_fits(M, N, K):
        raise ValueError(f"fp8_matmul_gelu: needs an sm_90 GPU and M, N, K multiples of 16, got {M} x {N} x {K} "
                         f"on sm_{runtime.device_arch()} (use fp8_matmul, then fp8_gelu_quantize)")
    _require_fp8()
    for name, arr in (("a8", a8), ("b8", b8), ("out", out), ("out8", out8), ("out8_t", out8_t)):
        if arr is not None and arr.data.ptr % 16:
            raise ValueError(f"{name}: must be 16-byte aligned")
    # a missing orientation is written to a scratch the caller never sees (the kernel stores both)
    if out8 is None:
        out8 = xp.empty((M, N), U8)
    if out8_t is None:
        out8_t = xp.empty((N, M), U8)
    _launch("fp8_matmul_gelu_kernel", a8, b8, a_scale_inv, b_scale_inv, bias, gelu_scale, amax, out, out8, out8_t)
    return out


@profiler.profiled("fp8 matmul", flops=lambda r, args, kw: 2.0 * args[0].shape[0] * args[1].shape[0] * args[0].shape[1])
def fp8_matmul_bias(a8, b8, a_scale_inv, b_scale_inv, *, out, bias=None):
    """out (M, N) bf16 = (a8 @ b8^T) * a_scale_inv * b_scale_inv [+ bias]: fp8_matmul_gelu's kernel with
    the GELU outputs off -- the plain GEMM it is measured against (an sm_90 GPU only)."""
    M, K = a8.shape
    N = b8.shape[0]
    check_array("out", out, dtype=BF16, shape=(M, N), max_elements=None)
    if not fp8_matmul_gelu_fits(M, N, K) or b8.shape[1] != K:
        raise ValueError(f"fp8_matmul_bias: needs an sm_90 GPU and M, N, K multiples of 16, got {M} x {N} x {K}")
    _launch("fp8_matmul_bias_kernel", a8, b8, a_scale_inv, b_scale_inv, bias, None, None, out, None, None)
    return out


def _launch(name, a8, b8, a_scale_inv, b_scale_inv, bias, gelu_scale, amax, out, out8, out8_t, options=()):
    """Launch kernel `name` on checked arguments; options: -D measurement switches (fp8_matmul.cu's header)."""
    (M, K), N = a8.shape, b8.shape[0]
    maps = _maps(a8, b8, out, out8, out8_t)
    tiles = -(-M // TILE) * -(-N // TILE)
    kernel = runtime.get_kernel("fp8_matmul", name, tuple(options), arch="90a")
    null = np.uint64(0)
    runtime.launch(kernel, (min(tiles, runtime.sm_count()),), (THREADS,),
                   (out, a_scale_inv, b_scale_inv, null if bias is None else bias, null if gelu_scale is None else gelu_scale,
                    null if amax is None else amax, maps, np.int32(M), np.int32(N), np.int32(K)), shared_mem=SMEM)


# (device, pointers, shapes) -> the five tensor maps in device memory; a map depends on nothing else
_MAP_CACHE: dict[tuple, object] = {}
_MAP_CACHE_SIZE = 256


def _maps(a8, b8, out, out8, out8_t):
    from ..ladder import tma
    (M, K), N = a8.shape, b8.shape[0]
    gelu = out8 is not None
    key = (runtime.cupy.cuda.runtime.getDevice(), a8.data.ptr, b8.data.ptr, out.data.ptr,
           out8.data.ptr if gelu else 0, out8_t.data.ptr if gelu else 0, M, N, K)
    maps = _MAP_CACHE.get(key)
    if maps is None:
        raw = (tma.encode_2d(a8.data.ptr, U8, M, K, 128, 128) + tma.encode_2d(b8.data.ptr, U8, N, K, 128, 128)
               + tma.encode_2d(out.data.ptr, BF16, M, N, 64, 64))
        if gelu:
            raw += tma.encode_2d(out8.data.ptr, U8, M, N, 128, 128) + tma.encode_2d(out8_t.data.ptr, U8, N, M, 128, 128)
        if len(_MAP_CACHE) >= _MAP_CACHE_SIZE:
            _MAP_CACHE.clear()
        maps = _MAP_CACHE[key] = runtime.cupy.asarray(np.frombuffer(raw, np.uint8))
    return maps
