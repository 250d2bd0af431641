"""gpucore.gelu / gelu_backward: reference vs finite differences, GPU vs reference, bad input.

gelu_backward(..., dbias=) (the next matmul's bias gradient fused): the reference against a float64
column sum of the rounded dx; on the GPU, dx bit for bit as without dbias, dbias bit for bit as a
NumPy float32 emulation of the kernel's fixed summation order (and within an honest float32 bound of
the float64 sum), determinism, dx aliasing dout, and the fallback layouts.

gelu_backward(..., gelu_out=) (the GELU output remade by the backward's pass, keep_gelu off):
gelu_out bit for bit gelu(x)'s and dx bit for bit as without it, on the CPU and on the GPU (both
kernels, the element-wise edges, dx aliasing dout), and its bad input.
"""
import numpy as np
import pytest

import gpucore
from gpucore import runtime
from gpucore.ops.colsum import stage2_order_sum
from gpucore.ops.gelu import DBIAS_WARPS, dbias_rows_per_chunk, gelu_backward_reference, gelu_reference
from conftest import poison, rel_err, to_cpu
from gradcheck import assert_grad_close, numerical_grad

DTYPES = [np.float32, gpucore.bfloat16]
TOL = {np.dtype(np.float32): 1e-5, np.dtype(gpucore.bfloat16): 1e-2}


def test_gelu_reference_values():
    # Published values of the tanh approximation (GPT-2's) at 0 and +-1, its
    # limits, and a scalar math.tanh evaluation elsewhere.
    import math
    x = np.array([0.0, 1.0, -1.0, 10.0, -10.0, 3.0, -3.0, 0.3])
    scalar = [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))) for v in x[5:]]
    expected = np.array([0.0, 0.8411919906082768, -0.15880800939172324, 10.0, 0.0, *scalar])
    np.testing.assert_allclose(gelu_reference(x), expected, rtol=1e-12, atol=1e-12)


def test_gelu_backward_reference_matches_finite_differences(rng):
    x = rng.standard_normal((3, 7)) * 3
    probe = rng.standard_normal((3, 7))
    numeric = numerical_grad(gelu_reference, x, probe)
    assert_grad_close(gelu_backward_reference(probe, x), numeric, rtol=1e-7, name="dx")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_public_cpu(rng, dtype):
    x = (rng.standard_normal((4, 9)) * 2).astype(dtype)
    out = gpucore.gelu(x)
    assert out.dtype == dtype and out.shape == x.shape
    np.testing.assert_array_equal(out.astype(np.float64), gelu_reference(x).astype(dtype).astype(np.float64))
    dout = rng.standard_normal((4, 9)).astype(dtype)
    dx = gpucore.gelu_backward(dout, x)
    np.testing.assert_array_equal(dx.astype(np.float64),
                                  gelu_backward_reference(dout, x).astype(dtype).astype(np.float64))
    # dx may alias dout
    expected = dx.copy()
    assert gpucore.gelu_backward(dout, x, dx=dout) is dout
    np.testing.assert_array_equal(dout.astype(np.float64), expected.astype(np.float64))


def test_gelu_bad_input(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    with pytest.raises(TypeError, match="x: dtype"):
        gpucore.gelu(x.astype(np.float64))
    with pytest.raises(ValueError, match="x: array must be C-contiguous"):
        gpucore.gelu(x.T)
    with pytest.raises(ValueError, match="out: expected shape"):
        gpucore.gelu(x, out=np.empty((4, 7), np.float32))
    with pytest.raises(TypeError, match="out: dtype"):
        gpucore.gelu(x, out=np.empty((4, 8), gpucore.bfloat16))
    with pytest.raises(ValueError, match="x: expected shape"):
        gpucore.gelu_backward(x, x[:, :4].copy())
    with pytest.raises(TypeError, match="x: dtype bfloat16 differs"):
        gpucore.gelu_backward(x, x.astype(gpucore.bfloat16))
    with pytest.raises(TypeError, match="dout: expected a NumPy or CuPy array"):
        gpucore.gelu_backward([1.0], x)
    with pytest.raises(ValueError, match="dx: expected shape"):
        gpucore.gelu_backward(x, x, dx=np.empty(32, np.float32))


# ---- dbias: the column sums of dx fused (reference path) ----

def _colsum_ref(dx, start):
    """start + float64 column sums of dx as stored (rows = all leading dims), rounded once."""
    C = dx.shape[-1]
    return (start.astype(np.float64) + dx.astype(np.float64).reshape(-1, C).sum(axis=0)).astype(start.dtype)


@pytest.mark.parametrize("dtype,dbias_dtype", [(np.float32, np.float32), (gpucore.bfloat16, np.float32),
                                               (gpucore.bfloat16, gpucore.bfloat16)])
@pytest.mark.parametrize("shape", [(1, 8), (37, 24), (130, 12), (2, 5, 7), (9,)])
def test_gelu_backward_dbias_cpu(rng, dtype, dbias_dtype, shape):
    x = (rng.standard_normal(shape) * 2).astype(dtype)
    dout = rng.standard_normal(shape).astype(dtype)
    start = rng.standard_normal(shape[-1]).astype(dbias_dtype)     # += onto a non-zero start
    dbias = start.copy()
    dx = gpucore.gelu_backward(dout, x, dbias=dbias)
    # dx is exactly what gelu_backward gives without dbias
    plain = gpucore.gelu_backward(dout, x)
    assert dx.tobytes() == plain.tobytes()
    expected = _colsum_ref(dx, start)
    assert dbias.dtype == dbias_dtype
    np.testing.assert_array_equal(dbias.astype(np.float64), expected.astype(np.float64))
    assert not np.array_equal(dbias.astype(np.float64), start.astype(np.float64))
    # a second call adds again (+=); dx may alias dout
    again = dbias.copy()
    d_alias = dout.copy()
    assert gpucore.gelu_backward(d_alias, x, dx=d_alias, dbias=again) is d_alias
    assert d_alias.tobytes() == dx.tobytes()
    np.testing.assert_array_equal(again.astype(np.float64), _colsum_ref(dx, dbias).astype(np.float64))


def test_gelu_backward_dbias_cpu_sums_rounded_dx(rng):
    # bf16: dbias is the sum of dx AS STORED, not of the float64 gelu' * dout before rounding
    x = (rng.standard_normal((400, 3)) * 2).astype(gpucore.bfloat16)
    dout = rng.standard_normal((400, 3)).astype(gpucore.bfloat16)
    dbias = np.zeros(3, np.float32)
    dx = gpucore.gelu_backward(dout, x, dbias=dbias)
    exact = dx.astype(np.float64).sum(axis=0)
    unrounded = gelu_backward_reference(dout, x).sum(axis=0)
    np.testing.assert_array_equal(dbias, exact.astype(np.float32))
    assert not np.array_equal(exact.astype(np.float32), unrounded.astype(np.float32))


def test_gelu_backward_dbias_cpu_empty(rng):
    dbias = np.arange(8, dtype=np.float32)
    gpucore.gelu_backward(np.empty((0, 8), np.float32), np.empty((0, 8), np.float32), dbias=dbias)
    np.testing.assert_array_equal(dbias, np.arange(8, dtype=np.float32))   # += nothing
    empty = np.empty(0, np.float32)
    gpucore.gelu_backward(np.empty((4, 0), np.float32), np.empty((4, 0), np.float32), dbias=empty)


def test_gelu_backward_dbias_bad_input(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    xb = x.astype(gpucore.bfloat16)
    dx = np.full((4, 8), 7.0, np.float32)
    bad = [
        (TypeError, "dbias: dtype must be float32, got float64", x, np.zeros(8)),
        (TypeError, "dbias: dtype must be float32, got bfloat16", x, np.zeros(8, gpucore.bfloat16)),
        (TypeError, "dbias: dtype must be float32 or bfloat16, got float16", xb, np.zeros(8, np.float16)),
        (ValueError, "dbias: expected shape \\(8,\\)", x, np.zeros(7, np.float32)),
        (ValueError, "dbias: expected 1 dimensions", x, np.zeros((1, 8), np.float32)),
        (ValueError, "dbias: array must be C-contiguous", x, np.zeros(16, np.float32)[::2]),
        (TypeError, "dbias: expected a NumPy or CuPy array", x, [0.0] * 8),
        (ValueError, "dbias: needs dout with at least one dimension", np.ones((), np.float32), np.zeros(1, np.float32)),
    ]
    for exc, msg, d, dbias in bad:
        out = dx.copy() if d.shape == dx.shape and d.dtype == dx.dtype else None
        with pytest.raises(exc, match=msg):
            gpucore.gelu_backward(d, d, dx=out, dbias=dbias)
        if out is not None:                       # validated before anything is written
            assert (out == 7.0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_dbias", [False, True])
def test_gelu_backward_gelu_out_cpu(rng, dtype, with_dbias):
    """gelu_out gets gelu(x)'s bits; dx and dbias are what they are without it; dx may alias dout."""
    x = (rng.standard_normal((37, 24)) * 3).astype(dtype)
    dout = rng.standard_normal((37, 24)).astype(dtype)
    db0 = np.full(24, 0.25, np.float32) if with_dbias else None
    plain = gpucore.gelu_backward(dout, x, dbias=None if db0 is None else db0.copy())
    want_db = None
    if with_dbias:
        want_db = db0.copy()
        gpucore.gelu_backward(dout, x, dbias=want_db)
    g = np.full((37, 24), 7, dtype)
    d_alias = dout.copy()
    db = None if db0 is None else db0.copy()
    assert gpucore.gelu_backward(d_alias, x, dx=d_alias, dbias=db, gelu_out=g) is d_alias
    assert g.tobytes() == gpucore.gelu(x).tobytes()
    assert d_alias.tobytes() == plain.tobytes()
    if with_dbias:
        assert db.tobytes() == want_db.tobytes()


def test_gelu_backward_gelu_out_bad_input(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    dout = rng.standard_normal((4, 8)).astype(np.float32)
    dx = np.zeros((4, 8), np.float32)
    bad = [
        (ValueError, "gelu_out: expected shape \\(4, 8\\)", np.zeros((4, 7), np.float32), dx),
        (TypeError, "gelu_out: dtype must be float32, got bfloat16", np.zeros((4, 8), gpucore.bfloat16), dx),
        (ValueError, "gelu_out: must not overlap x", x, dx),
        (ValueError, "gelu_out: must not overlap dout", dout, None),
        (ValueError, "gelu_out: must not overlap dx", dx, dx),
    ]
    for exc, msg, g, out in bad:
        before = dout.copy()
        with pytest.raises(exc, match=msg):
            gpucore.gelu_backward(dout, x, dx=out, gelu_out=g)
        assert np.array_equal(dout, before)       # refused before anything is written


def test_dbias_rows_per_chunk():
    # a function of N alone; 128 rows (16 per thread) until the grid's y limit forces more
    assert dbias_rows_per_chunk(1) == 128 and dbias_rows_per_chunk(65536) == 128
    assert dbias_rows_per_chunk(128 * 65535) == 128
    for N in (128 * 65535 + 1, 10**8, 2**31 - 1):
        rows = dbias_rows_per_chunk(N)
        assert rows % (DBIAS_WARPS * 4) == 0 and -(-N // rows) <= 65535


# ------------------------------------------------------------------ GPU ------

SIZES = [1, 7, 1000, 4096 + 3, 65536 * 3 + 5, 8 * 3072, 1 << 20]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_gelu_gpu_forward(rng, dtype, n):
    cp = runtime.cupy
    x = (rng.standard_normal(n) * 3).astype(dtype)
    out = poison(n, dtype)
    gpucore.gelu(cp.asarray(x), out=out)
    got = to_cpu(out).astype(np.float64)
    assert not np.isnan(got).any()
    assert rel_err(got, gelu_reference(x)) < TOL[np.dtype(dtype)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_gelu_gpu_backward(rng, dtype, n):
    cp = runtime.cupy
    x = (rng.standard_normal(n) * 3).astype(dtype)
    dout = rng.standard_normal(n).astype(dtype)
    dx = poison(n, dtype)
    gpucore.gelu_backward(cp.asarray(dout), cp.asarray(x), dx=dx)
    got = to_cpu(dx).astype(np.float64)
    assert not np.isnan(got).any()
    assert rel_err(got, gelu_backward_reference(dout, x)) < TOL[np.dtype(dtype)]
    # deterministic, and dx may alias dout (the in-place form gives the same bits)
    dout_g = cp.asarray(dout)
    again = gpucore.gelu_backward(dout_g, cp.asarray(x))
    assert to_cpu(again).tobytes() == to_cpu(dx).tobytes()
    gpucore.gelu_backward(dout_g, cp.asarray(x), dx=dout_g)
    assert to_cpu(dout_g).tobytes() == to_cpu(dx).tobytes()


@pytest.mark.cuda
@pytest.mark.parametrize("rows,C", [(5, 768), (33, 1024), (7, 1600), (3, 4 * 768)])
def test_gelu_gpu_shapes_and_inplace(rng, rows, C):
    cp = runtime.cupy
    x = (rng.standard_normal((rows, C)) * 2).astype(np.float32)
    xg = cp.asarray(x)
    gpucore.gelu(xg, out=xg)                      # in place
    assert rel_err(to_cpu(xg), gelu_reference(x)) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_gpu_unaligned_and_extremes(rng, dtype):
    cp = runtime.cupy
    x = (rng.standard_normal(1001) * 4).astype(dtype)
    x[:6] = [0.0, -20.0, 20.0, -9.5, 50.0, -1e4]
    xg = cp.asarray(x)
    out = gpucore.gelu(xg[1:])                    # offset by one element: the element-by-element path
    got = to_cpu(out).astype(np.float64)
    ref = gelu_reference(x[1:])
    assert not np.isnan(got).any()
    assert rel_err(got, ref) < TOL[np.dtype(dtype)]
    dout = rng.standard_normal(1001).astype(dtype)
    dx = gpucore.gelu_backward(cp.asarray(dout)[1:], xg[1:])
    got = to_cpu(dx).astype(np.float64)
    assert not np.isnan(got).any()
    assert rel_err(got, gelu_backward_reference(dout[1:], x[1:])) < TOL[np.dtype(dtype)]


@pytest.mark.cuda
def test_gelu_gpu_float32_tail_accuracy():
    """The negative tail (gelu ~ 1e-12..1e-4) stays within float32's 1e-5 per element.

    Regression: a GPU test once failed at x = -6.27 (1.25e-5) because the
    reference's 0.5 x (1 + tanh u) cancels in float64; the reference now uses
    the sigmoid form. The float32 kernel's error is bounded by float32's
    evaluation of u, about 5.5e-6 down to x = -8 (NumPy emulation).
    """
    cp = runtime.cupy
    x = np.linspace(-8.0, -4.0, 40001).astype(np.float32)
    got = to_cpu(gpucore.gelu(cp.asarray(x))).astype(np.float64)
    ref = gelu_reference(x)
    assert np.max(np.abs(got - ref) / np.abs(ref)) < 1e-5


# ---- dbias fused (GPU) ----

def _dbias_emulated(dx32, start, rows, warps=DBIAS_WARPS):
    """The kernel's exact float32 order: thread (warp w) of a chunk sums rows w, w + warps, ... in
    order; the warps' sums are added in warp order into one partial per (chunk, column); stage 2
    adds the chunks in its order (colsum.stage2_order_sum) to dbias (float32), rounded once to
    dbias's dtype. NumPy float32 adds
    are IEEE round-to-nearest like __fadd_rn, so this is bit-exact. Rows past N are zeros: x + 0 = x."""
    N, C = dx32.shape
    chunks = -(-N // rows)
    padded = np.zeros((chunks * rows, C), np.float32)
    padded[:N] = dx32
    d = padded.reshape(chunks, rows // warps, warps, C)
    acc = np.zeros((chunks, warps, C), np.float32)
    for i in range(rows // warps):
        acc += d[:, i]
    part = np.zeros((chunks, C), np.float32)
    for w in range(warps):
        part += acc[:, w]
    return (start.astype(np.float32) + stage2_order_sum(part)).astype(start.dtype)


def _check_dbias_gpu(dx_cpu, start, got, *, exact_order):
    """got (dbias after the call) vs float64: per column, float32 summation error <= 2e-5 of
    sum |terms| (the longest sequential chain is the stage-2 sum over chunks: 512 at 65536 rows,
    random-walk error ~1e-6); a bf16 dbias adds its one rounding, 2^-8 of the value. Then, on the
    fused path, bit-exactly the emulated order."""
    C = dx_cpu.shape[-1]
    d64 = dx_cpu.astype(np.float64).reshape(-1, C)
    start64 = start.astype(np.float64)
    ref = start64 + d64.sum(axis=0)
    scale = np.abs(start64) + np.abs(d64).sum(axis=0)
    got64 = got.astype(np.float64)
    assert not np.isnan(got64).any()
    tol = 2e-5 * scale + (2.0 ** -8 * np.abs(ref) if got.dtype == gpucore.bfloat16 else 0.0) + 1e-30
    worst = np.max(np.abs(got64 - ref) / tol)
    assert worst <= 1.0, f"dbias off the float64 column sum by {worst:.3g} x the tolerance"
    if exact_order:
        emu = _dbias_emulated(dx_cpu.astype(np.float32).reshape(-1, C), start, dbias_rows_per_chunk(d64.shape[0]))
        mism = np.flatnonzero(emu.astype(np.float64) != got64)
        assert got.tobytes() == emu.tobytes(), f"dbias differs from the emulated order in columns {mism[:10]}"


DBIAS_CASES = [(np.float32, np.float32), (gpucore.bfloat16, np.float32), (gpucore.bfloat16, gpucore.bfloat16)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,dbias_dtype", DBIAS_CASES)
@pytest.mark.parametrize("shape", [(1, 8), (37, 24), (1000, 776), (129, 3072), (300, 768), (2, 3, 40),
                                   (4, 5000, 16), (0, 8)])
def test_gelu_gpu_backward_dbias(rng, dtype, dbias_dtype, shape):
    cp = runtime.cupy
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    dout = rng.standard_normal(shape).astype(dtype)
    start = rng.standard_normal(shape[-1]).astype(dbias_dtype)
    xg, doutg = cp.asarray(x), cp.asarray(dout)
    plain = to_cpu(gpucore.gelu_backward(doutg, xg))
    dx = poison(shape, dtype)
    dbias = cp.asarray(start)
    assert gpucore.gelu_backward(doutg, xg, dx=dx, dbias=dbias) is dx
    dx_cpu = to_cpu(dx)
    assert dx_cpu.tobytes() == plain.tobytes(), "dx differs from gelu_backward without dbias"
    got = to_cpu(dbias)
    _check_dbias_gpu(dx_cpu, start, got, exact_order=True)
    # deterministic: the same input gives the same bits
    again = cp.asarray(start)
    gpucore.gelu_backward(doutg, xg, dbias=again)
    assert to_cpu(again).tobytes() == got.tobytes()
    # dx may alias dout: same dx, same dbias
    alias = cp.asarray(start)
    gpucore.gelu_backward(doutg, xg, dx=doutg, dbias=alias)
    assert to_cpu(doutg).tobytes() == plain.tobytes()
    assert to_cpu(alias).tobytes() == got.tobytes()
    # inputs untouched by the non-aliased calls
    assert to_cpu(xg).tobytes() == x.tobytes()


@pytest.mark.cuda
@pytest.mark.parametrize("dbias_dtype", [np.float32, gpucore.bfloat16])
def test_gelu_gpu_backward_dbias_gpt2_shape(dbias_dtype):
    """(65536, 3072) bf16: GPT-2 124M's dfch at B*T = 65536 (512 chunks: the longest stage-2 chain)."""
    cp = runtime.cupy
    N, C = 65536, 3072
    xg = (cp.random.standard_normal((N, C), dtype=np.float32) * 3).astype(gpucore.bfloat16)
    doutg = (cp.random.standard_normal((N, C), dtype=np.float32) * 1e-3).astype(gpucore.bfloat16)
    start = (np.random.default_rng().standard_normal(C) * 1e-2).astype(dbias_dtype)
    plain = to_cpu(gpucore.gelu_backward(doutg, xg)).tobytes()
    dx = poison((N, C), gpucore.bfloat16)
    dbias = cp.asarray(start)
    gpucore.gelu_backward(doutg, xg, dx=dx, dbias=dbias)
    dx_cpu = to_cpu(dx)
    assert dx_cpu.tobytes() == plain, "dx differs from gelu_backward without dbias"
    got = to_cpu(dbias)
    _check_dbias_gpu(dx_cpu, start, got, exact_order=True)
    again = cp.asarray(start)
    gpucore.gelu_backward(doutg, xg, dx=doutg, dbias=again)       # aliased, deterministic
    assert to_cpu(again).tobytes() == got.tobytes()
    assert to_cpu(doutg).tobytes() == plain


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["C_not_pack", "misaligned"])
def test_gelu_gpu_backward_dbias_fallback(rng, dtype, case):
    """Layouts the 16-byte kernel cannot take: gelu_backward + matmul's column sum."""
    cp = runtime.cupy
    rows, C = (301, 770) if case == "C_not_pack" else (257, 768)
    n = rows * C
    x = (rng.standard_normal(n + 1) * 3).astype(dtype)
    dout = rng.standard_normal(n + 1).astype(dtype)
    start = rng.standard_normal(C).astype(np.float32)
    off = 0 if case == "C_not_pack" else 1                 # one element in: not 16-byte aligned
    xg = cp.asarray(x)[off:off + n].reshape(rows, C)
    doutg = cp.asarray(dout)[off:off + n].reshape(rows, C)
    assert case == "C_not_pack" or xg.data.ptr % 16
    plain = to_cpu(gpucore.gelu_backward(doutg, xg))
    dbias = cp.asarray(start)
    dx = gpucore.gelu_backward(doutg, xg, dbias=dbias)
    dx_cpu = to_cpu(dx)
    assert dx_cpu.tobytes() == plain.tobytes()
    assert rel_err(dx_cpu, gelu_backward_reference(to_cpu(doutg), to_cpu(xg))) < TOL[np.dtype(dtype)]
    got = to_cpu(dbias)
    _check_dbias_gpu(dx_cpu, start, got, exact_order=False)
    again = cp.asarray(start)
    gpucore.gelu_backward(doutg, xg, dx=doutg, dbias=again)
    assert to_cpu(again).tobytes() == got.tobytes()
    assert to_cpu(doutg).tobytes() == plain.tobytes()


@pytest.mark.cuda
def test_gelu_gpu_backward_dbias_bad_device(rng):
    cp = runtime.cupy
    x = cp.asarray(rng.standard_normal((4, 8)).astype(np.float32))
    with pytest.raises(TypeError, match="dbias: must live on the same device"):
        gpucore.gelu_backward(x, x, dbias=np.zeros(8, np.float32))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1000,), (65536 * 3 + 5,), (64, 3072), (130, 1600), (3, 5)])
@pytest.mark.parametrize("with_dbias", [False, True])
def test_gpu_gelu_backward_gelu_out_bitwise(rng, dtype, shape, with_dbias):
    """GPU: gelu_out is gelu(x)'s bits and dx (in place over dout) gelu_backward's, dbias the same
    sums, through the plain kernel (its element-wise edge too) and the column-sum kernel (its
    fallback for C % pack != 0 as well)."""
    cp = runtime.cupy
    x = cp.asarray((rng.standard_normal(shape) * 3).astype(dtype))
    dout = cp.asarray(rng.standard_normal(shape).astype(dtype))
    C = shape[-1]
    db_want = cp.full(C, 0.25, np.float32) if with_dbias else None
    dx_want = gpucore.gelu_backward(dout, x, dbias=db_want)
    g = poison(int(np.prod(shape)), dtype).reshape(shape)
    db = cp.full(C, 0.25, np.float32) if with_dbias else None
    d = dout.copy()
    gpucore.gelu_backward(d, x, dx=d, dbias=db, gelu_out=g)
    assert to_cpu(g).tobytes() == to_cpu(gpucore.gelu(x)).tobytes()
    assert to_cpu(d).tobytes() == to_cpu(dx_want).tobytes()
    if with_dbias:
        assert to_cpu(db).tobytes() == to_cpu(db_want).tobytes()
