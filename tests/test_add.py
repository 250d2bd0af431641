"""gpucore.add: the NumPy reference, the GPU kernel against it, and argument checks."""
import numpy as np
import pytest

import gpucore
from gpucore import runtime
from conftest import poison, to_cpu

DTYPES = [np.float32, gpucore.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_reference(rng, dtype):
    a = rng.standard_normal((3, 5)).astype(dtype)
    b = rng.standard_normal((3, 5)).astype(dtype)
    out = gpucore.add(a, b)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out.astype(np.float32),
                                  (a.astype(np.float32) + b.astype(np.float32)).astype(dtype).astype(np.float32))
    assert not np.allclose(out.astype(np.float32), a.astype(np.float32))


def test_add_bad_input(rng):
    a = rng.standard_normal(8).astype(np.float32)
    with pytest.raises(TypeError, match="b: dtype"):
        gpucore.add(a, a.astype(np.float64))
    with pytest.raises(ValueError, match="b: expected shape"):
        gpucore.add(a, a[:4].copy())
    with pytest.raises(ValueError, match="a: array must be C-contiguous"):
        gpucore.add(np.ones((4, 4), np.float32).T, np.ones((4, 4), np.float32))
    with pytest.raises(TypeError, match="b: dtype bfloat16 differs"):
        gpucore.add(a, a.astype(gpucore.bfloat16))
    with pytest.raises(TypeError, match="a: expected a NumPy or CuPy array"):
        gpucore.add([1.0], a)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1000, 4096 + 3, 1 << 20])
def test_add_gpu_matches_reference(rng, dtype, n):
    cp = runtime.cupy
    a = rng.standard_normal(n).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    out = poison(n, dtype)
    gpucore.add(cp.asarray(a), cp.asarray(b), out=out)
    np.testing.assert_array_equal(to_cpu(out).view(np.uint16 if dtype != np.float32 else np.uint32),
                                  gpucore.add(a, b).view(np.uint16 if dtype != np.float32 else np.uint32))


@pytest.mark.cuda
def test_add_gpu_unaligned_view(rng):
    cp = runtime.cupy
    a = cp.asarray(rng.standard_normal(1001).astype(np.float32))
    b = cp.asarray(rng.standard_normal(1001).astype(np.float32))
    out = gpucore.add(a[1:], b[1:])          # offset by 4 bytes: the scalar path
    np.testing.assert_array_equal(to_cpu(out), to_cpu(a[1:]) + to_cpu(b[1:]))


@pytest.mark.cuda
def test_add_gpu_rejects_mixed_devices(rng):
    cp = runtime.cupy
    a = rng.standard_normal(8).astype(np.float32)
    with pytest.raises(TypeError, match="mix"):
        gpucore.add(cp.asarray(a), a)
