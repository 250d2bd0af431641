"""gpucore matmul family: the cuBLAS training path (linear layers) and batched / numpy-like matmul.

The cuBLAS binding itself (plans, autotune) is tests/test_cublas.py, the column sums
tests/test_colsum.py, our own GEMM kernels tests/ladder/test_gemm.py.

CPU: references against float64 NumPy / finite differences, argument checks.
GPU (pytest -m cuda): every path against the reference on fresh random data,
outputs poisoned with NaN first, odd shapes, structured inputs (identity,
one-hot) that make a wrong fragment/tile mapping print the first wrong (row, col).
"""
import numpy as np
import pytest

import gpucore
from gpucore import runtime, settings
from gpucore.ops import matmul as mm
from conftest import poison, rel_err, to_cpu
from matmul_checks import check_close as _check_close, rand as _rand
from gradcheck import assert_grad_close, numerical_grad

BF16 = gpucore.bfloat16
DTYPES = [np.float32, BF16]


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


# ------------------------------------------------------------------ GPU ----

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("Bt,M,K,N", [(1, 1, 1, 1), (3, 7, 5, 9), (12, 64, 64, 1024), (4, 257, 96, 130)])
def test_gpu_batched_matmul(rng, dtype, ta, tb, Bt, M, K, N):
    cp = runtime.cupy
    a = _rand(rng, (Bt, K, M) if ta else (Bt, M, K), dtype)
    b = _rand(rng, (Bt, N, K) if tb else (Bt, K, N), dtype)
    out = poison((Bt, M, N), dtype)
    gpucore.batched_matmul(cp.asarray(a), cp.asarray(b), out=out, transpose_a=ta, transpose_b=tb, alpha=0.125)
    ref = mm.batched_matmul_reference(a, b, None, ta, tb, 0.125, 0.0, np.float64)
    _check_close(out, ref, dtype, f"batched_matmul ta={ta} tb={tb}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_batched_matmul_beta_and_f32_out(rng, dtype):
    cp = runtime.cupy
    a, b = _rand(rng, (6, 33, 64), dtype), _rand(rng, (6, 64, 17), dtype)
    c0 = _rand(rng, (6, 33, 17), np.float32)
    out = cp.asarray(c0)                   # float32 out: allowed for both input dtypes
    gpucore.batched_matmul(cp.asarray(a), cp.asarray(b), out=out, alpha=2.0, beta=-1.0)
    ref = 2.0 * (a.astype(np.float64) @ b.astype(np.float64)) - c0
    _check_close(out, ref, np.float32, "batched_matmul beta=-1", tol=1e-5)   # fp32 out, exact bf16 products


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_batched_matmul_identity(dtype):
    """a = I: out must equal b exactly (catches a wrong layout/transpose at once)."""
    cp = runtime.cupy
    rng = np.random.default_rng(0)
    b = _rand(rng, (2, 16, 24), dtype)
    eye = np.broadcast_to(np.eye(16, dtype=np.float32), (2, 16, 16)).astype(dtype)
    out = gpucore.batched_matmul(cp.asarray(np.ascontiguousarray(eye)), cp.asarray(b))
    np.testing.assert_array_equal(to_cpu(out).astype(np.float32), b.astype(np.float32))
    outt = gpucore.batched_matmul(cp.asarray(np.ascontiguousarray(eye)), cp.asarray(np.ascontiguousarray(
        b.swapaxes(1, 2))), transpose_b=True)
    np.testing.assert_array_equal(to_cpu(outt).astype(np.float32), b.astype(np.float32))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_matmul_2d_3d(rng, dtype):
    cp = runtime.cupy
    a2, b2 = _rand(rng, (65, 40), dtype), _rand(rng, (40, 72), dtype)
    _check_close(gpucore.matmul(cp.asarray(a2), cp.asarray(b2)), a2.astype(np.float64) @ b2, dtype, "2-D")
    a3, b3 = _rand(rng, (3, 9, 40), dtype), _rand(rng, (3, 40, 11), dtype)
    _check_close(gpucore.matmul(cp.asarray(a3), cp.asarray(b3)), a3.astype(np.float64) @ b3, dtype, "3-D")
    _check_close(gpucore.matmul(cp.asarray(a3), cp.asarray(b2)), a3.astype(np.float64) @ b2, dtype, "3-D @ 2-D")


@pytest.fixture(params=["cublaslt", "gemmex"])
def gemm_path(request):
    """Run a training-path test through cuBLASLt (bias epilogue) and through the gemmEx fallback."""
    with settings.using(cublaslt=request.param == "cublaslt"):
        yield request.param


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,M", [(1, 1, 1), (7, 5, 3), (100, 96, 50), (513, 768, 2304), (64, 768, 50304)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_matmul_forward(rng, gemm_path, dtype, N, K, M, with_bias):
    cp = runtime.cupy
    x, w = _rand(rng, (N, K), dtype), _rand(rng, (M, K), dtype, 0.05)
    b = _rand(rng, (M,), dtype) if with_bias else None
    out = poison((N, M), dtype)
    gpucore.matmul_forward(cp.asarray(x), cp.asarray(w), None if b is None else cp.asarray(b), out=out)
    ref = mm.matmul_forward_reference(x, w, b, np.float64)
    _check_close(out, ref, dtype, f"matmul_forward bias={with_bias}")
    if dtype == np.float32:      # CUBLAS_COMPUTE_32F, not TF32: float32 agrees to ~1e-6
        assert rel_err(to_cpu(out), ref) < 5e-6


@pytest.mark.cuda
def test_gpu_matmul_forward_bf16_in_f32_out_and_leading_dims(rng, gemm_path):
    cp = runtime.cupy
    x, w, b = _rand(rng, (2, 33, 64), BF16), _rand(rng, (48, 64), BF16), _rand(rng, (48,), BF16)
    out = poison((2, 33, 48), np.float32)
    gpucore.matmul_forward(cp.asarray(x), cp.asarray(w), cp.asarray(b), out=out)
    _check_close(out, mm.matmul_forward_reference(x, w, b, np.float64), np.float32, "bf16->f32", tol=1e-5)
    b32 = b.astype(np.float32)
    gpucore.matmul_forward(cp.asarray(x), cp.asarray(w), cp.asarray(b32), out=out)
    _check_close(out, mm.matmul_forward_reference(x, w, b32, np.float64), np.float32, "f32 bias", tol=1e-5)


@pytest.mark.cuda
def test_gpu_matmul_forward_structured(gemm_path):
    """x = one-hot rows: out row r must be weight row (r % K) + bias, exactly."""
    cp = runtime.cupy
    rng = np.random.default_rng(1)
    N, K, M = 40, 16, 24
    x = np.zeros((N, K), np.float32)
    x[np.arange(N), np.arange(N) % K] = 1.0
    w, b = _rand(rng, (M, K), np.float32), _rand(rng, (M,), np.float32)
    out = to_cpu(gpucore.matmul_forward(cp.asarray(x), cp.asarray(w), cp.asarray(b)))
    want = w.T[np.arange(N) % K] + b
    bad = np.argwhere(out != want)
    assert len(bad) == 0, f"first wrong (row, col) {tuple(bad[0])}: got {out[tuple(bad[0])]}, want {want[tuple(bad[0])]}"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,M", [(1, 1, 1), (7, 5, 3), (300, 96, 50), (1000, 768, 2304), (257, 3072, 768),
                                   (16384, 768, 768)])    # the last: a long reduction (split-K in cuBLAS)
def test_gpu_matmul_backward(rng, gemm_path, dtype, N, K, M):
    cp = runtime.cupy
    dout, x, w = _rand(rng, (N, M), dtype), _rand(rng, (N, K), dtype), _rand(rng, (M, K), dtype)
    dw0, db0 = _rand(rng, (M, K), dtype), _rand(rng, (M,), dtype)
    dx = poison((N, K), dtype)
    dw, db = cp.asarray(dw0), cp.asarray(db0)
    args = (cp.asarray(dout), cp.asarray(x), cp.asarray(w))
    gpucore.matmul_backward(*args, dx=dx, dweight=dw, dbias=db)
    rdx, rdw, rdb = mm.matmul_backward_reference(dout, x, w)
    _check_close(dx, rdx, dtype, "dx")
    _check_close(dw, dw0.astype(np.float64) + rdw, dtype, "dweight (+=)")
    _check_close(db, db0.astype(np.float64) + rdb, dtype, "dbias (+=)")
    # deterministic: the same call again gives the same bits
    dx2, dw2, db2 = gpucore.matmul_backward(*args)
    dx3, dw3, db3 = gpucore.matmul_backward(*args)
    for p, q, name in ((dx2, dx3, "dx"), (dw2, dw3, "dweight"), (db2, db3, "dbias")):
        assert to_cpu(p).tobytes() == to_cpu(q).tobytes(), f"{name} not deterministic"
    _check_close(db2, rdb, dtype, "dbias fresh")
    _check_close(dw2, rdw, dtype, "dweight fresh")


@pytest.mark.cuda
def test_gpu_matmul_backward_bf16_with_f32_grads(rng, gemm_path):
    cp = runtime.cupy
    N, K, M = 1025, 64, 136
    dout, x, w = _rand(rng, (N, M), BF16), _rand(rng, (N, K), BF16), _rand(rng, (M, K), BF16)
    dw0, db0 = _rand(rng, (M, K), np.float32), _rand(rng, (M,), np.float32)
    dw, db = cp.asarray(dw0), cp.asarray(db0)
    dx, _, _ = gpucore.matmul_backward(cp.asarray(dout), cp.asarray(x), cp.asarray(w), dweight=dw, dbias=db,
                                       dx=poison((N, K), np.float32))
    rdx, rdw, rdb = mm.matmul_backward_reference(dout, x, w)
    _check_close(dx, rdx, np.float32, "dx f32", tol=1e-5)
    _check_close(dw, dw0 + rdw, np.float32, "dweight f32 +=", tol=1e-5)
    _check_close(db, db0 + rdb, np.float32, "dbias f32 +=", tol=1e-5)


@pytest.mark.cuda
def test_gpu_matmul_runs_on_current_stream(rng, gemm_path):
    cp = runtime.cupy
    x, w, b = _rand(rng, (512, 256), BF16), _rand(rng, (384, 256), BF16), _rand(rng, (384,), BF16)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        xg, wg, bg = cp.asarray(x), cp.asarray(w), cp.asarray(b)
        out = gpucore.matmul_forward(xg, wg, bg)
        res = out.get(stream=s)
    s.synchronize()
    _check_close(res, mm.matmul_forward_reference(x, w, b, np.float64), BF16, "on a side stream")




# ------------------------------------------- the residual in the GEMM (projections) ----

def test_matmul_forward_residual_reference(rng):
    """residual is added to the unrounded sum: one rounding, as the GEMM epilogue's C matrix."""
    x, w, b = _rand(rng, (6, 8), BF16), _rand(rng, (12, 8), BF16, 0.5), _rand(rng, (12,), BF16)
    res = _rand(rng, (6, 12), BF16, 4.0)
    out = gpucore.matmul_forward(x, w, b, residual=res)
    r = x.astype(np.float64) @ w.astype(np.float64).T + b.astype(np.float64) + res.astype(np.float64)
    np.testing.assert_array_equal(out, r.astype(BF16))
    acc = res.copy()                     # in place: out is the residual (+=)
    gpucore.matmul_forward(x, w, b, out=acc, residual=acc)
    np.testing.assert_array_equal(acc, out)


@pytest.mark.parametrize("arg", ["gelu_out", "residual"])
def test_matmul_forward_extra_arrays_bad_input(rng, arg):
    """gelu_out / residual: out's shape and dtype; neither may partly overlap out; not both."""
    x, w = _rand(rng, (4, 8), np.float32), _rand(rng, (6, 8), np.float32)
    out = np.empty((4, 6), np.float32)
    with pytest.raises(ValueError, match=arg):
        gpucore.matmul_forward(x, w, out=out, **{arg: np.empty((4, 5), np.float32)})
    with pytest.raises(TypeError, match=arg):
        gpucore.matmul_forward(x, w, out=out, **{arg: np.empty((4, 6), BF16)})
    big = np.zeros((5, 6), np.float32)
    with pytest.raises(ValueError, match="overlap"):
        gpucore.matmul_forward(x, w, out=big[:4], **{arg: big[1:]})
    with pytest.raises(ValueError, match="residual"):
        gpucore.matmul_forward(x, w, out=out, residual=np.empty((4, 6), np.float32), gelu_out=np.empty_like(out))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,M", [(7, 5, 3), (300, 96, 200), (4096, 768, 768), (1024, 3072, 768)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_matmul_forward_residual(rng, gemm_path, dtype, N, K, M, with_bias):
    """out = x @ w^T + b + residual through Lt's C matrix (and the gemmEx + add fallback), against
    the float64 reference, deterministic, C untouched; out as the residual itself (+=) too."""
    cp = runtime.cupy
    x, w = _rand(rng, (N, K), dtype), _rand(rng, (M, K), dtype, 0.05)
    b = _rand(rng, (M,), dtype) if with_bias else None
    res = _rand(rng, (N, M), dtype, 3.0)
    args = (cp.asarray(x), cp.asarray(w), None if b is None else cp.asarray(b))
    res_d, out = cp.asarray(res), poison((N, M), dtype)
    gpucore.matmul_forward(*args, out=out, residual=res_d)
    ref = mm.matmul_forward_reference(x, w, b, np.float64) + res.astype(np.float64)
    _check_close(out, ref, dtype, f"matmul_forward + residual ({gemm_path})")
    if dtype == np.float32:
        assert rel_err(to_cpu(out), ref) < 5e-6
    np.testing.assert_array_equal(to_cpu(res_d), res)            # C is read, never written
    again = poison((N, M), dtype)
    gpucore.matmul_forward(*args, out=again, residual=res_d)
    assert to_cpu(again).tobytes() == to_cpu(out).tobytes()
    gpucore.matmul_forward(*args, out=res_d, residual=res_d)     # in place (C = D: its own plan)
    _check_close(res_d, ref, dtype, f"matmul_forward, residual in place ({gemm_path})")


# --------------------------------------------------- GELU in the GEMM (the MLP) ----

from gpucore.ops.gelu import gelu_reference   # noqa: E402


def test_matmul_forward_gelu_out_reference(rng):
    """gelu_out = gelu of the unrounded sum (what the bf16 epilogue computes); out as without it."""
    x, w, b = _rand(rng, (6, 8), BF16), _rand(rng, (12, 8), BF16, 0.5), _rand(rng, (12,), BF16)
    g = np.empty((6, 12), BF16)
    out = gpucore.matmul_forward(x, w, b, gelu_out=g)
    r = x.astype(np.float64) @ w.astype(np.float64).T + b.astype(np.float64)
    np.testing.assert_array_equal(out, r.astype(BF16))
    np.testing.assert_array_equal(g, gelu_reference(r).astype(BF16))
    assert not np.array_equal(g.astype(np.float32), out.astype(np.float32))    # GELU applied


def test_matmul_gelu_out_may_not_be_out(rng):
    x, w = _rand(rng, (4, 8), np.float32), _rand(rng, (6, 8), np.float32)
    out = np.empty((4, 6), np.float32)
    with pytest.raises(ValueError, match="overlap"):
        gpucore.matmul_forward(x, w, out=out, gelu_out=out)


@pytest.fixture(params=["epilogue", "separate"])
def gelu_path(request):
    """The MLP's GELU through cuBLASLt's epilogue, and through the separate gelu kernel."""
    on = request.param == "epilogue"
    with settings.using(gelu_epilogue=on):
        yield request.param


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,M", [(7, 16, 24), (300, 96, 200), (1000, 768, 3072), (4096, 768, 3072)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_matmul_forward_gelu(rng, gelu_path, dtype, N, K, M, with_bias):
    cp = runtime.cupy
    x, w = _rand(rng, (N, K), dtype), _rand(rng, (M, K), dtype, 0.05)
    b = _rand(rng, (M,), dtype) if with_bias else None
    out, g = poison((N, M), dtype), poison((N, M), dtype)
    gpucore.matmul_forward(cp.asarray(x), cp.asarray(w), None if b is None else cp.asarray(b), out=out,
                           gelu_out=g)
    ref = mm.matmul_forward_reference(x, w, b, np.float64)
    _check_close(out, ref, dtype, f"pre-activation ({gelu_path})")
    _check_close(g, gelu_reference(ref), dtype, f"gelu_out ({gelu_path})")
    if dtype == np.float32:
        assert rel_err(to_cpu(g), gelu_reference(ref)) < 5e-6
    # deterministic
    g2 = poison((N, M), dtype)
    gpucore.matmul_forward(cp.asarray(x), cp.asarray(w), None if b is None else cp.asarray(b), out=out.copy(),
                           gelu_out=g2)
    assert to_cpu(g).tobytes() == to_cpu(g2).tobytes()


@pytest.mark.cuda
def test_gpu_gelu_epilogue_is_used_for_bf16():
    """The bf16 fc shape gets an Lt plan with the GELU epilogue (not the fallback)."""
    from gpucore import cublas
    cp = runtime.cupy
    rng = np.random.default_rng(3)
    N, K, M = 2048, 768, 3072
    x, w, b = (cp.asarray(_rand(rng, s, BF16)) for s in ((N, K), (M, K), (M,)))
    out, g = cp.empty((N, M), BF16), cp.empty((N, M), BF16)
    with settings.using(gelu_epilogue=True):
        gpucore.matmul_forward(x, w, b, out=out, gelu_out=g)
    assert cublas.plan_choice(N, M, K, transpose_b=True, bias=True, gelu=True) not in ("-", "?", "gemmEx")
