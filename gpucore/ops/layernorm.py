"""LayerNorm over the last axis, its backward, and the fused residual-add + LayerNorm
forward (kernels_cu/layernorm.cu).

    mean = x.mean(-1),  rstd = 1 / sqrt(x.var(-1) + eps)        (float32, shape x.shape[:-1])
    out  = (x - mean) * rstd * weight + bias
    fused: residual = a + b (rounded to the dtype), out = layernorm(residual)
    backward (all accumulated, +=):
      dx      += rstd * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat)),  dnorm = weight * dout
      dweight += sum over rows of dout * xhat,  dbias += sum over rows of dout
      optional dx_colsum += sum over rows of the final dx, as stored (rounded to dx's dtype)

The references compute in float64 (the backward uses the mean/rstd it is
given, as the kernels do) and round once to the output dtype; the kernels
accumulate in float32, so they agree to about 1e-6 relative in float32 and to
bf16 rounding in bfloat16. dweight/dbias are a deterministic two-stage
reduction (per-block fp32 partials in a scratch buffer, then a fixed-order
sum), never atomics: the same inputs give the same bits.

Kernel versions (see layernorm.cu): v2 keeps a row in one warp's registers
(C a multiple of the 16-byte pack, 16-byte aligned arrays, C <= 2048 bf16 /
1024 fp32) and reads every element once; v1 takes anything else.
`version=None` picks v2 whenever it applies.

dx_colsum exists for GPT-2's backward: the residual gradient dx that a
layernorm backward has just accumulated into is the dout of the projection
before it, whose bias gradient is dx's column sum. v2 adds it to its
deterministic two-stage reduction (a third slice of partials; the
_colsum_ kernels, launched with the plain kernel's grid so dx/dweight/dbias
keep their bits) instead of a second pass over dx; v1 runs the two-stage
column sum (colsum.colsum) over the finished dx.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import dtypes, runtime
from .. import profiler
from ._common import check_array, check_same_dtype, output
from .colsum import STAGE2_WARPS, colsum, colsum_reference

WARPS = 4                 # rows (forward) / warps (backward) per block, as WARPS in layernorm.cu
BLOCK = 32 * WARPS
REDUCE_BLOCK = 32 * STAGE2_WARPS   # stage 2: 32 columns per block (common.cuh's stage-2 order)
V1_DWDB_BLOCK = 256       # v1 dweight/dbias stage 1: one thread per column
V2_N = range(1, 9)        # packs per lane instantiated in layernorm.cu
SPLIT_MIN_N = 4           # v2 backward: rows whose one-warp N would be >= this go to 2 warps a row (_s2
                          # kernels, N of half a row: 2..4); measured (C >= 1024 bf16 gains 7-8%, 768
                          # loses 8%) in tools/notes/kernels_perf.md
VERSIONS = (1, 2)


# ------------------------------------------------------------- references ----

def layernorm_forward_reference(x, weight, bias, eps=1e-5):
    """float64 (out, mean, rstd) of LayerNorm over the last axis."""
    x64 = np.asarray(x, dtype=np.float64)
    mean = x64.mean(axis=-1)
    xc = x64 - mean[..., None]
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=-1) + eps)
    out = xc * rstd[..., None] * np.asarray(weight, np.float64) + np.asarray(bias, np.float64)
    return out, mean, rstd


def layernorm_backward_reference(dout, x, weight, mean, rstd):
    """float64 gradient contributions (dx, dweight, dbias), given the forward's mean and rstd."""
    d64 = np.asarray(dout, dtype=np.float64)
    xhat = (np.asarray(x, np.float64) - np.asarray(mean, np.float64)[..., None]) * \
        np.asarray(rstd, np.float64)[..., None]
    dnorm = d64 * np.asarray(weight, np.float64)
    dx = (dnorm - dnorm.mean(axis=-1, keepdims=True)
          - xhat * (dnorm * xhat).mean(axis=-1, keepdims=True)) * np.asarray(rstd, np.float64)[..., None]
    C = d64.shape[-1]
    dweight = (d64 * xhat).reshape(-1, C).sum(axis=0)
    dbias = d64.reshape(-1, C).sum(axis=0)
    return dx, dweight, dbias


# ----------------------------------------------------------------- helpers ---

def _rows_cols(x, name):
    C = x.shape[-1]
    if C == 0:
        raise ValueError(f"{name}: layernorm over an empty last axis is undefined")
    return x.size // C, C


def _check_eps(eps):
    if not isinstance(eps, (int, float, np.floating, np.integer)) or not np.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: must be a finite number >= 0, got {eps!r}")
    return np.float32(eps)


def _aligned(*arrays) -> bool:
    return all(a.data.ptr % 16 == 0 for a in arrays)


def pick_version(version, dtype, C, arrays):
    """(version, N) of the layernorm kernels for `dtype` rows of C elements and these arrays.

    version None: v2 where it applies (C a multiple of the 16-byte pack, C <= 32 * V2_N[-1]
    packs, every array 16-byte aligned), else v1; an explicit version is checked (ValueError
    naming what it needs). N: v2's packs per lane (the smallest instantiated that holds the
    row), None for v1."""
    P = 16 // np.dtype(dtype).itemsize
    v2_ok = _v2_fits(C, P) and _aligned(*arrays)
    if version is None:
        version = 2 if v2_ok else 1
    if version not in VERSIONS:
        raise ValueError(f"version: layernorm has kernel versions 1 and 2, got {version!r}")
    if version == 2 and not v2_ok:
        raise ValueError(f"version: v2 needs C a multiple of {P}, C <= {32 * V2_N[-1] * P} and 16-byte "
                         f"aligned arrays (got C={C})")
    return version, (_v2_packs(C, P) if version == 2 else None)


def _v2_fits(C: int, P: int) -> bool:
    """Does a row of C values (P per 16-byte pack) fit v2's warp: whole packs, at most V2_N per lane?"""
    return C % P == 0 and C // P <= 32 * V2_N[-1]


def _v2_packs(C: int, P: int) -> int:
    """v2's packs per lane for rows of C values: the smallest instantiated N that holds the row."""
    return -(-(C // P) // 32)


def backward_split(dtype, C: int, warps_per_row: int | None = None) -> tuple[int, int]:
    """(S, N) of the v2 backward for rows of C `dtype` values: S warps a row (1, or 2 where one warp's
    N would be >= SPLIT_MIN_N: its registers then cost occupancy), N packs per lane of a warp's part.
    warps_per_row forces S (1 or 2; tests and benchmarks)."""
    P = 16 // np.dtype(dtype).itemsize
    n1 = _v2_packs(C, P)
    S = (2 if n1 >= SPLIT_MIN_N else 1) if warps_per_row is None else warps_per_row
    if S not in (1, 2):
        raise ValueError(f"warps_per_row: 1 or 2, got {warps_per_row!r}")
    half = -(-(C // P) // 2)               # packs of a row's first half (layernorm.cu's nP0)
    return S, (n1 if S == 1 else -(-half // 32))


SM_SHARED_BYTES = 227 * 1024    # shared memory one sm_90 SM gives its blocks (the grids below were
                                # measured and their colsum orders pinned with this figure)
BLOCK_RESERVED_BYTES = runtime.BLOCK_RESERVED_BYTES


def _resident_blocks(kernel, block: int) -> int:
    """Blocks of `block` threads one SM holds at once, from the kernel's registers and shared memory."""
    return runtime.resident_blocks(kernel, block, sm_shared_bytes=SM_SHARED_BYTES)


# ----------------------------------------------------------------- forward ---

def _forward_args(x, weight, bias, name):
    check_array(name, x, min_ndim=1)
    rows, C = _rows_cols(x, name)
    check_array("weight", weight, ndim=1)
    if weight.shape[0] != C:
        raise ValueError(f"weight: expected shape ({C},) to match {name}'s last axis, got {tuple(weight.shape)}")
    check_array("bias", bias, shape=(C,))
    check_same_dtype(**{name: x, "weight": weight, "bias": bias})
    return rows, C


@profiler.profiled("layernorm forward", nbytes=profiler.io_bytes)
def layernorm_forward(x, weight, bias, eps=1e-5, out=None, mean=None, rstd=None, *, version=None):
    """LayerNorm of x (..., C) over its last axis -> (out, mean, rstd); mean/rstd float32 (...,)."""
    rows, C = _forward_args(x, weight, bias, "x")
    eps = _check_eps(eps)
    xp = runtime.array_module(x, weight, bias, out, mean, rstd)
    out = output("out", out, xp, x.shape, x.dtype)
    mean = output("mean", mean, xp, x.shape[:-1], np.float32)
    rstd = output("rstd", rstd, xp, x.shape[:-1], np.float32)
    if xp is np:
        o, m, r = layernorm_forward_reference(x, weight, bias, float(eps))
        out[...], mean[...], rstd[...] = o.astype(x.dtype), m, r
        return out, mean, rstd
    version, N = pick_version(version, x.dtype, C, (x, weight, bias, out))
    if rows == 0:
        return out, mean, rstd
    suf = dtypes.kernel_suffix(x.dtype)
    name = f"layernorm_forward_kernel_v2_n{N}_{suf}" if version == 2 else f"layernorm_forward_kernel_v1_{suf}"
    runtime.launch(runtime.get_kernel("layernorm", name), -(-rows // WARPS), BLOCK,
                   (out, mean, rstd, x, weight, bias, np.int32(rows), np.int32(C), eps))
    return out, mean, rstd


def layernorm(x, weight, bias, eps=1e-5, out=None):
    """numpy-like LayerNorm over the last axis: just the normalised output."""
    return layernorm_forward(x, weight, bias, eps, out=out)[0]


@profiler.profiled("residual + layernorm forward", nbytes=profiler.io_bytes)
def fused_residual_layernorm_forward(a, b, weight, bias, eps=1e-5, residual=None, out=None, mean=None,
                                     rstd=None, *, version=None):
    """residual = a + b and out = layernorm(residual), in one pass -> (residual, out, mean, rstd)."""
    rows, C = _forward_args(a, weight, bias, "a")
    check_array("b", b, shape=a.shape)
    check_same_dtype(a=a, b=b)
    eps = _check_eps(eps)
    xp = runtime.array_module(a, b, weight, bias, residual, out, mean, rstd)
    residual = output("residual", residual, xp, a.shape, a.dtype)
    out = output("out", out, xp, a.shape, a.dtype)
    mean = output("mean", mean, xp, a.shape[:-1], np.float32)
    rstd = output("rstd", rstd, xp, a.shape[:-1], np.float32)
    if xp is np:
        # Normalise the rounded residual, as the kernel does (and as the backward will see it).
        res = (a.astype(np.float32) + b.astype(np.float32)).astype(a.dtype)
        o, m, r = layernorm_forward_reference(res, weight, bias, float(eps))
        residual[...] = res
        out[...], mean[...], rstd[...] = o.astype(a.dtype), m, r
        return residual, out, mean, rstd
    version, N = pick_version(version, a.dtype, C, (a, b, weight, bias, residual, out))
    if rows == 0:
        return residual, out, mean, rstd
    suf = dtypes.kernel_suffix(a.dtype)
    name = (f"layernorm_residual_forward_kernel_v2_n{N}_{suf}" if version == 2
            else f"layernorm_residual_forward_kernel_v1_{suf}")
    runtime.launch(runtime.get_kernel("layernorm", name), -(-rows // WARPS), BLOCK,
                   (residual, out, mean, rstd, a, b, weight, bias, np.int32(rows), np.int32(C), eps))
    return residual, out, mean, rstd


# ------------------------------------------------------- FP8 forward ---

def fp8_smem_bytes(C: int, rows: int) -> int:
    """Dynamic shared memory of an FP8 forward block of `rows` rows: the E4M3 tile (C / 4 + 1 words a
    row) and the weight and bias (C bf16 each)."""
    return rows * (C + 4) + 4 * C


def fp8_block_rows(C: int, residual: bool = False) -> int:
    """Rows per block of the FP8 forward (its kernels' ROWS). The plain kernel (what the model runs):
    64 while two 64-row blocks' shared memory (fp8_smem_bytes) fits one SM (C <= 1690), else 32
    -- on an H100 64 rows ran d12 (C = 768) 8% and d48 (C = 1600) 11% faster than 32. The residual
    kernel (x + b read): 64 for C <= 1024, else 32, as measured when the model ran it (layernorm.cu;
    tools/probes/layernorm_fp8_rows.py times both)."""
    if residual:
        return 64 if C <= 1024 else 32
    return 64 if 2 * (fp8_smem_bytes(C, 64) + BLOCK_RESERVED_BYTES) <= SM_SHARED_BYTES else 32


class LayerNormCall(NamedTuple):
    """One forward call's arrays: out, mean, rstd = layernorm(x) -- or, with b, of residual = x + b
    (fused_residual_layernorm_forward, residual written). `run()` makes it in bf16/fp32; FP8 training
    can make FP8 bytes of `out` instead (layernorm_forward_fp8) and never write out."""
    x: object
    b: object
    weight: object
    bias: object
    residual: object
    out: object
    mean: object
    rstd: object

    def run(self):
        if self.b is None:
            return layernorm_forward(self.x, self.weight, self.bias, out=self.out, mean=self.mean, rstd=self.rstd)[0]
        return fused_residual_layernorm_forward(self.x, self.b, self.weight, self.bias, residual=self.residual,
                                                out=self.out, mean=self.mean, rstd=self.rstd)[1]


def fp8_forward_fits(C: int) -> bool:
    """Can layernorm_forward_fp8 take rows of C bf16 values (v2's rule)?"""
    return _v2_fits(C, 8)


@profiler.profiled("layernorm forward (fp8 out)", nbytes=profiler.io_bytes)
def layernorm_forward_fp8(x, weight, bias, scale, *, b=None, residual=None, out8=None, out8_t=None, amax=None,
                          mean=None, rstd=None, gate=None, eps=1e-5, block_rows=None):
    """E4M3 bytes of layernorm(x) * scale -- of residual = x + b with b (residual written) -- as
    layernorm_forward / fused_residual_layernorm_forward's bf16 output then fp8_quantize(out, "e4m3",
    scale) would make them, in one pass that never writes the bf16 output.

    x, b (R, C) bfloat16; out8 (R, C) and/or out8_t (C, R) uint8; amax (1,) float32, optional:
    max(amax, max |out|); mean, rstd (R,) float32 (written, as layernorm_forward's); gate (1,)
    float32, optional: run only when gate != 0 (on the device). GPU: R % 16 == 0, C % 8 == 0,
    C <= 2048, 16-byte aligned arrays. block_rows (GPU): rows per block, 32 or 64 (default
    fp8_block_rows(C, residual=b is not None)); the same bytes either way.
    """
    from .fp8 import check_cast_args, fp8_quantize
    rows, C = _forward_args(x, weight, bias, "x")
    if x.dtype != dtypes.bfloat16 or x.ndim != 2:
        raise TypeError("x: the FP8 layernorm takes 2-D bfloat16 rows")
    eps = _check_eps(eps)
    xp = runtime.array_module(x, b, weight, bias, scale, residual, out8, out8_t, amax, mean, rstd, gate)
    if b is not None:
        check_array("b", b, shape=x.shape)
        check_same_dtype(x=x, b=b)
        residual = output("residual", residual, xp, x.shape, x.dtype)
    mean = output("mean", mean, xp, (rows,), np.float32)
    rstd = output("rstd", rstd, xp, (rows,), np.float32)
    check_cast_args(x, "e4m3", scale, out8, out8_t, amax, gate, xp)
    if xp is np:
        if gate is not None and float(gate[0]) == 0.0:
            return out8, out8_t
        src = x
        if b is not None:
            src = (x.astype(np.float32) + b.astype(np.float32)).astype(x.dtype)
            residual[...] = src
        o, m, r = layernorm_forward_reference(src, weight, bias, float(eps))
        mean[...], rstd[...] = m, r
        fp8_quantize(o.astype(x.dtype), "e4m3", scale, out=out8, out_t=out8_t, amax=amax)
        return out8, out8_t
    if not fp8_forward_fits(C):
        raise ValueError(f"x: the FP8 layernorm needs C a multiple of 8 and at most 2048, got {C}")
    if not _aligned(*(a for a in (x, b, weight, bias, residual) if a is not None)):
        raise ValueError("x, b, weight, bias, residual: must be 16-byte aligned")
    if rows == 0:
        return out8, out8_t
    N = _v2_packs(C, 8)
    null = np.uint64(0)
    opt = lambda a: null if a is None else a                           # noqa: E731
    head = (residual,) if b is not None else ()
    src = (x, b) if b is not None else (x,)
    rows_per_block = fp8_block_rows(C, residual=b is not None) if block_rows is None else block_rows
    if rows_per_block not in (32, 64):
        raise ValueError(f"block_rows: 32 or 64, got {block_rows!r}")
    name = f"layernorm_{'residual_' if b is not None else ''}forward_fp8_kernel_n{N}_r{rows_per_block}"
    runtime.launch(runtime.get_kernel("layernorm", name), -(-rows // rows_per_block), 256,
                   (*head, opt(out8), opt(out8_t), opt(amax), mean, rstd, *src, weight, bias, scale, opt(gate),
                    np.int32(rows), np.int32(C), eps), shared_mem=fp8_smem_bytes(C, rows_per_block))
    return out8, out8_t


# ---------------------------------------------------------------- backward ---

def _backward_v2(xp, dx, dout, x, weight, mean, rstd, rows, C, N, S, with_colsum):
    """Stage 1 of the v2 backward (dx +=, the block partials): S warps a row, N packs per lane.
    Returns the scratch of partials (grid, 2 | 3, C) for stage 2."""
    suf = dtypes.kernel_suffix(dout.dtype)
    tag = f"n{N}" + ("_s2" if S == 2 else "")
    kernel = runtime.get_kernel("layernorm", f"layernorm_backward_kernel_v2_{tag}_{suf}")
    # The grid (hence the partials' row grouping) comes from the plain kernel even when the
    # colsum one runs: dweight/dbias must not change bits with dx_colsum (layernorm.cu's
    # colsum_min_blocks keeps that kernel's occupancy at least the plain one's).
    grid = min(runtime.sm_count() * _resident_blocks(kernel, BLOCK), -(-rows // (WARPS // S)))
    if with_colsum:
        kernel = runtime.get_kernel("layernorm", f"layernorm_backward_colsum_kernel_v2_{tag}_{suf}")
    scratch = xp.empty((grid, 3 if with_colsum else 2, C), dtype=np.float32)
    runtime.launch(kernel, grid, BLOCK, (scratch, dx, dout, x, weight, mean, rstd, np.int32(rows), np.int32(C)))
    return scratch


def _grad(name, g, xp, shape, dtype, allowed):
    """A caller's gradient buffer (checked) or a fresh zero one."""
    if g is None:
        return xp.zeros(shape, dtype=dtype)
    check_array(name, g, dtypes_=allowed, shape=shape)
    if (xp is np) != isinstance(g, np.ndarray):
        raise TypeError(f"{name}: must live on the same device as the inputs")
    return g


@profiler.profiled("layernorm backward", nbytes=profiler.io_bytes)
def layernorm_backward(dout, x, weight, mean, rstd, dx=None, dweight=None, dbias=None, *, version=None,
                       dx_colsum=None, warps_per_row=None):
    """Accumulate (+=) the LayerNorm gradients into dx (..., C), dweight (C,), dbias (C,).

    None allocates a zero buffer. dx has x's dtype; dweight/dbias have the
    weight's dtype or float32 (both the same). dx_colsum (C,), float32 or
    dout's dtype, optional: dx_colsum += the column sums over all rows of dx
    after this call's +=, of the values as stored (what a later
    matmul_backward reads), accumulated in float32, deterministic. Without
    it nothing changes (same kernels, same bits); with it dx, dweight and
    dbias get the same bits as without. warps_per_row (v2 only; None: by C,
    backward_split): 1 or 2 warps per row -- another grouping of the partial
    sums, so other (deterministic) bits.
    """
    check_array("dout", dout, min_ndim=1)
    rows, C = _rows_cols(dout, "dout")
    check_array("x", x, shape=dout.shape)
    check_same_dtype(dout=dout, x=x)
    check_array("weight", weight, shape=(C,))
    check_same_dtype(dout=dout, weight=weight)
    check_array("mean", mean, dtype=np.float32, shape=dout.shape[:-1])
    check_array("rstd", rstd, dtype=np.float32, shape=dout.shape[:-1])
    xp = runtime.array_module(dout, x, weight, mean, rstd, dx, dweight, dbias)
    if warps_per_row not in (None, 1, 2):
        raise ValueError(f"warps_per_row: 1 or 2, got {warps_per_row!r}")
    if dx_colsum is not None:      # like every argument, before any allocation or launch
        check_array("dx_colsum", dx_colsum, dtypes_=tuple(dict.fromkeys((np.dtype(np.float32), dout.dtype))),
                    shape=(C,))
        if (xp is np) != isinstance(dx_colsum, np.ndarray):
            raise TypeError("dx_colsum: must live on the same device as the inputs")
    dx = _grad("dx", dx, xp, dout.shape, dout.dtype, (dout.dtype,))
    param_dtypes = (np.dtype(np.float32), weight.dtype)
    dweight = _grad("dweight", dweight, xp, (C,), weight.dtype, param_dtypes)
    dbias = _grad("dbias", dbias, xp, (C,), dweight.dtype, param_dtypes)
    check_same_dtype(dweight=dweight, dbias=dbias)
    if xp is np:
        ddx, ddw, ddb = layernorm_backward_reference(dout, x, weight, mean, rstd)
        for g, d in ((dx, ddx), (dweight, ddw), (dbias, ddb)):
            g[...] = (g.astype(np.float64) + d).astype(g.dtype)
        if dx_colsum is not None:   # of the final, rounded dx (old values included)
            colsum_reference(dx_colsum, dx.reshape(-1, C))
        return dx, dweight, dbias
    version, N = pick_version(version, dout.dtype, C, (dout, x, weight, dx))
    if rows == 0:
        return dx, dweight, dbias
    suf = dtypes.kernel_suffix(dout.dtype)
    i32 = np.int32
    if version == 2:
        S, N = backward_split(dout.dtype, C, warps_per_row)
        scratch = _backward_v2(xp, dx, dout, x, weight, mean, rstd, rows, C, N, S, dx_colsum is not None)
    else:
        k_dx = runtime.get_kernel("layernorm", f"layernorm_backward_dx_kernel_v1_{suf}")
        runtime.launch(k_dx, -(-rows // WARPS), BLOCK, (dx, dout, x, weight, mean, rstd, i32(rows), i32(C)))
        col_blocks = -(-C // V1_DWDB_BLOCK)
        chunks = max(1, min(rows, 1024, -(-4 * runtime.sm_count() // col_blocks)))
        rows_per_chunk = -(-rows // chunks)
        chunks = -(-rows // rows_per_chunk)
        scratch = xp.empty((chunks, 2, C), dtype=np.float32)
        k_dwdb = runtime.get_kernel("layernorm", f"layernorm_backward_dwdb_kernel_v1_{suf}")
        runtime.launch(k_dwdb, (col_blocks, chunks), V1_DWDB_BLOCK,
                       (scratch, dout, x, mean, rstd, i32(rows), i32(C), i32(rows_per_chunk)))
    wsuf = dtypes.kernel_suffix(dweight.dtype)
    if version == 2 and dx_colsum is not None:
        k_red = runtime.get_kernel("layernorm", f"layernorm_backward_reduce_colsum_kernel_{wsuf}_"
                                                f"{dtypes.kernel_suffix(dx_colsum.dtype)}")
        runtime.launch(k_red, (-(-C // 32), 3), REDUCE_BLOCK,
                       (dweight, dbias, dx_colsum, scratch, i32(scratch.shape[0]), i32(C)))
        return dx, dweight, dbias
    k_red = runtime.get_kernel("layernorm", f"layernorm_backward_reduce_kernel_{wsuf}")
    runtime.launch(k_red, (-(-C // 32), 2), REDUCE_BLOCK, (dweight, dbias, scratch, i32(scratch.shape[0]), i32(C)))
    if dx_colsum is not None:      # v1: a second pass over the finished dx
        colsum(dx_colsum, dx.reshape(rows, C))
    return dx, dweight, dbias
