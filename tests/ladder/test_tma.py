"""TMA tensor maps (gpucore/ladder/tma.py): the rules checked before the driver sees a map (CPU),
and the driver's encoding of maps that gemm v7 uses (GPU; v7's results are tests/ladder/test_gemm.py).
"""
import numpy as np
import pytest

import gpucore
from gpucore.ladder import tma

BF16 = gpucore.bfloat16


def test_check_2d_returns_the_row_stride():
    assert tma.check_2d(256, BF16, 100, 768, 128, 64) == 1536
    assert tma.check_2d(256, np.float32, 3, 8, 2, 4, swizzle=tma.SWIZZLE_NONE, row_stride_bytes=64) == 64


@pytest.mark.parametrize("args,kwargs,match", [
    ((8, BF16, 10, 64, 64, 64), {}, "16-byte aligned"),
    ((256, BF16, 10, 60, 64, 64), {}, "multiple of 16 bytes"),
    ((256, BF16, 10, 64, 64, 128), {}, "at most 128 bytes"),
    ((256, BF16, 10, 64, 300, 64), {}, "1..256"),
    ((256, BF16, 10, 64, 64, 4), {}, "multiple of 16 bytes"),
    ((256, np.int32, 10, 64, 64, 32), {}, "dtype"),
    ((256, BF16, 0, 64, 64, 64), {}, "at least one row"),
    ((256, BF16, 10, 64, 64, 64), {"swizzle": 7}, "swizzle"),
    ((256, BF16, 10, 64, 64, 64), {"row_stride_bytes": 96}, "shorter than a row"),
])
def test_check_2d_names_what_the_driver_would_reject(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tma.check_2d(*args, **kwargs)


@pytest.mark.cuda
def test_gpu_encode_2d_is_deterministic_and_depends_on_the_array():
    cp = gpucore.runtime.cupy
    x = cp.zeros((300, 768), dtype=BF16)
    m1 = tma.encode_2d(x.data.ptr, BF16, 300, 768, 128, 64)
    assert len(m1) == tma.MAP_BYTES
    assert m1 == tma.encode_2d(x.data.ptr, BF16, 300, 768, 128, 64)
    assert m1 != tma.encode_2d(x.data.ptr + 16 * 768, BF16, 290, 768, 128, 64)
    assert m1 != tma.encode_2d(x.data.ptr, BF16, 300, 768, 64, 64)
    with pytest.raises(ValueError, match="16-byte aligned"):
        tma.encode_2d(x.data.ptr + 2, BF16, 300, 768, 128, 64)
