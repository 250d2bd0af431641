"""gpucore.softmax / softmax_backward: reference vs finite differences, GPU vs reference, bad input."""
import numpy as np
import pytest

import gpucore
from gpucore import runtime
from gpucore.ops.softmax import softmax_backward_reference, softmax_reference
from conftest import poison, rel_err, to_cpu
from gradcheck import assert_grad_close, numerical_grad

DTYPES = [np.float32, gpucore.bfloat16]


def _tol(dtype):
    return 1e-5 if dtype == np.float32 else 1e-2


# ------------------------------------------------------------------ CPU ----

def test_reference_values(rng):
    x = rng.standard_normal((3, 4, 9)) * 3
    y = softmax_reference(x)
    np.testing.assert_allclose(y.sum(-1), 1.0, rtol=1e-12)
    e = np.exp(x)
    np.testing.assert_allclose(y, e / e.sum(-1, keepdims=True), rtol=1e-12)
    # shift invariance / stability: huge logits do not overflow
    np.testing.assert_allclose(softmax_reference(x + 1000.0), y, rtol=1e-9)
    assert not np.isnan(softmax_reference(np.array([[1e30, -1e30, 0.0]]))).any()


def test_reference_backward_matches_finite_differences(rng):
    x = rng.standard_normal((3, 7))
    dout = rng.standard_normal((3, 7))
    numeric = numerical_grad(softmax_reference, x, dout)
    analytic = softmax_backward_reference(dout, softmax_reference(x))
    assert_grad_close(analytic, numeric, rtol=1e-6, name="dx")


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_numpy_path(rng, dtype):
    x = rng.standard_normal((2, 3, 10)).astype(dtype)
    y = gpucore.softmax(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_err(y, softmax_reference(x)) < _tol(dtype)
    dout = rng.standard_normal(x.shape).astype(dtype)
    dx = np.full(x.shape, 7.0, dtype=dtype)
    assert gpucore.softmax_backward(dout, y, dx=dx) is dx            # dx is overwritten (=), not +=
    assert rel_err(dx, softmax_backward_reference(dout, y)) < _tol(dtype)


def test_masked_row_is_finite():
    x = np.array([[0.0, -np.inf, 1.0, -np.inf]], np.float32)
    y = gpucore.softmax(x)
    assert np.isfinite(y).all() and y[0, 1] == 0 and y[0, 3] == 0


def test_softmax_bad_input(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    with pytest.raises(TypeError, match="x: dtype"):
        gpucore.softmax(x.astype(np.float64))
    with pytest.raises(TypeError, match="x: expected a NumPy or CuPy array"):
        gpucore.softmax([1.0, 2.0])
    with pytest.raises(ValueError, match="x: softmax needs at least one axis"):
        gpucore.softmax(np.array(1.0, np.float32))
    with pytest.raises(ValueError, match="x: softmax over an empty last axis"):
        gpucore.softmax(np.zeros((3, 0), np.float32))
    with pytest.raises(ValueError, match="x: array must be C-contiguous"):
        gpucore.softmax(np.ones((8, 4), np.float32).T)
    with pytest.raises(ValueError, match="out: expected shape"):
        gpucore.softmax(x, out=np.zeros((4, 7), np.float32))
    with pytest.raises(TypeError, match="out: dtype"):
        gpucore.softmax(x, out=np.zeros((4, 8), gpucore.bfloat16))
    with pytest.raises(ValueError, match="y: expected shape"):
        gpucore.softmax_backward(x, x[:, :4].copy())
    with pytest.raises(TypeError, match="y: dtype bfloat16 differs"):
        gpucore.softmax_backward(x, x.astype(gpucore.bfloat16))
    with pytest.raises(TypeError, match="dx: dtype"):
        gpucore.softmax_backward(x, x, dx=np.zeros((4, 8), np.float64))


# ------------------------------------------------------------------ GPU ----

SHAPES = [(1, 1), (3, 7), (5, 8), (64, 768), (33, 1024), (17, 1600), (2, 3, 100),
          (9, 2048), (5, 4096), (4, 50257), (3, 50304), (1000, 768)]


def _versions(shape, dtype):
    """Every version that applies: v1 always; v2 and v3 when C is whole packs and short enough."""
    C = shape[-1]
    P = 16 // np.dtype(dtype).itemsize
    return [1, 2, 3] if C % P == 0 and C // P <= 256 else [1]


CASES = [(s, d, ver) for s in SHAPES for d in DTYPES for ver in [None] + _versions(s, d)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_pick_version_agrees_with_the_shapes(dtype):
    """The public picker (what `gpucore bench softmax` enumerates versions with) accepts exactly the
    versions _versions expects, defaults to v3 where v2's layout applies (else v1), and gives v2/v3
    the smallest packs per lane K that holds the row."""
    from gpucore.bench import available_versions
    from gpucore.ops import softmax as sm
    P = 16 // np.dtype(dtype).itemsize
    for shape in SHAPES:
        C = shape[-1]
        assert available_versions(sm.pick_version, sm.VERSIONS, dtype, C, ()) == _versions(shape, dtype), shape
        version, K = sm.pick_version(None, dtype, C, ())
        assert version == (3 if 2 in _versions(shape, dtype) else 1), shape
        if version == 3:
            assert K in sm.V2_K and C // P <= 32 * K and (K == sm.V2_K[0] or C // P > 16 * K), shape
    with pytest.raises(ValueError, match="version: softmax has kernel versions 1, 2 and 3, got 4"):
        sm.pick_version(4, dtype, 768, ())
    with pytest.raises(ValueError, match="version: v2 needs C a multiple of"):
        sm.pick_version(2, dtype, 37, ())


@pytest.mark.cuda
@pytest.mark.parametrize("shape,dtype,version", CASES)
def test_gpu_forward_matches_reference(rng, shape, dtype, version):
    cp = runtime.cupy
    x = (rng.standard_normal(shape) * 4).astype(dtype)
    out = poison(shape, dtype)
    gpucore.softmax(cp.asarray(x), out=out, version=version)
    y = to_cpu(out)
    assert not np.isnan(y.astype(np.float32)).any(), "some output elements were not written"
    err = rel_err(y, softmax_reference(x))
    assert err < _tol(dtype), f"rel err {err:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("shape,dtype,version", CASES)
def test_gpu_backward_matches_reference_and_is_deterministic(rng, shape, dtype, version):
    cp = runtime.cupy
    y = softmax_reference((rng.standard_normal(shape) * 2)).astype(dtype)
    dout = rng.standard_normal(shape).astype(dtype)
    yg, dg = cp.asarray(y), cp.asarray(dout)
    dx = poison(shape, dtype)
    gpucore.softmax_backward(dg, yg, dx=dx, version=version)
    first = to_cpu(dx)
    assert not np.isnan(first.astype(np.float32)).any(), "some dx elements were not written"
    err = rel_err(first, softmax_backward_reference(dout, y))
    assert err < _tol(dtype), f"rel err {err:.2e}"
    again = to_cpu(gpucore.softmax_backward(dg, yg, version=version))
    assert again.tobytes() == first.tobytes(), "backward is not bitwise deterministic"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_in_place_and_aliasing(rng, dtype):
    cp = runtime.cupy
    for C in (768, 3000):                               # v2 and v1 paths
        x = rng.standard_normal((6, C)).astype(dtype)
        xg = cp.asarray(x)
        gpucore.softmax(xg, out=xg)                     # y overwrites x
        assert rel_err(to_cpu(xg), softmax_reference(x)) < _tol(dtype)
        y = to_cpu(xg)
        dout = rng.standard_normal((6, C)).astype(dtype)
        dg = cp.asarray(dout)
        gpucore.softmax_backward(dg, xg, dx=dg)         # dx overwrites dout
        assert rel_err(to_cpu(dg), softmax_backward_reference(dout, y)) < _tol(dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_unaligned_rows_use_v1(rng, dtype):
    cp = runtime.cupy
    x = rng.standard_normal(1 + 7 * 64).astype(dtype)
    xg = cp.asarray(x)[1:].reshape(7, 64)               # 2 or 4 bytes off 16-byte alignment
    assert xg.data.ptr % 16 != 0
    y = gpucore.softmax(xg)
    assert rel_err(to_cpu(y), softmax_reference(x[1:].reshape(7, 64))) < _tol(dtype)
    with pytest.raises(ValueError, match="version: v2 needs"):
        gpucore.softmax(xg, version=2)
    with pytest.raises(ValueError, match="version: v3 needs"):
        gpucore.softmax(xg, version=3)


@pytest.mark.cuda
def test_gpu_masked_and_large_values(rng):
    cp = runtime.cupy
    for C in (64, 5000):                                # v2 and v1
        x = rng.standard_normal((4, C)).astype(np.float32) * 30 + 1000
        x[:, ::3] = -np.inf                             # masked entries, as causal attention has
        x[1, : C - 40] = -np.inf                        # a long masked stretch: whole threads' shares in v1
        y = to_cpu(gpucore.softmax(cp.asarray(x)))
        assert np.isfinite(y).all()
        assert rel_err(y, softmax_reference(x)) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [64, 768, 1024])
def test_gpu_v3_matches_v2_and_propagates_nan_inf(rng, dtype, C):
    """v3 agrees with v2 on finite rows (same rounding; only the exp instruction differs), and a
    row holding NaN, +inf or only -inf comes out all NaN -- in bf16 with the NaN bits v2 writes
    (v3 switches to the exact conversion for such rows)."""
    cp = runtime.cupy
    x = (rng.standard_normal((12, C)) * 4).astype(np.float32)
    x[0, 5] = np.nan                                    # NaN anywhere: the whole row is NaN (numpy too)
    x[1, 7] = np.inf                                    # +inf: inf - inf = NaN, the whole row NaN
    x[2, :] = -np.inf                                   # all -inf: 0/0, the whole row NaN
    x[3, ::2] = -np.inf                                 # masked half: finite
    x = x.astype(dtype)
    xg = cp.asarray(x)
    y2 = to_cpu(gpucore.softmax(xg, version=2))
    y3 = to_cpu(gpucore.softmax(xg, version=3))
    with np.errstate(invalid="ignore"):
        ref = softmax_reference(x)
    for r in range(3):
        assert np.isnan(ref[r]).all() and np.isnan(y3[r].astype(np.float32)).all(), f"row {r} must be NaN"
        if dtype != np.float32:
            assert y3[r].tobytes() == y2[r].tobytes(), f"row {r}: NaN bits differ from v2's"
    assert np.isfinite(y3[3:].astype(np.float32)).all() and np.all(y3[3, ::2].astype(np.float32) == 0)
    assert rel_err(y3[3:], ref[3:]) < _tol(dtype)
    assert rel_err(y3[3:], y2[3:]) < (1e-6 if dtype == np.float32 else 1e-2)
