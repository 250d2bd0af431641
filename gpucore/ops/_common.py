"""Shared plumbing of the ops modules: argument checks and output allocation.

Every public op validates its arguments here *before* any kernel launch, so a
bad call fails with a TypeError/ValueError that names the argument instead of
a CUDA error (or silent garbage) from inside a kernel.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, runtime


def check_array(name: str, x, *, dtype=None, dtypes_=None, ndim=None, min_ndim=None, shape=None,
                max_elements=2**31 - 1):
    """Check one array argument; raise TypeError/ValueError naming `name`.

    ndim: an int or a tuple of allowed ranks. max_elements: our kernels index with 32-bit
    ints; callers that hand the array to cuBLAS (64-bit sizes) pass None.
    """
    if not isinstance(x, np.ndarray) and not runtime.is_gpu_array(x):
        raise TypeError(f"{name}: expected a NumPy or CuPy array, got {type(x).__name__}")
    allowed = (dtypes.normalize(dtype),) if dtype is not None else (dtypes_ or dtypes.FLOAT_DTYPES)
    if x.dtype not in allowed:
        want = " or ".join(dtypes.name(d) for d in allowed)
        raise TypeError(f"{name}: dtype must be {want}, got {dtypes.name(x.dtype)}")
    if ndim is not None and x.ndim not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    if min_ndim is not None and x.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimensions, got shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: array must be C-contiguous (use .copy() or ascontiguousarray)")
    if max_elements is not None and x.size > max_elements:
        raise ValueError(f"{name}: {x.size} elements is more than the kernels' 32-bit indexing allows")
    return x


def check_same_dtype(**arrays):
    items = [(k, v) for k, v in arrays.items() if v is not None]
    first_name, first = items[0]
    for k, v in items[1:]:
        if v.dtype != first.dtype:
            raise TypeError(f"{k}: dtype {dtypes.name(v.dtype)} differs from {first_name}'s "
                            f"{dtypes.name(first.dtype)}")


def output(name: str, out, xp, shape, dtype, allowed=None, max_elements=2**31 - 1):
    """Return `out` checked against (shape, dtype), or a fresh empty array of `dtype`.

    allowed: the dtypes `out` may have instead of exactly `dtype` (e.g. a bf16 matmul writing float32).
    """
    if out is None:
        return xp.empty(shape, dtype=dtype)
    check_array(name, out, dtype=None if allowed else dtype, dtypes_=allowed, shape=shape, max_elements=max_elements)
    if (xp is np) != isinstance(out, np.ndarray):
        raise TypeError(f"{name}: must live on the same device as the inputs")
    return out


def overlaps(xp, a, b) -> bool:
    """Do arrays a and b (both on xp's device) share any memory? (Two outputs of one kernel must not.)"""
    if xp is np:
        return np.shares_memory(a, b)
    return a.size > 0 and b.size > 0 and a.data.ptr < b.data.ptr + b.nbytes and b.data.ptr < a.data.ptr + a.nbytes
