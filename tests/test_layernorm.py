"""gpucore layernorm_forward / layernorm_backward / fused_residual_layernorm_forward:
reference vs float64 finite differences, GPU (v1 and v2) vs reference, determinism, bad input.
layernorm_backward's dx_colsum (column sums of the final dx, as stored): the CPU reference, and on
the GPU dx/dweight/dbias bits unchanged by it, v2's column sums bit-exact against a NumPy float32
emulation of the kernels' summation order, every path within an fp32 bound of the float64 sum."""
import numpy as np
import pytest

import gpucore
from gpucore import dtypes, runtime
from gpucore.ops.colsum import stage2_order_sum
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("colsum_dtype", ["float32", "dout"])
def test_public_cpu_dx_colsum(rng, dtype, colsum_dtype):
    """dx_colsum += column sums of the FINAL dx as stored (old dx values included), rows not a
    multiple of anything; dx/dweight/dbias exactly as without it."""
    cdt = np.float32 if colsum_dtype == "float32" else dtype
    shape, C = (3, 7, 24), 24                                   # 21 rows
    x = (rng.standard_normal(shape) * 2 + 0.3).astype(dtype)
    w, b = (p.astype(dtype) for p in _params(rng, C))
    _, mean, rstd = gpucore.layernorm_forward(x, w, b)
    dout = rng.standard_normal(shape).astype(dtype)
    dx0 = (3 * rng.standard_normal(shape)).astype(dtype)      # non-zero: must be in the sum
    c0 = rng.standard_normal(C).astype(cdt)
    plain = gpucore.layernorm_backward(dout, x, w, mean, rstd, dx=dx0.copy())
    colsum = c0.copy()
    dx, dw, db = gpucore.layernorm_backward(dout, x, w, mean, rstd, dx=dx0.copy(), dx_colsum=colsum)
    for name, g1, g2 in zip(("dx", "dweight", "dbias"), plain, (dx, dw, db)):
        assert g1.tobytes() == g2.tobytes(), f"{name} changed by dx_colsum"
    assert colsum.dtype == cdt
    ref = (c0.astype(np.float64) + dx.reshape(-1, C).astype(np.float64).sum(0)).astype(cdt)
    np.testing.assert_array_equal(colsum.astype(np.float64), ref.astype(np.float64))
    # the old dx matters: the colsum differs from that of the contribution alone
    contrib = (dx.astype(np.float64) - dx0.astype(np.float64)).reshape(-1, C).sum(0)
    assert np.abs(colsum.astype(np.float64) - c0.astype(np.float64) - contrib).max() > 0.1
    # += : a second call adds the (again updated) dx's column sums
    dx2 = gpucore.layernorm_backward(dout, x, w, mean, rstd, dx=dx, dx_colsum=colsum)[0]
    ref2 = (ref.astype(np.float64) + dx2.reshape(-1, C).astype(np.float64).sum(0)).astype(cdt)
    np.testing.assert_array_equal(colsum.astype(np.float64), ref2.astype(np.float64))


def test_bad_dx_colsum(rng):
    x = rng.standard_normal((5, 8)).astype(np.float32)
    w, b = (p.astype(np.float32) for p in _params(rng, 8))
    _, mean, rstd = gpucore.layernorm_forward(x, w, b)
    dx = np.ones((5, 8), np.float32)
    bad = [(TypeError, "dx_colsum: dtype", np.zeros(8, np.float64)),
           (TypeError, "dx_colsum: dtype", np.zeros(8, gpucore.bfloat16)),   # float32 dout: float32 only
           (ValueError, "dx_colsum: expected shape", np.zeros(7, np.float32)),
           (ValueError, "dx_colsum: expected shape", np.zeros((1, 8), np.float32)),
           (ValueError, "dx_colsum: array must be C-contiguous", np.zeros(16, np.float32)[::2]),
           (TypeError, "dx_colsum: expected a NumPy or CuPy array", [0.0] * 8)]
    for exc, msg, colsum in bad:
        with pytest.raises(exc, match=msg):
            gpucore.layernorm_backward(x, x, w, mean, rstd, dx=dx, dx_colsum=colsum)
    np.testing.assert_array_equal(dx, 1.0)                    # validated before anything was written
    xb = x.astype(gpucore.bfloat16)
    with pytest.raises(TypeError, match="dx_colsum: dtype must be float32 or bfloat16, got float64"):
        gpucore.layernorm_backward(xb, xb, w.astype(gpucore.bfloat16), mean, rstd,
                                   dx_colsum=np.zeros(8, np.float64))


def _colsum_emulated(dx32, grid, c0, out_dtype, warps=4):
    """NumPy float32 emulation of v2's dx column sum, in the kernels' exact order: lane sums over the
    rows of warp w of block b (rows k * grid * warps + b * warps + w, in k order), the block's warps
    summed in warp order, then stage 2's order over the blocks' partials (colsum.stage2_order_sum);
    dx_colsum = round(c0 + sum). Padding rows are +0.0, which leaves a sum
    that started at +0.0 unchanged bit for bit."""
    rows, C = dx32.shape
    K = -(-rows // (grid * warps))
    padded = np.zeros((K * grid * warps, C), np.float32)
    padded[:rows] = dx32
    per_row = padded.reshape(K, grid, warps, C)
    lane = np.zeros((grid, warps, C), np.float32)
    for k in range(K):
        lane += per_row[k]
    block = np.zeros((grid, C), np.float32)
    for w in range(warps):
        block += lane[:, w]
    total = stage2_order_sum(block)
    return (np.asarray(c0).astype(np.float32) + total).astype(out_dtype)


def _colsum_bound(dx64, c0_64, out_dtype):
    """Per column |got - float64 sum| bound for an fp32 blocked sum of up to a few hundred terms deep
    (2e-5 of the sum of magnitudes) plus the final rounding to out_dtype (one ulp of the result)."""
    ref = c0_64 + dx64.sum(0)
    ulp = 2.0 ** -7 if np.dtype(out_dtype) == np.dtype(gpucore.bfloat16) else 2.0 ** -23
    return ref, 2e-5 * (np.abs(c0_64) + np.abs(dx64).sum(0)) + ulp * np.abs(ref) + 1e-30


@pytest.mark.parametrize("rows,grid", [(1, 1), (7, 2), (301, 5), (4099, 13)])
def test_colsum_emulation_within_bound(rng, rows, grid):
    """The emulation the GPU test holds the kernel to is itself within the fp32 bound."""
    dx = (3 * rng.standard_normal((rows, 40))).astype(np.float32)
    c0 = rng.standard_normal(40).astype(np.float32)
    for out in (np.float32, gpucore.bfloat16):
        got = _colsum_emulated(dx, grid, c0.astype(out), out).astype(np.float64)
        ref, bound = _colsum_bound(dx.astype(np.float64), c0.astype(out).astype(np.float64), out)
        assert (np.abs(got - ref) <= bound).all()
    # the order is really blocked: a different grid gives a different rounding somewhere
    big = (rng.standard_normal((4099, 256)) * 100).astype(np.float32)
    assert _colsum_emulated(big, 13, np.zeros(256, np.float32), np.float32).tobytes() != \
        _colsum_emulated(big, 7, np.zeros(256, np.float32), np.float32).tobytes()


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


@pytest.mark.parametrize("dtype", DTYPES)
def test_pick_version_agrees_with_the_shapes(dtype):
    """The public picker (what `gpucore bench layernorm` enumerates versions with) accepts exactly
    the versions _versions expects, defaults to v2 where it applies, and gives v2 the smallest
    packs per lane N that holds the row."""
    from gpucore.bench import available_versions
    from gpucore.ops import layernorm as ln
    P = 16 // np.dtype(dtype).itemsize
    for _, C in SHAPES:
        assert available_versions(ln.pick_version, ln.VERSIONS, dtype, C, ()) == _versions(C, dtype), C
        version, N = ln.pick_version(None, dtype, C, ())
        assert version == max(_versions(C, dtype)), C
        if version == 2:
            assert N in ln.V2_N and 32 * (N - 1) < C // P <= 32 * N, C
        else:
            assert N is None
    with pytest.raises(ValueError, match="version: layernorm has kernel versions 1 and 2, got 3"):
        ln.pick_version(3, dtype, 768, ())


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_split_by_row_length(dtype):
    """The v2 backward gives a row to 2 warps exactly where one warp would need SPLIT_MIN_N or more
    packs per lane; each warp's N then holds its half (the first half the larger), and is one of
    the instantiated _s2 kernels' (1..4)."""
    from gpucore.ops import layernorm as ln
    P = 16 // np.dtype(dtype).itemsize
    for _, C in SHAPES:
        if 2 not in _versions(C, dtype):
            continue
        n1 = -(-(C // P) // 32)
        for force in (None, 1, 2):
            S, N = ln.backward_split(dtype, C, force)
            assert S == (force or (2 if n1 >= ln.SPLIT_MIN_N else 1)), (C, force)
            half = -(-(C // P) // S)
            assert 32 * (N - 1) < half <= 32 * N, (C, force)
            assert N <= (8 if S == 1 else 4)
    assert ln.backward_split(gpucore.bfloat16, 768) == (1, 3)          # d12: one warp a row
    assert ln.backward_split(gpucore.bfloat16, 1600) == (2, 4)         # d48: 2 warps, 100 packs each
    with pytest.raises(ValueError, match="warps_per_row: 1 or 2, got 3"):
        ln.backward_split(dtype, 768, 3)
    x = np.ones((2, 8), dtype)
    with pytest.raises(ValueError, match="warps_per_row: 1 or 2, got 0"):   # on any backend, before work
        gpucore.layernorm_backward(x, x, x[0], np.zeros(2, np.float32), np.ones(2, np.float32), warps_per_row=0)


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
    # v2 with 1 and 2 warps a row (layernorm.cu's S; the default picks by C)
    for version, wpr in [(v, w) for v in _versions(C, dtype) for w in ((None,) if v == 1 else (1, 2))]:
        results = []
        for _ in range(2):                              # twice: must be bitwise identical
            dx, dw, db = cp.asarray(dx0), cp.asarray(dw0), cp.asarray(db0)
            gpucore.layernorm_backward(cp.asarray(dout), xg, wg, mean, rstd, dx=dx, dweight=dw, dbias=db,
                                       version=version, warps_per_row=wpr)
            results.append([to_cpu(g) for g in (dx, dw, db)])
        version = f"{version} ({wpr} warps a row)" if wpr else version
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


def _bf16_bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.cuda
def test_gpu_v2_nan_rows_keep_the_reference_nan_bits(rng):
    """v2 rounds with cvt.rn.bf16x2, whose NaN is 0x7fff; a row holding a NaN takes the exact rounding,
    so the residual, the output and dx carry float_to_bf16's NaN (0x7fc0, arithmetic's canonical NaN
    rounded) and every other row's bits are those of a finite run."""
    cp = runtime.cupy
    bf = gpucore.bfloat16
    rows, C = 64, 768
    a, w, b = _gpu_inputs(rng, rows, C, bf)
    a2 = rng.standard_normal((rows, C)).astype(bf)
    a2_nan = a2.copy()
    a2_nan[5, 17] = np.nan
    runs = []
    for second in (a2, a2_nan):
        residual, out = poison((rows, C), bf), poison((rows, C), bf)
        _, _, mean, rstd = gpucore.fused_residual_layernorm_forward(
            cp.asarray(a), cp.asarray(second), cp.asarray(w), cp.asarray(b), residual=residual, out=out, version=2)
        runs.append((to_cpu(residual), to_cpu(out)))
    (res_ok, out_ok), (res_nan, out_nan) = runs
    assert _bf16_bits(res_nan)[5, 17] == 0x7fc0
    keep = np.ones((rows, C), bool)
    keep[5, 17] = False
    assert np.array_equal(_bf16_bits(res_nan)[keep], _bf16_bits(res_ok)[keep])
    assert (_bf16_bits(out_nan)[5] == 0x7fc0).all()
    others = np.arange(rows) != 5
    assert np.array_equal(_bf16_bits(out_nan)[others], _bf16_bits(out_ok)[others])

    xg, wg = cp.asarray(a), cp.asarray(w)
    _, mean, rstd = gpucore.layernorm_forward(xg, wg, cp.asarray(b))
    dout = rng.standard_normal((rows, C)).astype(bf)
    dout_nan = dout.copy()
    dout_nan[9, 100] = np.nan
    dx0 = rng.standard_normal((rows, C)).astype(bf)
    dxs = []
    for g in (dout, dout_nan):
        dx = cp.asarray(dx0)
        gpucore.layernorm_backward(cp.asarray(g), xg, wg, mean, rstd, dx=dx, dweight=cp.zeros(C, np.float32),
                                   dbias=cp.zeros(C, np.float32), version=2)
        dxs.append(to_cpu(dx))
    assert (_bf16_bits(dxs[1])[9] == 0x7fc0).all()
    others = np.arange(rows) != 9
    assert np.array_equal(_bf16_bits(dxs[1])[others], _bf16_bits(dxs[0])[others])
    assert not np.isnan(dxs[0].astype(np.float32)).any()


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


# dx_colsum: GPT-2 widths (C=1600 float32 takes v1) plus a v1-only width (770) and GPT-2 124M's
# full (B*T, C) = (65536, 768) in bf16; rows not multiples of the 4 rows per block. Cases are
# (dtype, rows, C, dx_colsum dtype, dweight/dbias dtype): the grads share one dtype (as in the
# model) except at 4099 x 768, which also takes the mixed pairs (stage 2's four instantiations).
def _colsum_cases():
    cases = []
    for d in DTYPES:
        types = list(dict.fromkeys([np.dtype(np.float32), np.dtype(d)]))
        for rows, C in [(7, 768), (4099, 768), (301, 1024), (257, 1600), (37, 770)]:
            for cd in types:
                cases += [(d, rows, C, cd, pd) for pd in (types if (rows, C) == (4099, 768) else [cd])]
    bf = np.dtype(gpucore.bfloat16)
    return cases + [(gpucore.bfloat16, 65536, 768, bf, bf),
                    (gpucore.bfloat16, 65536, 768, np.dtype(np.float32), np.dtype(np.float32))]


COLSUM_CASES = _colsum_cases()


def _colsum_id(case):
    d, rows, C, cd, pd = case
    return f"{np.dtype(d).name}-{rows}x{C}-colsum_{cd.name}-dweight_{pd.name}"


@pytest.mark.cuda
@pytest.mark.parametrize("case", COLSUM_CASES, ids=_colsum_id)
def test_gpu_backward_dx_colsum(rng, case):
    """dx/dweight/dbias bits as without dx_colsum; dx_colsum = c0 + column sums of the returned
    dx (v2: bit-exact vs the emulated order; every version: within the fp32 bound of float64);
    deterministic."""
    from gpucore.ops import layernorm as ln
    cp = runtime.cupy
    dtype, rows, C, cdt, pdt = case
    x, w, b = _gpu_inputs(rng, rows, C, dtype)
    xg, wg, bg = cp.asarray(x), cp.asarray(w), cp.asarray(b)
    _, mean, rstd = gpucore.layernorm_forward(xg, wg, bg)
    doutg = cp.asarray(rng.standard_normal((rows, C)).astype(dtype))
    dx0 = (3 * rng.standard_normal((rows, C))).astype(dtype)   # non-zero: part of the column sums
    dw0, db0 = rng.standard_normal(C).astype(pdt), rng.standard_normal(C).astype(pdt)
    c0 = rng.standard_normal(C).astype(cdt)
    for version, wpr in [(v, w) for v in _versions(C, dtype) for w in ((None,) if v == 1 else (1, 2))]:
        def run(with_colsum):
            dx, dw, db = cp.asarray(dx0), cp.asarray(dw0), cp.asarray(db0)
            colsum = cp.asarray(c0) if with_colsum else None
            gpucore.layernorm_backward(doutg, xg, wg, mean, rstd, dx=dx, dweight=dw, dbias=db, version=version,
                                       dx_colsum=colsum, warps_per_row=wpr)
            return [to_cpu(g) for g in (dx, dw, db)] + ([to_cpu(colsum)] if with_colsum else [])
        plain, fused, again = run(False), run(True), run(True)
        for name, g1, g2 in zip(("dx", "dweight", "dbias"), plain, fused):
            assert g1.tobytes() == g2.tobytes(), f"v{version} {name}: bits changed by dx_colsum"
        for name, g1, g2 in zip(("dx", "dweight", "dbias", "dx_colsum"), fused, again):
            assert g1.tobytes() == g2.tobytes(), f"v{version} {name} not deterministic with dx_colsum"
        dx, colsum = fused[0], fused[3]
        assert colsum.dtype == cdt
        got = colsum.astype(np.float64)
        assert not np.isnan(got).any(), f"v{version} dx_colsum has NaN"
        ref, bound = _colsum_bound(dx.astype(np.float64), c0.astype(np.float64), cdt)
        worst = int(np.argmax(np.abs(got - ref) - bound))
        assert (np.abs(got - ref) <= bound).all(), (
            f"v{version} dx_colsum column {worst}: {got[worst]!r} vs {ref[worst]!r} (bound {bound[worst]:.2e})")
        assert rel_err(got, ref) < (1e-5 if cdt == np.float32 else 1e-2)
        if version == 2:
            # S warps a row: WARPS / S rows in flight per block, each column summed over them in order
            S, N = ln.backward_split(dtype, C, wpr)
            plain_kernel = runtime.get_kernel("layernorm", f"layernorm_backward_kernel_v2_n{N}"
                                                           f"{'_s2' if S == 2 else ''}_{dtypes.kernel_suffix(dtype)}")
            rpb = ln.WARPS // S
            grid = min(runtime.sm_count() * ln._resident_blocks(plain_kernel, ln.BLOCK), -(-rows // rpb))
            emu = _colsum_emulated(dx.astype(np.float32), grid, c0, cdt, warps=rpb)
            diff = np.flatnonzero(emu.astype(np.float64) != got)
            assert diff.size == 0, (f"v2 dx_colsum differs from the emulated order in {diff.size} columns, "
                                    f"first {diff[0]}: {got[diff[0]]!r} vs {emu[diff[0]]!r} (grid {grid})")


@pytest.mark.cuda
def test_gpu_dx_colsum_fresh_dx_and_bad_device(rng):
    """dx=None (zeros, then +=): dx_colsum = column sums of the contribution; a host dx_colsum with
    device inputs is refused before any launch."""
    cp = runtime.cupy
    rows, C = 513, 768
    x, w, b = _gpu_inputs(rng, rows, C, gpucore.bfloat16)
    xg, wg = cp.asarray(x), cp.asarray(w)
    _, mean, rstd = gpucore.layernorm_forward(xg, wg, cp.asarray(b))
    dout = cp.asarray(rng.standard_normal((rows, C)).astype(gpucore.bfloat16))
    colsum = cp.zeros(C, np.float32)
    dx = gpucore.layernorm_backward(dout, xg, wg, mean, rstd, dx_colsum=colsum)[0]
    ref, bound = _colsum_bound(to_cpu(dx).astype(np.float64), np.zeros(C), np.float32)
    assert (np.abs(to_cpu(colsum) - ref) <= bound).all()
    dx_before = to_cpu(dx)
    with pytest.raises(TypeError, match="dx_colsum: must live on the same device"):
        gpucore.layernorm_backward(dout, xg, wg, mean, rstd, dx=dx, dx_colsum=np.zeros(C, np.float32))
    assert to_cpu(dx).tobytes() == dx_before.tobytes()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_colsum_kernels_keep_the_plain_occupancy(dtype):
    """The colsum kernels run at the plain kernels' grid (for identical dweight/dbias bits); with
    fewer blocks per SM they would run a second, mostly idle wave. If this fails after a compiler
    change, raise colsum_min_blocks in layernorm.cu for that N (the message names it)."""
    from gpucore.ops import layernorm as ln
    suf = dtypes.kernel_suffix(dtype)
    for tag in [f"n{N}" for N in ln.V2_N] + [f"n{N}_s2" for N in range(1, 5)]:   # 1 and 2 warps a row
        plain = runtime.get_kernel("layernorm", f"layernorm_backward_kernel_v2_{tag}_{suf}")
        colsum = runtime.get_kernel("layernorm", f"layernorm_backward_colsum_kernel_v2_{tag}_{suf}")
        N = tag
        a_p, a_c = runtime.kernel_attributes(plain), runtime.kernel_attributes(colsum)
        assert a_c["local_bytes"] == 0, f"N={N} {suf}: colsum kernel spills: {a_c}"
        assert ln._resident_blocks(colsum, ln.BLOCK) >= ln._resident_blocks(plain, ln.BLOCK), (
            f"N={N} {suf}: colsum kernel {a_c} vs plain {a_p}")


# ------------------------------------------------- FP8 forward (--dtype fp8) ---

from gpucore.ops.fp8 import fp8_quantize                               # noqa: E402
from gpucore.ops.layernorm import (fused_residual_layernorm_forward, layernorm_forward,   # noqa: E402
                                   layernorm_forward_fp8)


def _fp8_ln_both(xp, x, b, w, bias, scale):
    """layernorm_forward_fp8 against the bf16 layernorm then fp8_quantize: the results of both as host
    arrays (out8, out8_t, amax, mean, rstd, residual)."""
    R, C = x.shape
    res = []
    for fused in (True, False):
        o8, o8t = xp.full((R, C), 0xAB, np.uint8), xp.full((C, R), 0xAB, np.uint8)
        amax, mean, rstd = xp.zeros(1, np.float32), xp.zeros(R, np.float32), xp.zeros(R, np.float32)
        resid = xp.zeros((R, C), x.dtype) if b is not None else None
        if fused:
            layernorm_forward_fp8(x, w, bias, scale, b=b, residual=resid, out8=o8, out8_t=o8t, amax=amax,
                                  mean=mean, rstd=rstd)
        else:
            if b is None:
                out = layernorm_forward(x, w, bias, mean=mean, rstd=rstd)[0]
            else:
                out = fused_residual_layernorm_forward(x, b, w, bias, residual=resid, mean=mean, rstd=rstd)[1]
            fp8_quantize(out, "e4m3", scale, out=o8, out_t=o8t, amax=amax)
        res.append([to_cpu(a) for a in (o8, o8t, amax, mean, rstd)] + ([to_cpu(resid)] if b is not None else []))
    return res


def _fp8_ln_inputs(rng, xp, R, C):
    x = (rng.standard_normal((R, C)) * 3 + 1).astype(gpucore.bfloat16)
    b = rng.standard_normal((R, C)).astype(gpucore.bfloat16)
    w, bias = _params(rng, C, gpucore.bfloat16)
    return [xp.asarray(a) for a in (x, b, w, bias)]


@pytest.mark.parametrize("fused_residual", [False, True])
def test_fp8_forward_reference_is_layernorm_then_cast(rng, fused_residual):
    """NumPy: the FP8 forward is the bf16 layernorm then fp8_quantize, bit for bit; gate 0 writes nothing."""
    x, b, w, bias = _fp8_ln_inputs(rng, np, 48, 32)
    scale = np.array([40.0], np.float32)
    got, want = _fp8_ln_both(np, x, b if fused_residual else None, w, bias, scale)
    for g, wnt in zip(got, want):
        assert np.array_equal(g, wnt)
    o8 = np.zeros((48, 32), np.uint8)
    layernorm_forward_fp8(x, w, bias, scale, out8=o8, gate=np.zeros(1, np.float32))
    assert not o8.any()
    with pytest.raises(ValueError, match="at least one"):
        layernorm_forward_fp8(x, w, bias, scale)
    with pytest.raises(TypeError, match="bfloat16"):
        layernorm_forward_fp8(x.astype(np.float32), w.astype(np.float32), bias.astype(np.float32), scale, out8=o8)


def test_fp8_forward_blocks_fit_their_shared_memory():
    """Every C the FP8 forward takes gets a block size whose shared memory (the E4M3 tile, then the
    weight and bias) fits an SM: two blocks where it says 64 rows (so two share an SM), one at 32."""
    from gpucore.ops.layernorm import (BLOCK_RESERVED_BYTES, SM_SHARED_BYTES, fp8_block_rows,
                                       fp8_forward_fits, fp8_smem_bytes)
    assert fp8_smem_bytes(768, 64) == 64 * (768 + 4) + 4 * 768
    for C in range(8, 2049, 8):
        assert fp8_forward_fits(C)
        for residual in (False, True):
            rows = fp8_block_rows(C, residual)
            need = fp8_smem_bytes(C, rows) + BLOCK_RESERVED_BYTES
            assert need <= SM_SHARED_BYTES, (C, residual, rows)
            if rows == 64 and not residual:
                assert 2 * need <= SM_SHARED_BYTES, C
    assert fp8_block_rows(768) == 64 and fp8_block_rows(1600) == 64 and fp8_block_rows(2048) == 32


@pytest.mark.cuda
@pytest.mark.parametrize("fused_residual", [False, True])
@pytest.mark.parametrize("R,C", [(64, 768), (80, 64), (1040, 1600), (4096, 768), (128, 2048), (80, 1024), (48, 1040)])
def test_gpu_fp8_forward_bitwise(rng, fused_residual, R, C):
    """GPU: the FP8 forward's bytes (both orientations), amax, mean, rstd and residual equal the v2
    layernorm followed by fp8_quantize bit for bit (the same row math; blocks of 64 rows up to C = 1690
    plain and C = 1024 residual, of 32 above (fp8_block_rows), partial at 80 and 1040 rows; the weight
    and bias read from shared memory); the gated
    re-run writes only on a nonzero gate."""
    from gpucore.ops.fp8 import fp8_supported
    ok, why = fp8_supported()
    assert ok, why                  # the cuda marker says there is a GPU; our test GPUs are Hopper
    cp = runtime.cupy
    x, b, w, bias = _fp8_ln_inputs(rng, cp, R, C)
    scale = cp.asarray([40.0], np.float32)
    got, want = _fp8_ln_both(cp, x, b if fused_residual else None, w, bias, scale)
    names = ["out8", "out8_t", "amax", "mean", "rstd", "residual"]
    for name, g, wnt in zip(names, got, want):
        bad = np.argwhere(g != wnt)
        assert len(bad) == 0, f"{name}: {len(bad)} differ, first at {tuple(bad[0])}"
    o8 = cp.zeros((R, C), np.uint8)
    layernorm_forward_fp8(x, w, bias, scale, out8=o8, gate=cp.zeros(1, np.float32))
    assert not bool(o8.any())
    if not fused_residual:
        layernorm_forward_fp8(x, w, bias, scale, out8=o8, gate=cp.ones(1, np.float32))
        assert np.array_equal(to_cpu(o8), got[0])
