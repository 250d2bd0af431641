"""Elementwise add (kernels_cu/add.cu): out = a + b, the residual connection.

Reference: NumPy adds in the input dtype; for bfloat16, ml_dtypes computes in
float32 and rounds once, which is exactly what the kernel does, so the GPU
result matches the reference bit for bit.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, runtime
from ._common import check_array, check_same_dtype, output

BLOCK = 256
UNROLL = 4          # 16-byte packs per thread, as in add.cu


def add_reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.astype(np.float32) + b.astype(np.float32)).astype(a.dtype)


def add(a, b, out=None):
    """a + b elementwise; a, b (and out) of the same shape and dtype (float32 or bfloat16)."""
    check_array("a", a)
    check_array("b", b, shape=a.shape)
    check_same_dtype(a=a, b=b)
    xp = runtime.array_module(a, b, out)
    out = output("out", out, xp, a.shape, a.dtype)
    if xp is np:
        out[...] = add_reference(a, b)
        return out
    n = a.size
    if n == 0:
        return out
    kernel = runtime.get_kernel("add", f"add_forward_kernel_{dtypes.kernel_suffix(a.dtype)}")
    per_block = BLOCK * UNROLL * (16 // a.dtype.itemsize)   # elements
    grid = -(-n // per_block)
    runtime.launch(kernel, grid, BLOCK, (out, a, b, np.int32(n)))
    return out
