"""gpucore.astype: float32 <-> bfloat16 casts match ml_dtypes bit for bit."""
import numpy as np
import pytest

import gpucore
from gpucore import runtime
from conftest import poison, to_cpu

SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-40, -1e-40, 3.4e38, -3.4e38,
                     1.00390625, 1.01171875, 1.0 + 2**-8, 65504.0, 1e-45], np.float32)


def _bits(x):
    x = to_cpu(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def test_cast_reference_roundtrip(rng):
    x = rng.standard_normal(100).astype(np.float32)
    y = gpucore.astype(x, "bfloat16")
    assert y.dtype == gpucore.bfloat16
    z = gpucore.astype(y, np.float32)
    assert z.dtype == np.float32
    assert np.max(np.abs(z - x) / np.abs(x)) <= 2**-8   # bf16 has 8 bits of mantissa
    np.testing.assert_array_equal(_bits(gpucore.astype(z, "bf16")), _bits(y))


def test_cast_bad_dtype(rng):
    x = rng.standard_normal(4).astype(np.float32)
    with pytest.raises(TypeError, match="dtype: must be"):
        gpucore.astype(x, np.float16)
    with pytest.raises(TypeError, match="x: dtype"):
        gpucore.astype(x.astype(np.int32), np.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 9, 4096 + 5, 1 << 20])
def test_cast_gpu_bit_exact(rng, n):
    cp = runtime.cupy
    x = (rng.standard_normal(n) * rng.choice([1e-30, 1.0, 1e30], n)).astype(np.float32)
    x[: min(n, len(SPECIALS))] = SPECIALS[: min(n, len(SPECIALS))]
    out = poison(n, gpucore.bfloat16)
    gpucore.astype(cp.asarray(x), gpucore.bfloat16, out=out)
    np.testing.assert_array_equal(_bits(out), _bits(x.astype(gpucore.bfloat16)))


@pytest.mark.cuda
def test_cast_gpu_all_bf16_patterns():
    cp = runtime.cupy
    allbits = np.arange(1 << 16, dtype=np.uint16).view(gpucore.bfloat16)
    back = gpucore.astype(cp.asarray(allbits), np.float32)
    np.testing.assert_array_equal(_bits(back), _bits(allbits.astype(np.float32)))
    again = gpucore.astype(back, gpucore.bfloat16)
    np.testing.assert_array_equal(_bits(again), _bits(allbits.astype(np.float32).astype(gpucore.bfloat16)))
