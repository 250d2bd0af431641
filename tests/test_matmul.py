"""gpucore matmul family: cuBLAS training path, batched matmul, and the GEMM ladder (v1-v4).

CPU: references against float64 NumPy / finite differences, argument checks.
GPU (pytest -m cuda): every path against the reference on fresh random data,
outputs poisoned with NaN first, odd shapes, structured inputs (identity,
one-hot) that make a wrong fragment/tile mapping print the first wrong (row, col).
"""
import numpy as np
import pytest

import gpucore
from gpucore import runtime
from gpucore.ops import matmul as mm
from conftest import poison, rel_err, to_cpu
from gradcheck import assert_grad_close, numerical_grad

BF16 = gpucore.bfloat16
DTYPES = [np.float32, BF16]
TOL = {np.dtype(np.float32): 1e-5, np.dtype(BF16): 1e-2}


def _rand(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


# ------------------------------------------------------------------ CPU ----

@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_matmul_reference(rng, dtype):
    a = _rand(rng, (3, 4, 5), dtype)
    b = _rand(rng, (3, 5, 6), dtype)
    out = gpucore.batched_matmul(a, b)
    assert out.shape == (3, 4, 6) and out.dtype == dtype
    ref = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_array_equal(out, ref.astype(dtype))
    # transposes, alpha, beta
    at = np.ascontiguousarray(a.swapaxes(1, 2))
    bt = np.ascontiguousarray(b.swapaxes(1, 2))
    c = _rand(rng, (3, 4, 6), dtype)
    c0 = c.astype(np.float64)
    gpucore.batched_matmul(at, bt, out=c, transpose_a=True, transpose_b=True, alpha=0.5, beta=2.0)
    np.testing.assert_array_equal(c, (0.5 * ref + 2.0 * c0).astype(dtype))


def test_batched_matmul_bf16_to_f32_out(rng):
    a = _rand(rng, (2, 3, 8), BF16)
    b = _rand(rng, (2, 8, 4), BF16)
    out = np.empty((2, 3, 4), np.float32)
    gpucore.batched_matmul(a, b, out=out)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-6)


def test_matmul_reference_shapes(rng):
    # The reference is float64 rounded once to float32: compare with float64.
    f64 = np.float64
    a2, b2 = _rand(rng, (4, 5), np.float32), _rand(rng, (5, 3), np.float32)
    np.testing.assert_array_equal(gpucore.matmul(a2, b2), (a2.astype(f64) @ b2).astype(np.float32))
    a3 = _rand(rng, (2, 4, 5), np.float32)
    np.testing.assert_array_equal(gpucore.matmul(a3, b2), (a3.astype(f64) @ b2).astype(np.float32))
    b3 = _rand(rng, (2, 5, 3), np.float32)
    np.testing.assert_array_equal(gpucore.matmul(a3, b3), (a3.astype(f64) @ b3).astype(np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_forward_reference(rng, dtype):
    x = _rand(rng, (2, 3, 8), dtype)
    w = _rand(rng, (5, 8), dtype)
    b = _rand(rng, (5,), dtype)
    out = gpucore.matmul_forward(x, w, b)
    assert out.shape == (2, 3, 5) and out.dtype == dtype
    ref = x.astype(np.float64) @ w.astype(np.float64).T + b.astype(np.float64)
    np.testing.assert_array_equal(out, ref.astype(dtype))
    np.testing.assert_array_equal(gpucore.matmul_forward(x, w), (ref - b.astype(np.float64)).astype(dtype))


def test_matmul_backward_reference_vs_numerical(rng):
    N, K, M = 4, 3, 5
    x, w, b = rng.standard_normal((N, K)), rng.standard_normal((M, K)), rng.standard_normal(M)
    probe = rng.standard_normal((N, M))
    f = np.float32
    dx, dw, db = gpucore.matmul_backward(probe.astype(f), x.astype(f), w.astype(f))
    assert_grad_close(dx, numerical_grad(lambda t: t @ w.T + b, x, probe), 1e-5, "dx")
    assert_grad_close(dw, numerical_grad(lambda t: x @ t.T + b, w, probe), 1e-5, "dweight")
    assert_grad_close(db, numerical_grad(lambda t: x @ w.T + t, b, probe), 1e-5, "dbias")


def test_matmul_backward_accumulates(rng):
    dout, x, w = _rand(rng, (6, 4), np.float32), _rand(rng, (6, 3), np.float32), _rand(rng, (4, 3), np.float32)
    dx0 = np.full((6, 3), 7.0, np.float32)
    dw0, db0 = _rand(rng, (4, 3), np.float32), _rand(rng, (4,), np.float32)
    dw, db = dw0.copy(), db0.copy()
    dx, dw2, db2 = gpucore.matmul_backward(dout, x, w, dx=dx0, dweight=dw, dbias=db)
    assert dx is dx0 and dw2 is dw and db2 is db
    d64 = dout.astype(np.float64)
    np.testing.assert_allclose(dx, d64 @ w, rtol=1e-5, atol=1e-6)                    # [=]
    np.testing.assert_allclose(dw, dw0 + d64.T @ x, rtol=1e-5, atol=1e-6)            # [+=]
    np.testing.assert_allclose(db, db0 + d64.sum(0), rtol=1e-5, atol=1e-6)           # [+=]
    dx, dw, db = gpucore.matmul_backward(dout, x, w, need_dx=False, need_dbias=False)
    assert dx is None and db is None and dw.shape == (4, 3)


def test_gemm_reference(rng):
    a, b = _rand(rng, (5, 7), np.float32), _rand(rng, (7, 3), np.float32)
    np.testing.assert_array_equal(gpucore.gemm(a, b), (a.astype(np.float64) @ b).astype(np.float32))


def test_matmul_bad_input(rng):
    f = np.float32
    a, b = _rand(rng, (2, 3, 4), f), _rand(rng, (2, 4, 5), f)
    with pytest.raises(ValueError, match="a: expected 3 dimensions"):
        gpucore.batched_matmul(a[0], b)
    with pytest.raises(ValueError, match="b: inner dimension"):
        gpucore.batched_matmul(a, b, transpose_b=True)
    with pytest.raises(ValueError, match="b: batch size"):
        gpucore.batched_matmul(a, b[:1].copy())
    with pytest.raises(TypeError, match="b: dtype bfloat16 differs"):
        gpucore.batched_matmul(a, b.astype(BF16))
    with pytest.raises(TypeError, match="out: dtype must be float32"):
        gpucore.batched_matmul(a, b, out=np.empty((2, 3, 5), BF16))   # fp32 in -> fp32 out only
    with pytest.raises(ValueError, match="out: beta != 0"):
        gpucore.batched_matmul(a, b, beta=1.0)
    with pytest.raises(ValueError, match="a: array must be C-contiguous"):
        gpucore.batched_matmul(a.swapaxes(1, 2), b)
    with pytest.raises(TypeError, match="a: dtype"):
        gpucore.matmul(a.astype(np.float64), b)
    x, w = _rand(rng, (6, 4), f), _rand(rng, (5, 4), f)
    with pytest.raises(ValueError, match="weight: expected shape"):
        gpucore.matmul_forward(x, w[:, :3].copy())
    with pytest.raises(ValueError, match="bias: expected shape"):
        gpucore.matmul_forward(x, w, np.zeros(4, f))
    with pytest.raises(ValueError, match="dout: expected shape"):
        gpucore.matmul_backward(np.zeros((6, 4), f), x, w)
    with pytest.raises(ValueError, match="dweight: expected shape"):
        gpucore.matmul_backward(np.zeros((6, 5), f), x, w, dweight=np.zeros((4, 5), f))
    with pytest.raises(ValueError, match="version"):
        gpucore.gemm(x, w.T.copy(), version=9)
