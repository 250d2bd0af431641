"""GELU, tanh approximation as in GPT-2, forward and backward (kernels_cu/gelu.cu).

    gelu(x)  = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))
    dx       = gelu'(x) * dout                       (activation grad: =)

The reference computes in float64 and rounds once to the input dtype. The
kernels compute in float32 through the equivalent sigmoid form
x * sigmoid(2u) with __expf, so they agree with the reference to a few
float32 ulps (and to bf16 rounding in bfloat16).

gelu_backward(..., dbias=) also adds dx's column sums into dbias: in GPT-2 the
MLP's fc bias gradient is the column sum of exactly this dx (dfch), so fusing
it here saves matmul_backward a full read of dx (403 MB at 65536 x 3072 bf16).
The kernel writes per-row-chunk float32 partials; the column sum's stage 2
(colsum.reduce_partials) adds them in order: deterministic, no atomics.

gelu_backward(..., gelu_out=) also writes gelu(x), bit for bit what gelu(x)
writes: a model that does not keep the GELU outputs (GPT2 keep_gelu off, d48)
needs them again for fcproj's weight gradient, and this pass reads x anyway, so
the recompute costs its writes only, not a pass of its own (gpucore/model.py).
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, runtime
from .. import profiler
from ._common import check_array, check_same_dtype, output, overlaps
from .colsum import colsum, reduce_partials   # the column sum (fallback) and its stage 2

BLOCK = 256
UNROLL = 4          # 16-byte packs per thread, as in gelu.cu
DBIAS_WARPS = 8     # DB_WARPS in gelu.cu: blockDim = (32, DBIAS_WARPS)
DBIAS_ROWS_PER_CHUNK = 128   # rows summed per block (16 per thread): float32 partials of N/128 rows
MAX_GRID_Y = 65535

_K = np.sqrt(2.0 / np.pi)
_A = 0.044715


def _sigmoids(x64):
    """s = sigmoid(2u) = 0.5 (1 + tanh u) and 1 - s, without cancellation.

    The tanh form 0.5 x (1 + tanh u) loses everything in the negative tail even
    in float64: at x = -6.27, 1 + tanh(u) ~ 2e-12 carries tanh's 1e-16 absolute
    error, 5e-5 relative -- more than the float32 kernels' own error (a GPU test
    caught the reference, not the kernel). exp overflow -> inf -> 0 is exact here.
    """
    u = _K * (x64 + _A * x64 ** 3)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-2.0 * u)), 1.0 / (1.0 + np.exp(2.0 * u))


def gelu_reference(x: np.ndarray) -> np.ndarray:
    """float64 GELU (tanh approximation) = x * sigmoid(2u)."""
    x64 = np.asarray(x, dtype=np.float64)
    s, _ = _sigmoids(x64)
    return x64 * s


def gelu_backward_reference(dout: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 dx = gelu'(x) * dout, gelu' = s + 2 x s (1 - s) u'."""
    x64 = np.asarray(x, dtype=np.float64)
    s, one_minus_s = _sigmoids(x64)
    grad = s + 2.0 * x64 * s * one_minus_s * _K * (1.0 + 3.0 * _A * x64 * x64)
    return grad * np.asarray(dout, dtype=np.float64)


def _grid(n: int, dtype) -> int:
    per_block = BLOCK * UNROLL * (16 // np.dtype(dtype).itemsize)   # elements
    return -(-n // per_block)


@profiler.profiled("gelu forward", nbytes=profiler.io_bytes)
def gelu(x, out=None):
    """GELU of x (float32 or bfloat16, any shape), elementwise; out may be x."""
    check_array("x", x)
    xp = runtime.array_module(x, out)
    out = output("out", out, xp, x.shape, x.dtype)
    if xp is np:
        out[...] = gelu_reference(x).astype(x.dtype)
        return out
    n = x.size
    if n == 0:
        return out
    kernel = runtime.get_kernel("gelu", f"gelu_forward_kernel_{dtypes.kernel_suffix(x.dtype)}")
    runtime.launch(kernel, _grid(n, x.dtype), BLOCK, (out, x, np.int32(n)))
    return out


def _check_dbias(dbias, dout, xp):
    """dbias: (C,) float32 or dout's dtype, C = dout.shape[-1], on dout's device."""
    check_array("dbias", dbias, dtypes_=tuple(dict.fromkeys((dtypes.float32, dout.dtype))), ndim=1)
    if dout.ndim < 1:
        raise ValueError("dbias: needs dout with at least one dimension (its last one is dbias's)")
    if dbias.shape[0] != dout.shape[-1]:
        raise ValueError(f"dbias: expected shape ({dout.shape[-1]},) = dout's last dimension, "
                         f"got {tuple(dbias.shape)}")
    if (xp is np) != isinstance(dbias, np.ndarray) or (xp is not np and dbias.device.id != dout.device.id):
        raise TypeError("dbias: must live on the same device as the inputs")


def dbias_rows_per_chunk(N: int) -> int:
    """Rows per partial of the fused column sum: a function of N only (the same input gives the
    same chunks, hence the same bits); grows past DBIAS_ROWS_PER_CHUNK only when the chunk count
    would exceed the grid's y limit."""
    step = DBIAS_WARPS * 4   # DB_WARPS * DB_UNROLL: one round of loads of the whole block
    rows = DBIAS_ROWS_PER_CHUNK
    if -(-N // rows) > MAX_GRID_Y:
        rows = -(-(-(-N // MAX_GRID_Y)) // step) * step
    return rows


def _check_gelu_out(gelu_out, dout, x, dx, xp):
    """gelu_out: dout's shape and dtype, on its device, sharing no memory with dout, x or dx (the
    kernel writes it beside dx, and the reference computes both from the original x)."""
    check_array("gelu_out", gelu_out, dtypes_=(dout.dtype,), shape=dout.shape)
    if (xp is np) != isinstance(gelu_out, np.ndarray) or (xp is not np and gelu_out.device.id != dout.device.id):
        raise TypeError("gelu_out: must live on the same device as the inputs")
    for name, a in (("dout", dout), ("x", x), ("dx", dx)):
        if a is not None and overlaps(xp, gelu_out, a):
            raise ValueError(f"gelu_out: must not overlap {name}")


@profiler.profiled("gelu backward", nbytes=profiler.io_bytes)
def gelu_backward(dout, x, dx=None, *, dbias=None, gelu_out=None):
    """dx = gelu'(x) * dout (overwritten, not accumulated); dx may alias dout.

    dbias (C,), C = dout.shape[-1], float32 or dout's dtype, optional: dbias += the
    column sums of dx over all leading rows, of dx as stored (rounded to its dtype:
    what a later matmul_backward would read), accumulated in float32 on the GPU
    (float64 in the reference) and rounded once into dbias; deterministic.
    gelu_out (dout's shape and dtype), optional: also gelu(x) [=], the same bits as
    gelu(x, out=gelu_out), from the same pass; it may not overlap dout, x or dx.
    """
    check_array("dout", dout)
    check_array("x", x, shape=dout.shape)
    check_same_dtype(dout=dout, x=x)
    xp = runtime.array_module(dout, x, dx, gelu_out)
    dx = output("dx", dx, xp, dout.shape, dout.dtype)
    if dbias is not None:
        _check_dbias(dbias, dout, xp)
    if gelu_out is not None:
        _check_gelu_out(gelu_out, dout, x, dx, xp)
    if xp is np:
        if gelu_out is not None:     # before dx is written: dx may alias dout, never x
            gelu_out[...] = gelu_reference(x).astype(x.dtype)
        dx[...] = gelu_backward_reference(dout, x).astype(dout.dtype)
        if dbias is not None:
            C = dout.shape[-1]
            sums = dx.astype(np.float64).reshape(-1, C).sum(axis=0) if C else np.zeros(0)
            dbias[...] = (dbias.astype(np.float64) + sums).astype(dbias.dtype)
        return dx
    n = dout.size
    if n == 0:
        return dx
    if dbias is not None:
        return _gelu_backward_dbias(dx, dbias, dout, x, gelu_out)
    runtime.launch(_backward_kernel("gelu_backward", dout.dtype, gelu_out), _grid(n, dout.dtype), BLOCK,
                   (dx, *_gout(gelu_out), dout, x, np.int32(n)))
    return dx


def _backward_kernel(family, dtype, gelu_out):
    """gelu.cu's `family` kernel for dtype, its _gout variant (gelu(x) written too) when gelu_out is given."""
    return runtime.get_kernel("gelu", f"{family}{'_gout' if gelu_out is not None else ''}_kernel_"
                                      f"{dtypes.kernel_suffix(dtype)}")


def _gout(gelu_out):
    """The _gout kernels' extra argument (after dx), none for the plain ones."""
    return () if gelu_out is None else (gelu_out,)


def _gelu_backward_dbias(dx, dbias, dout, x, gelu_out):
    """GPU: dx [and gelu_out] and per-chunk column sums in one pass, then colsum's stage 2 into
    dbias. Layouts the 16-byte kernel cannot take (C % pack != 0, unaligned views) run
    gelu_backward, then the two-stage column sum over dx (colsum.colsum: one more read of dx; same
    math, so the same dx bits)."""
    cp = runtime.cupy
    C = dout.shape[-1]
    N = dout.size // C
    P = 16 // dout.dtype.itemsize
    if C % P or any(a.data.ptr % 16 for a in (dx, dout, x, *_gout(gelu_out))):
        gelu_backward(dout, x, dx=dx, gelu_out=gelu_out)
        colsum(dbias, dx.reshape(N, C))
        return dx
    rows = dbias_rows_per_chunk(N)
    chunks = -(-N // rows)
    partials = cp.empty((chunks, C), dtype=np.float32)
    runtime.launch(_backward_kernel("gelu_backward_dbias", dout.dtype, gelu_out), (-(-C // (32 * P)), chunks),
                   (32, DBIAS_WARPS), (dx, *_gout(gelu_out), partials, dout, x, np.int32(N), np.int32(C), np.int32(rows)))
    reduce_partials(dbias, partials)
    return dx
