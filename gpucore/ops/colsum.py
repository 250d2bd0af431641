"""Deterministic column sums: the bias gradient of a linear layer (kernels_cu/colsum.cu).

    colsum(dbias, dout2d)             dbias (M,) += dout2d (N, M).sum(0)      (parameter grad: +=)
    colsum_partials(partials, dout2d) its stage 1 alone, into the caller's partials (colsum_chunks(N) rows)
    reduce_partials(dbias, partials)  dbias (M,) += partials (chunks, M).sum(0), in stage 2's order
    stage2_order_sum(partials)        that sum in float32 on NumPy, bit for bit the kernel's (tests)
    colsum_reference(dbias, x2d)      the same on NumPy, in float64: every fused column sum's reference

Two stages, no float atomics, float32 accumulation: stage 1 sums fixed row
chunks of COLSUM_ROWS_PER_CHUNK rows into float32 partials, stage 2 adds the
chunks in a fixed order (STAGE2_WARPS warps a column: warp w adds chunks w,
w + 32, ..., then the warps' sums in warp order; common.cuh). The chunking
depends on the shape only, so the same input gives the same bits on every call.

Stage 2 is shared: kernels that write a matmul's dout can sum its columns on
the way (gelu_backward(dbias=), layernorm_backward(dx_colsum=)) into
per-chunk partials of their own and call reduce_partials, so matmul_backward
need not read dout again for that bias gradient.

Callers pass CuPy arrays they have validated (this is plumbing for the ops
modules, not a user-facing op); the NumPy reference is `dout.sum(0)` (colsum_reference).
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, runtime

# Rows per stage-1 chunk: fixed, so the reduction order depends on the shape only.
COLSUM_ROWS_PER_CHUNK = 256
COLSUM_WARPS = 8           # BB_ROWS in colsum.cu: warps per stage-1 block
STAGE2_WARPS = 32          # common.cuh: warps per 32 columns in every stage 2 (colsum, layernorm)


def colsum_reference(dbias, x2d):
    """dbias (M,) += x2d (N, M).sum(0), summed in float64 and rounded once to dbias's dtype: the NumPy
    branch of every op that sums a bias gradient on the way (fp8 casts, attention, layernorm)."""
    if x2d.shape[1]:
        dbias[...] = (dbias.astype(np.float64) + np.asarray(x2d).astype(np.float64).sum(axis=0)).astype(dbias.dtype)


def colsum(dbias, dout2d):
    """dbias (M,) += dout2d (N, M).sum(0) on the current stream: two deterministic launches."""
    N, M = dout2d.shape
    partials = runtime.cupy.empty((colsum_chunks(N), M), dtype=np.float32)
    colsum_partials(partials, dout2d)
    reduce_partials(dbias, partials)


def colsum_chunks(N: int) -> int:
    """Stage 1's partial rows for N rows of dout."""
    return max(1, -(-N // COLSUM_ROWS_PER_CHUNK))


def colsum_partials(partials, dout2d):
    """Stage 1 alone: partials (colsum_chunks(N), M) float32 = dout2d (N, M)'s column sums over its
    fixed row chunks, for a caller that adds partials of its own before stage 2 (reduce_partials)."""
    N, M = dout2d.shape
    chunks = colsum_chunks(N)
    if partials.shape != (chunks, M) or partials.dtype != np.float32:
        raise ValueError(f"partials: expected ({chunks}, {M}) float32, got {partials.shape} {partials.dtype}")
    suf = dtypes.kernel_suffix(dout2d.dtype)
    P = 16 // dout2d.dtype.itemsize
    vec = M % P == 0 and dout2d.data.ptr % 16 == 0
    V = P if vec else 1
    k1 = runtime.get_kernel("colsum", f"colsum_stage1_kernel_{'vec' if vec else 'scalar'}_{suf}")
    runtime.launch(k1, (-(-M // (32 * V)), chunks), (32, COLSUM_WARPS),
                   (partials, dout2d, np.int32(N), np.int32(M), np.int32(COLSUM_ROWS_PER_CHUNK)))


def reduce_partials(dbias, partials):
    """dbias (M,) += partials (chunks, M) float32 summed over chunks in stage 2's order (stage 2)."""
    chunks, M = partials.shape
    k2 = runtime.get_kernel("colsum", f"colsum_stage2_kernel_{dtypes.kernel_suffix(dbias.dtype)}")
    runtime.launch(k2, -(-M // 32), 32 * STAGE2_WARPS, (dbias, partials, np.int32(M), np.int32(chunks)))


def stage2_order_sum(partials):
    """partials (np, ...) float32 summed over axis 0 in float32, in stage 2's order: warp w adds
    partials w, w + STAGE2_WARPS, ... from zero, then the warps' sums are added in warp order from
    zero. NumPy's float32 adds round to nearest like the kernel's, so the bits are the kernel's."""
    partials = np.asarray(partials, dtype=np.float32)
    warps = np.zeros((STAGE2_WARPS,) + partials.shape[1:], np.float32)
    for p in range(partials.shape[0]):
        warps[p % STAGE2_WARPS] += partials[p]
    total = np.zeros(partials.shape[1:], np.float32)
    for w in range(STAGE2_WARPS):
        total += warps[w]
    return total
