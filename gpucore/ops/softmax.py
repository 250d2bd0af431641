"""Row-wise softmax over the last axis, forward and backward (kernels_cu/softmax.cu).

    y  = exp(x - max(x)) / sum(exp(x - max(x)))          (per row, last axis)
    dx = y * (dout - sum(dout * y))                      (activation grad: =)

The reference computes in float64 and rounds once to the input dtype; the
kernels accumulate in float32 (exp via __expf), so they agree to about 1e-6
relative in float32 and to bf16 rounding in bfloat16.

Kernel versions (see softmax.cu): v2 keeps a row in one warp's registers and
reads it once (rows of up to 32*8 16-byte packs: C <= 2048 bf16 / 1024 fp32,
C a multiple of the pack, 16-byte aligned); v1 is one block per row with an
online max/sum and a re-read, for everything else. v3 is v2's layout with a
lean forward (exp once, raw 32-bit words, hardware bf16 rounding: v2's forward
was instruction-bound); its backward is v2's kernel. `version=None` picks v3
whenever it applies (the same conditions as v2), else v1.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, runtime
from ._common import check_array, check_same_dtype, output

V1_BLOCK_SMALL = 256      # v1 threads per block (one row per block) for rows < V1_LONG_ROW
V1_BLOCK_LONG = 1024
V1_LONG_ROW = 16384
V2_BLOCK = 256            # v2: 8 warps = 8 rows per block
V2_K = (1, 2, 4, 8)       # packs per lane instantiated in softmax.cu (v2 and v3)
VERSIONS = (1, 2, 3)


def softmax_reference(x: np.ndarray) -> np.ndarray:
    """float64 softmax over the last axis."""
    x64 = np.asarray(x, dtype=np.float64)
    e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_backward_reference(dout: np.ndarray, y: np.ndarray) -> np.ndarray:
    """float64 dx = y * (dout - sum(dout * y, last axis))."""
    d64 = np.asarray(dout, dtype=np.float64)
    y64 = np.asarray(y, dtype=np.float64)
    return y64 * (d64 - (d64 * y64).sum(axis=-1, keepdims=True))


def _rows_cols(x, name="x"):
    if x.ndim == 0:
        raise ValueError(f"{name}: softmax needs at least one axis")
    C = x.shape[-1]
    if C == 0 and int(np.prod(x.shape[:-1])) > 0:
        raise ValueError(f"{name}: softmax over an empty last axis is undefined")
    return (x.size // C if C else 0), C


def _aligned(*arrays) -> bool:
    return all(a.data.ptr % 16 == 0 for a in arrays)


def pick_version(version, x_dtype, C, arrays):
    """(version, K) of the softmax kernels for `x_dtype` rows of C elements and these arrays.

    version None: v3 where the warp-per-row layout applies (C a multiple of the 16-byte pack,
    C <= 32 * V2_K[-1] packs, every array 16-byte aligned), else v1; an explicit version is
    checked (ValueError naming what it needs; v2 and v3 need the same). K: packs per lane for
    v2/v3 (the smallest instantiated that holds the row), None for v1."""
    P = 16 // np.dtype(x_dtype).itemsize
    v2_ok = C % P == 0 and _aligned(*arrays) and C // P <= 32 * V2_K[-1]
    if version is None:
        version = 3 if v2_ok else 1
    if version not in VERSIONS:
        raise ValueError(f"version: softmax has kernel versions 1, 2 and 3, got {version!r}")
    if version >= 2 and not v2_ok:
        raise ValueError(f"version: v{version} needs C a multiple of {P}, C <= {32 * V2_K[-1] * P} and "
                         f"16-byte aligned arrays (got C={C})")
    K = next((k for k in V2_K if C // P <= 32 * k), None) if version >= 2 else None
    return version, K


def _launch(direction, version, K, suf, rows, C, args):
    if version >= 2:
        # v3's backward is v2's kernel (see softmax.cu)
        v = 3 if version == 3 and direction == "forward" else 2
        kernel = runtime.get_kernel("softmax", f"softmax_{direction}_kernel_v{v}_k{K}_{suf}")
        runtime.launch(kernel, -(-rows // (V2_BLOCK // 32)), V2_BLOCK, (*args, np.int32(rows), np.int32(C)))
    else:
        kernel = runtime.get_kernel("softmax", f"softmax_{direction}_kernel_v1_{suf}")
        block = V1_BLOCK_LONG if C >= V1_LONG_ROW else V1_BLOCK_SMALL
        runtime.launch(kernel, rows, block, (*args, np.int32(rows), np.int32(C)))


def softmax(x, out=None, version=None):
    """Softmax of x (float32 or bfloat16, any shape) over its last axis; out may be x."""
    check_array("x", x)
    rows, C = _rows_cols(x)
    xp = runtime.array_module(x, out)
    out = output("out", out, xp, x.shape, x.dtype)
    if xp is np:
        out[...] = softmax_reference(x).astype(x.dtype)
        return out
    version, K = pick_version(version, x.dtype, C, (x, out))
    if rows == 0:
        return out
    _launch("forward", version, K, dtypes.kernel_suffix(x.dtype), rows, C, (out, x))
    return out


def softmax_backward(dout, y, dx=None, version=None):
    """dx = y * (dout - sum(dout * y)) over the last axis; dx is overwritten and may alias dout or y."""
    check_array("dout", dout)
    check_array("y", y, shape=dout.shape)
    check_same_dtype(dout=dout, y=y)
    rows, C = _rows_cols(dout, "dout")
    xp = runtime.array_module(dout, y, dx)
    dx = output("dx", dx, xp, dout.shape, dout.dtype)
    if xp is np:
        dx[...] = softmax_backward_reference(dout, y).astype(dout.dtype)
        return dx
    version, K = pick_version(version, dout.dtype, C, (dout, y, dx))
    if rows == 0:
        return dx
    _launch("backward", version, K, dtypes.kernel_suffix(dout.dtype), rows, C, (dx, dout, y))
    return dx
