"""gpucore.sum / gpucore.max: reference, GPU against reference, determinism, bad input."""
import numpy as np
import pytest

import gpucore
from gpucore import runtime
from conftest import rel_err, to_cpu

DTYPES = [np.float32, gpucore.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_values(rng, dtype):
    x = rng.standard_normal((4, 33)).astype(dtype)
    x64 = x.astype(np.float64)
    assert gpucore.sum(x).dtype == dtype
    assert float(gpucore.sum(x)) == pytest.approx(float(np.asarray(x64.sum()).astype(dtype)), rel=0, abs=0)
    np.testing.assert_array_equal(gpucore.max(x, axis=-1).astype(np.float64), x64.max(axis=-1))
    np.testing.assert_allclose(gpucore.sum(x, axis=-1).astype(np.float64), x64.sum(-1), rtol=1e-2)


def test_reduce_bad_input(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="axis"):
        gpucore.sum(x, axis=0)
    with pytest.raises(ValueError, match="x: max of an empty"):
        gpucore.max(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="out: expected shape"):
        gpucore.sum(x, axis=-1, out=np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="x: dtype"):
        gpucore.max(x.astype(np.float16))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 5, 1000, 65536 + 7, 1 << 22])
def test_gpu_whole_array(rng, dtype, n):
    cp = runtime.cupy
    x = rng.standard_normal(n).astype(dtype)
    xg = cp.asarray(x)
    s, m = gpucore.sum(xg), gpucore.max(xg)
    assert s.shape == () and s.dtype == dtype
    ref_s = x.astype(np.float64).sum()
    tol = 1e-5 if dtype == np.float32 else 1e-2
    assert abs(float(to_cpu(s)) - ref_s) <= tol * max(1.0, np.abs(x.astype(np.float64)).sum() / np.sqrt(n))
    assert float(to_cpu(m)) == float(x.astype(np.float64).max())
    # deterministic: bitwise the same twice
    assert to_cpu(gpucore.sum(xg)).tobytes() == to_cpu(s).tobytes()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,C", [(1, 1), (3, 7), (64, 768), (1000, 1600), (17, 50257), (5, 50304)])
def test_gpu_last_axis(rng, dtype, rows, C):
    cp = runtime.cupy
    x = rng.standard_normal((rows, C)).astype(dtype)
    xg = cp.asarray(x)
    out = cp.full(rows, np.nan, dtype=np.float32).astype(dtype)
    gpucore.sum(xg, axis=-1, out=out)
    ref = x.astype(np.float64).sum(-1)
    assert rel_err(to_cpu(out), ref) < (1e-5 if dtype == np.float32 else 1e-2)
    np.testing.assert_array_equal(to_cpu(gpucore.max(xg, axis=-1)).astype(np.float64), x.astype(np.float64).max(-1))


@pytest.mark.cuda
def test_gpu_max_propagates_nan(rng):
    cp = runtime.cupy
    x = rng.standard_normal(10000).astype(np.float32)
    x[1234] = np.nan
    assert np.isnan(float(to_cpu(gpucore.max(cp.asarray(x)))))
