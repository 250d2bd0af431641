"""dtype casts float32 <-> bfloat16 (kernels_cu/cast.cu).

Rounding is to nearest even, NaN -> canonical quiet NaN, as ml_dtypes does:
`astype(x, bfloat16)` on the GPU equals `x.astype(ml_dtypes.bfloat16)` on the
CPU bit for bit. A cast to the array's own dtype is a copy.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, runtime
from ._common import check_array, output

BLOCK = 256
UNROLL = 4          # groups of 8 elements per thread, as in cast.cu


def astype(x, dtype, out=None):
    """x converted to `dtype` (float32 or bfloat16); always a new array unless `out` is given."""
    check_array("x", x)
    dtype = dtypes.normalize(dtype)
    if dtype not in dtypes.FLOAT_DTYPES:
        raise TypeError(f"dtype: must be float32 or bfloat16, got {dtypes.name(dtype)}")
    xp = runtime.array_module(x, out)
    out = output("out", out, xp, x.shape, dtype)
    if xp is np or x.dtype == dtype:
        out[...] = x.astype(dtype)
        return out
    n = x.size
    if n == 0:
        return out
    name = "cast_f32_to_bf16_kernel" if dtype == dtypes.bfloat16 else "cast_bf16_to_f32_kernel"
    kernel = runtime.get_kernel("cast", name)
    grid = -(-n // (BLOCK * UNROLL * 8))          # both kernels: 32 elements per thread
    runtime.launch(kernel, grid, BLOCK, (out, x, np.int32(n)))
    return out
