"""The two floating-point dtypes gpucore computes in: float32 and bfloat16.

bfloat16 is `ml_dtypes.bfloat16`, a real NumPy dtype that CuPy 14 also carries,
so a bf16 array prints, converts and compares like any other. Kernels see bf16
as raw 16-bit patterns (kernels_cu/common.cuh) and accumulate in float32.
"""
import ml_dtypes
import numpy as np

float32 = np.dtype(np.float32)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (float32, bfloat16)

_SUFFIX = {float32: "f32", bfloat16: "bf16"}


def normalize(dtype) -> np.dtype:
    """np.dtype of `dtype`, accepting the strings 'float32', 'fp32', 'bfloat16', 'bf16'."""
    if isinstance(dtype, str):
        dtype = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16"}.get(dtype, dtype)
        if dtype == "bfloat16":
            return bfloat16
    return np.dtype(dtype)


def kernel_suffix(dtype) -> str:
    """'f32' or 'bf16': the suffix of the extern "C" kernel compiled for this dtype."""
    return _SUFFIX[normalize(dtype)]


def name(dtype) -> str:
    return "bfloat16" if normalize(dtype) == bfloat16 else str(normalize(dtype))
