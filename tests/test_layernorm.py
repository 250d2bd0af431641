"""gpucore layernorm_forward / layernorm_backward / fused_residual_layernorm_forward:
reference vs float64 finite differences, GPU (v1 and v2) vs reference, determinism, bad input."""
import numpy as np
import pytest

import gpucore
from gpucore import runtime
from gpucore.ops.layernorm import layernorm_backward_reference, layernorm_forward_reference
from conftest import poison, rel_err, to_cpu
from gradcheck import assert_grad_close, numerical_grad

DTYPES = [np.float32, gpucore.bfloat16]
TOL = {np.dtype(np.float32): 1e-5, np.dtype(gpucore.bfloat16): 1e-2}


def _params(rng, C, dtype=np.float64):
    w = (1.0 + 0.5 * rng.standard_normal(C)).astype(dtype)
    b = (0.5 * rng.standard_normal(C)).astype(dtype)
    return w, b


# ------------------------------------------------------------------ CPU ------

def test_forward_reference_normalises(rng):
    x = rng.standard_normal((3, 5, 16)) * 4 + 2
    out, mean, rstd = layernorm_forward_reference(x, np.ones(16), np.zeros(16), eps=0.0)
    np.testing.assert_allclose(out.mean(-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(out.std(-1), 1.0, atol=1e-12)
    np.testing.assert_allclose(mean, x.mean(-1), atol=1e-12)
    np.testing.assert_allclose(rstd, 1 / x.std(-1), rtol=1e-12)


def test_backward_reference_matches_finite_differences(rng):
    B, T, C = 2, 3, 7
    x = rng.standard_normal((B, T, C)) * 2 + 0.5
    w, b = _params(rng, C)
    probe = rng.standard_normal((B, T, C))
    eps = 1e-5
    _, mean, rstd = layernorm_forward_reference(x, w, b, eps)
    dx, dw, db = layernorm_backward_reference(probe, x, w, mean, rstd)
    assert_grad_close(dx, numerical_grad(lambda v: layernorm_forward_reference(v, w, b, eps)[0], x, probe),
                      rtol=1e-6, name="dx")
    assert_grad_close(dw, numerical_grad(lambda v: layernorm_forward_reference(x, v, b, eps)[0], w, probe),
                      rtol=1e-6, name="dweight")
    assert_grad_close(db, numerical_grad(lambda v: layernorm_forward_reference(x, w, v, eps)[0], b, probe),
                      rtol=1e-6, name="dbias")


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_cpu_forward_backward_accumulate(rng, dtype):
    x = rng.standard_normal((2, 3, 8)).astype(dtype)
    w, b = (p.astype(dtype) for p in _params(rng, 8))
    out, mean, rstd = gpucore.layernorm_forward(x, w, b)
    assert out.dtype == dtype and mean.dtype == np.float32 and rstd.shape == (2, 3)
    ref, rm, rr = layernorm_forward_reference(x, w, b)
    np.testing.assert_array_equal(out.astype(np.float64), ref.astype(dtype).astype(np.float64))
    np.testing.assert_allclose(mean, rm, rtol=1e-6)
    np.testing.assert_allclose(rstd, rr, rtol=1e-6)
    np.testing.assert_array_equal(gpucore.layernorm(x, w, b).astype(np.float64), out.astype(np.float64))
    dout = rng.standard_normal(x.shape).astype(dtype)
    dx0 = rng.standard_normal(x.shape).astype(dtype)
    dw0 = rng.standard_normal(8).astype(np.float32)
    dx, dw, db = gpucore.layernorm_backward(dout, x, w, mean, rstd, dx=dx0.copy(), dweight=dw0.copy())
    assert dw.dtype == np.float32 and db.dtype == np.float32      # dbias follows dweight's dtype
    rdx, rdw, rdb = layernorm_backward_reference(dout, x, w, mean, rstd)
    np.testing.assert_allclose(dx.astype(np.float64), dx0.astype(np.float64) + rdx, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(dw, dw0 + rdw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, rdb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_cpu_fused_residual(rng, dtype):
    a = rng.standard_normal((4, 16)).astype(dtype)
    b = rng.standard_normal((4, 16)).astype(dtype)
    w, bias = (p.astype(dtype) for p in _params(rng, 16))
    residual, out, mean, rstd = gpucore.fused_residual_layernorm_forward(a, b, w, bias)
    np.testing.assert_array_equal(residual.astype(np.float64), gpucore.add(a, b).astype(np.float64))
    o2, m2, r2 = gpucore.layernorm_forward(residual, w, bias)
    np.testing.assert_array_equal(out.astype(np.float64), o2.astype(np.float64))
    np.testing.assert_array_equal(mean, m2)
    np.testing.assert_array_equal(rstd, r2)


def test_bad_input(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w, b = (p.astype(np.float32) for p in _params(rng, 8))
    with pytest.raises(TypeError, match="x: dtype"):
        gpucore.layernorm_forward(x.astype(np.float64), w, b)
    with pytest.raises(ValueError, match="x: array must be C-contiguous"):
        gpucore.layernorm_forward(np.ones((8, 8), np.float32).T, w, b)
    with pytest.raises(ValueError, match="weight: expected shape"):
        gpucore.layernorm_forward(x, w[:4].copy(), b)
    with pytest.raises(ValueError, match="bias: expected shape"):
        gpucore.layernorm_forward(x, w, np.ones(9, np.float32))
    with pytest.raises(TypeError, match="weight: dtype bfloat16 differs"):
        gpucore.layernorm_forward(x, w.astype(gpucore.bfloat16), b)
    with pytest.raises(ValueError, match="x: expected at least 1"):
        gpucore.layernorm_forward(np.ones((), np.float32), w, b)
    with pytest.raises(ValueError, match="x: layernorm over an empty last axis"):
        gpucore.layernorm_forward(np.ones((3, 0), np.float32), w[:0].copy(), b[:0].copy())
    with pytest.raises(ValueError, match="eps"):
        gpucore.layernorm_forward(x, w, b, eps=-1.0)
    with pytest.raises(ValueError, match="mean: expected shape"):
        gpucore.layernorm_forward(x, w, b, mean=np.empty(3, np.float32))
    with pytest.raises(TypeError, match="rstd: dtype"):
        gpucore.layernorm_forward(x, w, b, rstd=np.empty(4, gpucore.bfloat16))
    with pytest.raises(ValueError, match="b: expected shape"):
        gpucore.fused_residual_layernorm_forward(x, x[:2].copy(), w, b)
    with pytest.raises(TypeError, match="b: dtype"):
        gpucore.fused_residual_layernorm_forward(x, x.astype(gpucore.bfloat16), w, b)
    with pytest.raises(ValueError, match="residual: expected shape"):
        gpucore.fused_residual_layernorm_forward(x, x, w, b, residual=np.empty((4, 7), np.float32))
    _, mean, rstd = gpucore.layernorm_forward(x, w, b)
    with pytest.raises(ValueError, match="x: expected shape"):
        gpucore.layernorm_backward(x, x[:2].copy(), w, mean, rstd)
    with pytest.raises(TypeError, match="mean: dtype"):
        gpucore.layernorm_backward(x, x, w, mean.astype(gpucore.bfloat16), rstd)
    with pytest.raises(ValueError, match="rstd: expected shape"):
        gpucore.layernorm_backward(x, x, w, mean, rstd[:2].copy())
    with pytest.raises(TypeError, match="dx: dtype"):
        gpucore.layernorm_backward(x, x, w, mean, rstd, dx=x.astype(gpucore.bfloat16))
    with pytest.raises(ValueError, match="dweight: expected shape"):
        gpucore.layernorm_backward(x, x, w, mean, rstd, dweight=np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="dbias: dtype"):
        gpucore.layernorm_backward(x, x, w, mean, rstd, dweight=np.zeros(8, np.float32),
                                   dbias=np.zeros(8, gpucore.bfloat16))
    with pytest.raises(ValueError, match="dx: array must be C-contiguous"):
        gpucore.layernorm_backward(x, x, w, mean, rstd, dx=np.zeros((8, 4), np.float32).T)


# ------------------------------------------------------------------ GPU ------

# (rows, C): C in {768, 1024, 1600} (GPT-2 sizes) plus small and odd ones; rows not
# multiples of the 4 rows per block. (C=1600 float32 and odd C take v1.)
SHAPES = [(1, 768), (7, 768), (301, 768), (5, 1024), (130, 1024), (3, 1600), (257, 1600),
          (9, 8), (33, 96), (6, 37), (5, 2056)]


def _gpu_inputs(rng, rows, C, dtype):
    x = (rng.standard_normal((rows, C)) * 2 + 0.3).astype(dtype)
    w, b = (p.astype(dtype) for p in _params(rng, C))
    return x, w, b


def _versions(C, dtype):
    P = 16 // np.dtype(dtype).itemsize
    return [1, 2] if C % P == 0 and C // P <= 256 else [1]


def _check_forward(out, mean, rstd, x, w, b, dtype):
    ref, rm, rr = layernorm_forward_reference(x, w, b)
    o = to_cpu(out).astype(np.float64)
    assert not np.isnan(o).any()
    assert rel_err(o, ref) < TOL[np.dtype(dtype)]
    np.testing.assert_allclose(to_cpu(mean), rm, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(to_cpu(rstd), rr, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,C", SHAPES)
def test_gpu_forward(rng, dtype, rows, C):
    cp = runtime.cupy
    x, w, b = _gpu_inputs(rng, rows, C, dtype)
    for version in _versions(C, dtype):
        out = poison((rows, C), dtype)
        mean = cp.full(rows, np.nan, np.float32)
        rstd = cp.full(rows, np.nan, np.float32)
        gpucore.layernorm_forward(cp.asarray(x), cp.asarray(w), cp.asarray(b), out=out, mean=mean, rstd=rstd,
                                  version=version)
        _check_forward(out, mean, rstd, x, w, b, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,C", SHAPES)
def test_gpu_fused_residual_forward(rng, dtype, rows, C):
    cp = runtime.cupy
    a, w, b = _gpu_inputs(rng, rows, C, dtype)
    a2 = rng.standard_normal((rows, C)).astype(dtype)
    res_ref = gpucore.add(a, a2)                     # NumPy reference of the rounded residual
    for version in _versions(C, dtype):
        residual, out = poison((rows, C), dtype), poison((rows, C), dtype)
        mean = cp.full(rows, np.nan, np.float32)
        rstd = cp.full(rows, np.nan, np.float32)
        gpucore.fused_residual_layernorm_forward(cp.asarray(a), cp.asarray(a2), cp.asarray(w), cp.asarray(b),
                                                 residual=residual, out=out, mean=mean, rstd=rstd,
                                                 version=version)
        np.testing.assert_array_equal(to_cpu(residual).astype(np.float64), res_ref.astype(np.float64))
        _check_forward(out, mean, rstd, res_ref, w, b, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,C", SHAPES + [(4099, 768)])
def test_gpu_backward(rng, dtype, rows, C):
    cp = runtime.cupy
    x, w, b = _gpu_inputs(rng, rows, C, dtype)
    xg, wg, bg = cp.asarray(x), cp.asarray(w), cp.asarray(b)
    _, mean, rstd = gpucore.layernorm_forward(xg, wg, bg)
    dout = rng.standard_normal((rows, C)).astype(dtype)
    dx0 = rng.standard_normal((rows, C)).astype(dtype)
    dw0 = rng.standard_normal(C).astype(dtype)
    db0 = rng.standard_normal(C).astype(dtype)
    rdx, rdw, rdb = layernorm_backward_reference(dout, x, w, to_cpu(mean), to_cpu(rstd))
    tol = TOL[np.dtype(dtype)]
    for version in _versions(C, dtype):
        results = []
        for _ in range(2):                              # twice: must be bitwise identical
            dx, dw, db = cp.asarray(dx0), cp.asarray(dw0), cp.asarray(db0)
            gpucore.layernorm_backward(cp.asarray(dout), xg, wg, mean, rstd, dx=dx, dweight=dw, dbias=db,
                                       version=version)
            results.append([to_cpu(g) for g in (dx, dw, db)])
        for name, got, ref in zip(("dx", "dweight", "dbias"), results[0],
                                  (dx0.astype(np.float64) + rdx, dw0.astype(np.float64) + rdw,
                                   db0.astype(np.float64) + rdb)):
            got = got.astype(np.float64)
            assert not np.isnan(got).any(), f"v{version} {name} has NaN"
            assert rel_err(got, ref) < tol, f"v{version} {name}: rel err {rel_err(got, ref):.2e}"
        for name, g1, g2 in zip(("dx", "dweight", "dbias"), *results):
            assert g1.tobytes() == g2.tobytes(), f"v{version} {name} not deterministic"
        # the accumulation actually added the contributions (not overwrote)
        assert rel_err(results[0][1].astype(np.float64) - dw0.astype(np.float64), rdw) < 10 * tol


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_backward_fresh_buffers_and_fp32_param_grads(rng, dtype):
    cp = runtime.cupy
    rows, C = 200, 768
    x, w, b = _gpu_inputs(rng, rows, C, dtype)
    xg, wg = cp.asarray(x), cp.asarray(w)
    _, mean, rstd = gpucore.layernorm_forward(xg, wg, cp.asarray(b))
    dout = rng.standard_normal((rows, C)).astype(dtype)
    rdx, rdw, rdb = layernorm_backward_reference(dout, x, w, to_cpu(mean), to_cpu(rstd))
    dx, dw, db = gpucore.layernorm_backward(cp.asarray(dout), xg, wg, mean, rstd,
                                            dweight=cp.zeros(C, np.float32), dbias=cp.zeros(C, np.float32))
    assert dx.dtype == dtype and dw.dtype == np.float32 and db.dtype == np.float32
    assert rel_err(to_cpu(dx), rdx) < TOL[np.dtype(dtype)]
    assert rel_err(to_cpu(dw), rdw) < 1e-5
    assert rel_err(to_cpu(db), rdb) < 1e-5


@pytest.mark.cuda
def test_gpu_unaligned_views_take_v1(rng):
    cp = runtime.cupy
    rows, C = 10, 768
    flat = rng.standard_normal(rows * C + 1).astype(np.float32)
    xg = cp.asarray(flat)[1:].reshape(rows, C)        # 4 bytes off 16-byte alignment
    w, b = _params(rng, C, np.float32)
    out, mean, rstd = gpucore.layernorm_forward(xg, cp.asarray(w), cp.asarray(b))
    _check_forward(out, mean, rstd, flat[1:].reshape(rows, C), w, b, np.float32)
    with pytest.raises(ValueError, match="version: v2 needs"):
        gpucore.layernorm_forward(xg, cp.asarray(w), cp.asarray(b), version=2)
