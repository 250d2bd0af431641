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


def test_gemm_default_bf16_is_a_tensor_core_version():
    assert mm.GEMM_DEFAULT_BF16 in mm.TC_VERSIONS
    for v in mm.TC_VERSIONS:
        family, dt, (BM, BN), threads, smem = mm.GEMM_VERSIONS[v]
        assert dt == BF16 and smem <= 227 * 1024 and threads % 32 == 0, v


def test_lt_pick_keeps_the_heuristic_first_choice_unless_clearly_faster():
    assert mm._pick([1.0, 0.99, 1.2], margin=0.02) == 0        # 1% faster: not worth a different algorithm
    assert mm._pick([1.0, 0.97, 0.95], margin=0.02) == 2       # the fastest, when clearly faster
    assert mm._pick([1.0, 0.90, 0.90], margin=0.02) == 1       # ties: the earlier candidate
    assert mm._pick([0.5], margin=0.02) == 0


def test_lt_tune_cache_roundtrip(tmp_path, monkeypatch):
    """Choices persist across processes (the next process reads the file) and merge with other writers."""
    path = tmp_path / "sub" / "algos.json"
    monkeypatch.setattr(mm, "LT_TUNE_CACHE", path)
    monkeypatch.setattr(mm, "_TUNE_CACHE", None)
    mm._tune_cache_put("gpu|key1", "ab" * 64)
    path.write_text(path.read_text().replace("}", ', "gpu|other": "gemmex"}'))   # another process's entry
    mm._tune_cache_put("gpu|key2", mm.GEMMEX)
    monkeypatch.setattr(mm, "_TUNE_CACHE", None)                 # a fresh process
    cache = mm._tune_cache()
    assert cache == {"gpu|key1": "ab" * 64, "gpu|key2": "gemmex", "gpu|other": "gemmex"}


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


# ------------------------------------------------------------------ GPU ----

def _check_close(out, ref, dtype, what, tol=None):
    """rel error under the dtype's tolerance, no NaN; on failure name the first wrong (row, col)."""
    out = np.asarray(to_cpu(out), dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    tol = tol or TOL[np.dtype(dtype)]
    err = rel_err(out, ref)
    if not (err < tol) or np.isnan(out).any():
        o2, r2 = out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
        scale = np.abs(r2).max() if r2.size else 1.0
        bad = np.argwhere(~(np.abs(o2 - r2) <= 4 * tol * max(scale, 1e-30)))
        first = tuple(int(v) for v in bad[0]) if len(bad) else None
        detail = (f"first wrong (row, col) {first}: got {o2[first]}, want {r2[first]}; "
                  f"{len(bad)} of {o2.size} wrong" if first else "")
        raise AssertionError(f"{what}: rel err {err:.3e} (tol {tol:.0e}), NaN: {bool(np.isnan(out).any())}; {detail}")


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
def gemm_path(request, monkeypatch):
    """Run a training-path test through cuBLASLt (bias epilogue) and through the gemmEx fallback."""
    monkeypatch.setattr(mm, "USE_CUBLASLT", request.param == "cublaslt")
    return request.param


@pytest.mark.cuda
def test_gpu_cublaslt_is_used(rng):
    """The fast path must not silently fall back: Lt loads and has plans for the GPT-2 layer shapes."""
    cp = runtime.cupy
    x, w, b = (cp.asarray(_rand(rng, s, BF16)) for s in ((256, 768), (2304, 768), (2304,)))
    gpucore.matmul_forward(x, w, b)
    assert mm.LT_STATUS == "ok", mm.LT_STATUS
    out = cp.empty((256, 2304), BF16)
    assert mm._lt_gemm_rowmajor(x, w, out, 256, 2304, 768, transpose_b=True, bias=b), "no Lt algorithm"
    _check_close(out, mm.matmul_forward_reference(to_cpu(x), to_cpu(w), to_cpu(b), np.float64), BF16, "Lt")


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
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,M", [(1, 1), (5, 3), (256, 768), (257, 769), (4097, 2304), (70000, 24)])
def test_gpu_bias_backward_kernel(rng, dtype, N, M):
    """The two-stage column-sum kernel alone, both the 16-byte and the scalar path."""
    cp = runtime.cupy
    dout = _rand(rng, (N, M), dtype)
    db = cp.zeros(M, np.float32)
    mm._bias_backward(db, cp.asarray(dout))
    _check_close(db, dout.astype(np.float64).sum(0), np.float32, "dbias", tol=1e-5)
    db2 = cp.zeros(M, np.float32)
    mm._bias_backward(db2, cp.asarray(dout))
    assert to_cpu(db).tobytes() == to_cpu(db2).tobytes()


@pytest.mark.cuda
def test_gpu_dbias_side_stream_same_bits(rng):
    """Every DBIAS_STREAM placement (after the GEMMs; side stream first / last) gives the same bits,
    also when the caller works on a non-default stream and reads the results there at once."""
    cp = runtime.cupy
    N, K, M = 4097, 256, 768
    dout, x, w = (cp.asarray(_rand(rng, s, BF16)) for s in ((N, M), (N, K), (M, K)))
    db0 = _rand(rng, (M,), np.float32)
    ref = dout.astype(np.float32).sum(0).get().astype(np.float64) + db0
    default, results = mm.DBIAS_STREAM, {}
    try:
        for mode in ("", "first", "last"):
            mm.DBIAS_STREAM = mode
            for stream in (None, cp.cuda.Stream(non_blocking=True)):
                with stream or cp.cuda.get_current_stream():
                    db = cp.asarray(db0)
                    gpucore.matmul_backward(dout, x, w, dbias=db)
                    results[(mode, stream is None)] = db.get(stream=cp.cuda.get_current_stream()).tobytes()
    finally:
        mm.DBIAS_STREAM = default
    assert len(set(results.values())) == 1, sorted(k for k in results)
    _check_close(np.frombuffer(results[("", True)], np.float32), ref, np.float32, "dbias", tol=1e-5)


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


@pytest.mark.cuda
@pytest.mark.parametrize("in_dt,grad_dt", [(BF16, BF16), (BF16, np.float32), (np.float32, np.float32)])
@pytest.mark.parametrize("N,K,M", [(257, 96, 136), (1000, 768, 2304), (16384, 768, 768)])
def test_gpu_matmul_backward_fused_dbias(rng, monkeypatch, in_dt, grad_dt, N, K, M):
    """dbias from the dW GEMM's cuBLASLt BGRADB epilogue: taken for the bf16 layouts of training,
    right (dW and dbias), += kept, bitwise repeatable (the reduction order must not vary)."""
    cp = runtime.cupy
    monkeypatch.setattr(mm, "USE_CUBLASLT", True)
    monkeypatch.setattr(mm, "LT_BGRAD", True)
    dout, x = _rand(rng, (N, M), in_dt), _rand(rng, (N, K), in_dt)
    dw0, db0 = _rand(rng, (M, K), grad_dt), _rand(rng, (M,), grad_dt)
    g_dout, g_x = cp.asarray(dout), cp.asarray(x)
    dw, db = cp.asarray(dw0), cp.asarray(db0)
    scratch = mm._dweight_dbias_fused(db, g_dout, g_x, dw, M, K, N, 1.0)
    if in_dt == BF16:
        assert scratch is not None, f"cuBLASLt has no BGRADB algorithm for bf16 in, {np.dtype(grad_dt)} grads " \
                                    f"(LT_STATUS: {mm.LT_STATUS}); the dbias kernel would run instead"
    elif scratch is None:
        pytest.skip("no float32 BGRADB algorithm in this cuBLASLt: the dbias kernel covers it")
    d64 = dout.astype(np.float64)
    _check_close(dw, dw0.astype(np.float64) + d64.T @ x.astype(np.float64), grad_dt, f"dweight += ({scratch} scratch)")
    _check_close(db, db0.astype(np.float64) + d64.sum(0), grad_dt, f"dbias += ({scratch} scratch)")
    # bitwise repeatable, twice from the same state
    outs = []
    for _ in range(2):
        dw2, db2 = cp.asarray(dw0), cp.asarray(db0)
        assert mm._dweight_dbias_fused(db2, g_dout, g_x, dw2, M, K, N, 1.0) == scratch
        outs.append((to_cpu(dw2).tobytes(), to_cpu(db2).tobytes()))
    assert outs[0][0] == outs[1][0], "dweight (BGRADB GEMM) not deterministic"
    assert outs[0][1] == outs[1][1], "dbias from the BGRADB epilogue not deterministic"
    # and through the public API: same bits as the direct call
    w = cp.asarray(_rand(rng, (M, K), in_dt))
    dw3, db3 = cp.asarray(dw0), cp.asarray(db0)
    gpucore.matmul_backward(g_dout, g_x, w, dweight=dw3, dbias=db3, need_dx=False)
    assert to_cpu(db3).tobytes() == outs[0][1] and to_cpu(dw3).tobytes() == outs[0][0]


def _fresh_lt(monkeypatch, tmp_path):
    """cuBLASLt on, timing race on for every size, an empty plan cache and a private tune cache."""
    monkeypatch.setattr(mm, "USE_CUBLASLT", True)
    monkeypatch.setattr(mm, "LT_AUTOTUNE", True)
    monkeypatch.setattr(mm, "LT_BGRAD", True)
    monkeypatch.setattr(mm, "LT_AUTOTUNE_MIN_FLOPS", 0)
    monkeypatch.setattr(mm, "LT_TUNE_CACHE", tmp_path / "algos.json")
    monkeypatch.setattr(mm, "_TUNE_CACHE", None)
    lt = mm._lt()
    assert lt is not None, mm.LT_STATUS
    monkeypatch.setattr(lt, "plans", {})
    return lt


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["forward", "forward_bias", "dweight_dbias"])
def test_gpu_lt_every_candidate_algorithm(rng, monkeypatch, tmp_path, case):
    """The timing race runs, remembers its winner on disk, and every algorithm it may pick
    (each heuristic candidate, and gemmEx for epilogue-free GEMMs) is forced in turn and checked."""
    cp = runtime.cupy
    lt = _fresh_lt(monkeypatch, tmp_path)
    N, K, M = 300, 256, 136
    x, w, b = _rand(rng, (N, K), BF16), _rand(rng, (M, K), BF16, 0.05), _rand(rng, (M,), BF16)
    dout = _rand(rng, (N, M), BF16)
    gx, gw, gb, gd = (cp.asarray(a) for a in (x, w, b, dout))
    x64, d64 = x.astype(np.float64), dout.astype(np.float64)

    def run_and_check(label):
        if case == "dweight_dbias":
            dw, db = poison((M, K), np.float32), cp.zeros(M, np.float32)
            assert mm._dweight_dbias_fused(db, gd, gx, dw, M, K, N, 0.0) is not None, "no BGRADB plan"
            _check_close(dw, d64.T @ x64, np.float32, f"dweight, {label}", tol=1e-5)
            _check_close(db, d64.sum(0), np.float32, f"dbias, {label}", tol=1e-5)
        else:
            bias = gb if case == "forward_bias" else None
            out = poison((N, M), BF16)
            gpucore.matmul_forward(gx, gw, bias, out=out)
            _check_close(out, mm.matmul_forward_reference(x, w, b if bias is not None else None, np.float64),
                         BF16, f"matmul_forward, {label}")

    run_and_check("after the race")
    plans = [p for p in lt.plans.values() if p is not None]
    assert len(plans) == 1, f"expected one plan, got {len(plans)}"
    plan = plans[0]
    assert plan.choice is not None
    raced = len(plan.candidates) > 1 or case == "forward"       # gemmEx races epilogue-free GEMMs
    if raced:
        assert plan.times is not None and len(plan.times) == len(plan.candidates) + (case == "forward")
        assert len(mm._tune_cache()) == 1 and (tmp_path / "algos.json").is_file()
    choices = list(plan.candidates) + ([mm.GEMMEX] if case == "forward" else [])
    for c in choices:
        plan.choice = c
        run_and_check(f"algorithm {c} of {choices}")
    # A new process (empty plan and tune caches in memory) reads the winner from disk, times nothing.
    if raced:
        winner = mm._tune_cache()
        monkeypatch.setattr(lt, "plans", {})
        monkeypatch.setattr(mm, "_TUNE_CACHE", None)
        run_and_check("choice read from disk")
        plan2 = [p for p in lt.plans.values() if p is not None][0]
        assert plan2.times is None, "timed again instead of reading the tune cache"
        saved = list(winner.values())[0]
        assert (plan2.choice == mm.GEMMEX) if saved == mm.GEMMEX else (plan2.algo_hex(plan2.choice) == saved)


@pytest.mark.cuda
def test_gpu_lt_no_timing_during_graph_capture(rng, monkeypatch, tmp_path):
    """A plan first seen inside a CUDA-graph capture runs the heuristic's first choice untimed
    (events and synchronisation are illegal there) and is timed on the first call outside."""
    cp = runtime.cupy
    lt = _fresh_lt(monkeypatch, tmp_path)
    x, w = cp.asarray(_rand(rng, (256, 128), BF16)), cp.asarray(_rand(rng, (192, 128), BF16))
    b = cp.asarray(_rand(rng, (192,), BF16))
    out = cp.empty((256, 192), BF16)
    lt.device_state()                                   # handle + workspace exist before the capture
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        gpucore.matmul_forward(x, w, b, out=out)      # bias: an Lt-only GEMM, capturable
        graph = s.end_capture()
        graph.launch(stream=s)
        s.synchronize()
    plan = [p for p in lt.plans.values() if p is not None][0]
    assert plan.times is None
    _check_close(out, mm.matmul_forward_reference(to_cpu(x), to_cpu(w), to_cpu(b), np.float64), BF16, "captured")
    gpucore.matmul_forward(x, w, b, out=out)
    assert plan.choice is not None and (plan.times is not None or len(plan.candidates) == 1)


# --------------------------------------------------------- the GEMM ladder ---

SIMT_SHAPES = [(1, 1, 1), (7, 5, 3), (33, 17, 65), (128, 128, 128), (129, 257, 131), (300, 64, 1000),
               (512, 1024, 256)]
TC_SHAPES = [(1, 8, 8), (7, 16, 24), (129, 40, 136), (256, 256, 256), (300, 1000, 520), (128, 8, 128),
             (1024, 768, 2304),
             (65, 128, 264),       # K = 2 tiles of 64 = STAGES - 1 of v4b/v4c: the main loop loads nothing
             (1100, 200, 1288)]    # 9 block-rows: a second, ragged GROUP_M raster group; ragged K, N


def _skip_unless_supported(version):
    arch = mm._ARCH.get(version)
    if arch is not None and runtime.device_arch() != arch[:-1]:
        pytest.skip(f"gemm version {version} needs sm_{arch[:-1]}")


def _check_gemm(version, a, b, out_dtype):
    cp = runtime.cupy
    _skip_unless_supported(version)
    out = poison((a.shape[0], b.shape[1]), out_dtype)
    gpucore.gemm(cp.asarray(a), cp.asarray(b), out=out, version=version)
    _check_close(out, a.astype(np.float64) @ b.astype(np.float64), out_dtype,
                 f"gemm v{version} M,K,N={a.shape[0]},{a.shape[1]},{b.shape[1]}")


@pytest.mark.cuda
@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("M,K,N", SIMT_SHAPES)
def test_gpu_gemm_simt(rng, version, M, K, N):
    _check_gemm(version, _rand(rng, (M, K), np.float32), _rand(rng, (K, N), np.float32), np.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("version", [4, "4w", "4b", "4c", 5, 6])
@pytest.mark.parametrize("out_dtype", [np.float32, BF16])
@pytest.mark.parametrize("M,K,N", TC_SHAPES)
def test_gpu_gemm_tc(rng, version, out_dtype, M, K, N):
    _check_gemm(version, _rand(rng, (M, K), BF16), _rand(rng, (K, N), BF16), out_dtype)


def _assert_exact(out, want, what):
    bad = np.argwhere(out != want)
    assert len(bad) == 0, (f"{what}: {len(bad)} of {out.size} wrong, first (row, col) {tuple(bad[0])}: "
                           f"got {out[tuple(bad[0])]}, want {want[tuple(bad[0])]}")


@pytest.mark.cuda
@pytest.mark.parametrize("version", [1, 2, 3, 4, "4w", "4b", "4c", 5, 6])
def test_gpu_gemm_structured(version):
    """Identity-like and index-coded inputs (small integers: exact in bf16 and fp32),
    so a wrong fragment, swizzle or tile offset shows up as a named (row, col)."""
    cp = runtime.cupy
    _skip_unless_supported(version)
    dt = BF16 if version in mm.TC_VERSIONS else np.float32
    M, K, N = 200, 136, 264          # several tiles, ragged in M (and K, N for the 128-wide tiles)
    rows, cols = np.arange(M), np.arange(N)

    def run(a, b):
        out = poison((M, N), np.float32) if dt == BF16 else None
        return to_cpu(gpucore.gemm(cp.asarray(a.astype(dt)), cp.asarray(b.astype(dt)), out=out,
                                   version=version)).astype(np.float32)

    # A = stacked identities: C row r = B row (r % K)
    a = np.zeros((M, K), np.float32)
    a[rows, rows % K] = 1.0
    b = ((cols[None, :] % 97) - 48 + (np.arange(K)[:, None] % 7)).astype(np.float32)
    _assert_exact(run(a, b), b[rows % K], f"gemm v{version}, A = stacked identities")
    # B = ones at k == n % K: C column c = A column (c % K)
    a2 = ((rows[:, None] % 13) - 6 + (np.arange(K)[None, :] % 5)).astype(np.float32)
    b2 = np.zeros((K, N), np.float32)
    b2[cols % K, cols] = 1.0
    _assert_exact(run(a2, b2), a2[:, cols % K], f"gemm v{version}, B = identity columns")


@pytest.mark.cuda
def test_gpu_gemm_v4_rejects_ragged_k():
    cp = runtime.cupy
    a = cp.zeros((16, 12), dtype=BF16)
    with pytest.raises(ValueError, match="multiples of 8"):
        gpucore.gemm(a, cp.zeros((12, 16), dtype=BF16), version=4)
    with pytest.raises(TypeError, match="gemm version 3 takes float32"):
        gpucore.gemm(a, cp.zeros((12, 16), dtype=BF16), version=3)
