"""gpucore fp8 family: scaled E4M3/E5M2 casts, amax, the scaling state, the FP8 GEMM.

CPU: the reference's rounding and saturation against ml_dtypes element by element (every
finite bf16 value in a range, ties, the largest values, NaN), the transposed output, amax,
the delayed / current scaling rules, the GEMM reference against a float64 matmul.
GPU (pytest -m cuda, sm_89+): the casts bit for bit against the reference on fresh random
inputs of several shapes (poisoned outputs), amax exact, the FP8 GEMM against the reference
of the same FP8 bytes (fp32 accumulation: ~1e-6 relative before the bf16 rounding of out).
"""
import ml_dtypes
import numpy as np
import pytest

from gpucore import runtime, settings
from gpucore.dtypes import bfloat16
from gpucore.ops.fp8 import (FORMATS, Fp8Scaling, fp8_amax, fp8_dequantize, fp8_gelu_backward, fp8_matmul_reference,
                             fp8_gelu_backward_gated, fp8_gelu_quantize, fp8_matmul, fp8_quantize, fp8_quantize_reference,
                             fp8_transpose)
from gpucore.ops.colsum import stage2_order_sum
from gpucore.ops.gelu import gelu_backward
from conftest import rel_err, to_cpu

F32 = np.float32


def _bf16(rng, shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(bfloat16)


# ------------------------------------------------------------------ CPU ----

@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_reference_rounds_to_nearest_even_and_saturates(fmt):
    t, fmax = FORMATS[fmt]
    # every positive finite value of the format, the midpoints between neighbours (ties), a bit above
    grid = np.arange(256, dtype=np.uint8).view(t).astype(np.float64)
    grid = np.unique(grid[np.isfinite(grid) & (grid >= 0)])
    mids = (grid[:-1] + grid[1:]) / 2
    x = np.concatenate([grid, mids, mids * (1 + 1e-3), -mids, [fmax * 1.01, fmax * 100, -fmax * 3, 1e30]])
    q = fp8_quantize_reference(x.astype(F32), fmt, 1.0)
    back = fp8_dequantize(q, fmt)
    assert np.array_equal(back[: len(grid)], grid.astype(F32))                 # exact values stay
    # ties go to the neighbour with an even mantissa (its last bit 0)
    tie_bits = q[len(grid): len(grid) + len(mids)]
    assert np.all(tie_bits % 2 == 0)
    assert np.all(np.abs(back[len(grid) + len(mids): len(grid) + 2 * len(mids)]) >= mids)   # just above: up
    assert np.array_equal(back[-4:], np.array([fmax, fmax, -fmax, fmax], F32))          # saturated
    assert np.isnan(fp8_dequantize(fp8_quantize_reference(np.array([np.nan], F32), fmt, 1.0), fmt)).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_reference_scale_applies_in_float32(rng, fmt):
    x = _bf16(rng, (32, 48), 1e-3)
    s = 1234.5
    want = np.clip(x.astype(F32) * F32(s), -FORMATS[fmt][1], FORMATS[fmt][1]).astype(FORMATS[fmt][0])
    assert np.array_equal(fp8_quantize_reference(x, fmt, s), want.view(np.uint8))


def test_quantize_numpy_outputs_and_amax(rng):
    x = _bf16(rng, (16, 32), 3.0)
    out, out_t = np.zeros((16, 32), np.uint8), np.zeros((32, 16), np.uint8)
    amax = np.array([0.5], F32)
    fp8_quantize(x, "e4m3", np.array([2.0], F32), out=out, out_t=out_t, amax=amax)
    assert np.array_equal(out, fp8_quantize_reference(x, "e4m3", 2.0))
    assert np.array_equal(out_t, out.T)
    assert amax[0] == np.abs(x.astype(F32)).max()
    fp8_amax(x * 0, amax)                       # max with what is there
    assert amax[0] == np.abs(x.astype(F32)).max()


def test_bad_input(rng):
    x = _bf16(rng, (16, 32))
    s = np.ones(1, F32)
    with pytest.raises(ValueError, match="fmt"):
        fp8_quantize(x, "e3m4", s, out=np.zeros((16, 32), np.uint8))
    with pytest.raises(TypeError, match="x: dtype"):
        fp8_quantize(x.astype(F32), "e4m3", s, out=np.zeros((16, 32), np.uint8))
    with pytest.raises(ValueError, match="out, out_t"):
        fp8_quantize(x, "e4m3", s)
    with pytest.raises(ValueError, match="out_t"):
        fp8_quantize(x, "e4m3", s, out_t=np.zeros((16, 32), np.uint8))
    with pytest.raises(ValueError, match="scale"):
        fp8_quantize(x, "e4m3", np.ones(2, F32), out=np.zeros((16, 32), np.uint8))
    a8 = np.zeros((16, 32), np.uint8)
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        fp8_matmul(a8, a8, "e5m2", "e5m2", s, s)
    with pytest.raises(ValueError, match="b8"):
        fp8_matmul(a8, np.zeros((16, 16), np.uint8), "e4m3", "e4m3", s, s)
    with pytest.raises(ValueError, match="accumulate"):
        fp8_matmul(a8, a8, "e4m3", "e4m3", s, s, accumulate=True)


def test_matmul_reference(rng):
    a, b = _bf16(rng, (16, 32)), _bf16(rng, (48, 32))
    sa, sb = 64.0, 16.0
    a8, b8 = fp8_quantize_reference(a, "e4m3", sa), fp8_quantize_reference(b, "e5m2", sb)
    bias = _bf16(rng, (48,))
    out = fp8_matmul(a8, b8, "e4m3", "e5m2", np.array([1 / sa], F32), np.array([1 / sb], F32), bias=bias)
    ref = (fp8_dequantize(a8, "e4m3", 1 / sa).astype(np.float64) @ fp8_dequantize(b8, "e5m2", 1 / sb).T
           + bias.astype(np.float64))
    assert out.dtype == bfloat16 and np.array_equal(out, ref.astype(bfloat16))
    # FP8 of well-scaled data is within a few % of the bf16 product
    assert rel_err(out.astype(F32), a.astype(np.float64) @ b.astype(np.float64).T + bias.astype(np.float64)) < 0.1
    out2 = out.copy()
    fp8_matmul(a8, b8, "e4m3", "e5m2", np.array([1 / sa], F32), np.array([1 / sb], F32), out=out2, accumulate=True)
    assert rel_err(out2.astype(F32), 2 * out.astype(F32) - bias.astype(F32)) < 1e-2


def test_scaling_delayed_and_current(rng):
    x = _bf16(rng, (16, 16), 10.0)
    s = Fp8Scaling(2, ["e4m3", "e5m2"], np, history=2)
    s.prepare(0, x)                                  # first cast: current, from x's own amax
    m = float(np.abs(x.astype(F32)).max())
    assert np.isclose(s.scale[0], 448.0 / m) and np.isclose(s.scale_inv[0] * s.scale[0], 1.0)
    s.amax[0] = 2.0
    s.prepare(0, x * 100)                            # later casts: delayed, no change now
    assert np.isclose(s.scale[0], 448.0 / m)
    s.end_step()
    assert np.isclose(s.scale[0], 448.0 / 2.0) and s.amax[0] == 0 and s.scale[1] == 1.0   # no amax: keeps
    s.amax[0] = 8.0
    s.end_step()
    assert np.isclose(s.scale[0], 448.0 / 8.0)       # max over the history of 2
    s.amax[0] = 1.0
    s.end_step()
    assert np.isclose(s.scale[0], 448.0 / 8.0)       # slot of 2.0 replaced, 8.0 still there
    s.amax[0] = 1.0
    s.end_step()
    assert np.isclose(s.scale[0], 448.0)
    s.amax[0] = np.nan
    s.end_step()
    assert np.isclose(s.scale[0], 448.0)             # a NaN amax keeps the scale
    cur = Fp8Scaling(1, ["e5m2"], np, mode="current", margin=1)
    cur.prepare(0, x)
    cur.prepare(0, x * 2)                            # current: every cast measures
    assert np.isclose(cur.scale[0], 57344.0 / (2 * m) / 2)
    st = s.state()
    s2 = Fp8Scaling(2, ["e4m3", "e5m2"], np, history=2)
    s2.load_state(st)
    assert np.array_equal(s2.scale, s.scale) and s2.step_index == s.step_index


def _adaptive_steps(xp, rng, measured=False):
    """Four casts of one E4M3 tensor under adaptive scaling (margin 1, window 2), with end_step
    between them: (x, the scale each cast ended with, the bytes, the gate, the step's amax).
    measured: x's amax folded into measured_amax first (as a producer does), then one cast."""
    base = _bf16(rng, (64, 48), 0.01)
    s = Fp8Scaling(1, ["e4m3"], xp, mode="adaptive", margin=1, window=2, history=16)
    out = []
    for k, factor in enumerate([1.0, 1.5, 8.0, 1 / 64]):   # start, inside the window, saturating, too small
        x = (base.astype(F32) * F32(factor)).astype(bfloat16)
        q, qt = xp.zeros((64, 48), np.uint8), xp.zeros((48, 64), np.uint8)
        if measured:
            fp8_amax(xp.asarray(x), s.measured_amax(0))
        s.cast(0, xp.asarray(x), out=q, out_t=qt, measured=measured)
        out.append((x, float(to_cpu(s.scale)[0]), to_cpu(q), to_cpu(qt), float(to_cpu(s._slots[3, 0, 1])),
                    float(to_cpu(s.amax)[0])))
        s.end_step()
    return s, out


def test_scaling_adaptive(rng):
    """Adaptive: the last step's scale unless this cast's amax leaves the window; then the scale
    from this amax (as current scaling) and the gated re-cast. The bytes always match the reference
    cast with the scale the tensor ended with, so the GEMM's scale_inv is right either way."""
    s, steps = _adaptive_steps(np, rng)
    assert s.history_len == 1
    m0 = float(np.abs(steps[0][0].astype(F32)).max())
    gates = [st[4] for st in steps]
    assert gates == [1.0, 0.0, 1.0, 1.0]      # scale 1: far too small for data of 0.01; x1.5 inside; x8 saturates; /64
    assert np.isclose(steps[0][1], 448.0 / m0 / 2)                 # the re-cast's scale: current, margin 1
    assert steps[1][1] == steps[0][1]                              # kept: last step's amax, margin 1
    assert np.isclose(steps[2][1], 448.0 / (8 * m0) / 2, rtol=1e-2)
    for x, scale, q, qt, _, amax in steps:
        want = fp8_quantize_reference(x, "e4m3", scale)
        assert np.array_equal(q, want) and np.array_equal(qt, want.T)
        assert amax == float(np.abs(x.astype(F32)).max())          # the step's amax is recorded
    # a NaN amax: no re-cast, the scale stays, the NaN is recorded
    t = Fp8Scaling(1, ["e5m2"], np, mode="adaptive")
    x = _bf16(rng, (16, 16))
    x[3, 3] = np.nan
    t.cast(0, x, out=np.zeros((16, 16), np.uint8))
    assert t.scale[0] == 1.0 and np.isnan(t.amax[0]) and t._slots[3, 0, 1] == 0
    with pytest.raises(ValueError, match="mode"):
        Fp8Scaling(1, ["e4m3"], np, mode="sometimes")


@pytest.mark.parametrize("device", ["numpy", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_scaling_adaptive_measured_is_the_cast_then_recast(rng, device):
    """A producer's amax (cast(measured=True)): the guard first, then one cast -- the same scales,
    gates, bytes and recorded amax as the cast and its gated re-cast, step by step; the slot is
    zero again after each use. Other modes have no such slot."""
    xp = np if device == "numpy" else runtime.cupy
    if xp is not np:
        _need_fp8()
    seed = int(rng.integers(1 << 30))
    _, want = _adaptive_steps(xp, np.random.default_rng(seed))
    s, got = _adaptive_steps(xp, np.random.default_rng(seed), measured=True)
    assert [w[4] for w in want] == [1.0, 0.0, 1.0, 1.0]        # both re-cast kinds and a kept scale
    for k, (w, g) in enumerate(zip(want, got)):
        assert g[1] == w[1] and g[4] == w[4] and g[5] == w[5], f"cast {k}: scale/gate/amax {g[1], g[4], g[5]} vs {w[1], w[4], w[5]}"
        assert np.array_equal(g[2], w[2]) and np.array_equal(g[3], w[3]), f"cast {k}: bytes differ"
    assert float(to_cpu(s.measured_amax(0))[0]) == 0.0
    for mode in ("current", "delayed"):
        t = Fp8Scaling(1, ["e5m2"], np, mode=mode)
        assert t.measured_amax(0) is None
        with pytest.raises(ValueError, match="adaptive"):
            t.cast(0, _bf16(rng, (16, 16)), out=np.zeros((16, 16), np.uint8), measured=True)


def _predicted_steps(xp, rng, predict: bool, factors=(8.0, 1.0, 1.5)):
    """Three E5M2 gradients under adaptive scaling (margin 1, window 1), as a backward casts them:
    tensor 0, then 1 and 2, whose data move with 0's from step to step (all three scaled by the
    step's factor, relative to step 0's data). Step 0 sets the history; at each later step tensor 0's guard predicts 1 and 2
    (predict=True) or not. Returns, per later step, (tensor 1's and 2's scale after their own
    guard, their gates, their bytes) as host values."""
    base = [_bf16(rng, (32, 48), 1e-3 * (k + 1)) for k in range(3)]
    s = Fp8Scaling(3, ["e5m2"] * 3, xp, mode="adaptive", margin=1, window=1)
    out = []
    for step, factor in enumerate((1.0,) + tuple(factors)):
        got = []
        for k in range(3):
            x = xp.asarray((base[k].astype(F32) * F32(factor)).astype(bfloat16))
            q = xp.zeros((32, 48), np.uint8)
            s.cast(k, x, out=q, predict=(1, 2) if predict and k == 0 else ())
            got.append((float(to_cpu(s.scale)[k]), float(to_cpu(s._slots[3, k, 1])), to_cpu(q)))
        if step:
            out.append(got[1:])
        s.end_step()
    return s, out


def test_scaling_adaptive_predicted_scales(rng):
    """Fp8Scaling.cast(predict=): the guard of tensor 0 sets tensors 1 and 2's scales from their
    last amax times 0's step-to-step factor. When their data move by the same power of two, that is
    exactly the scale their own re-cast would have found: the same bytes and scales, with no re-cast
    (gate 0) where the delayed scale re-casts (gate 1) -- saturating (x8), too low (/8), and a
    factor inside the window (x1.5: no re-cast either way, only the scale differs)."""
    seed = int(rng.integers(1 << 30))
    _, without = _predicted_steps(np, np.random.default_rng(seed), predict=False)
    s, with_ = _predicted_steps(np, np.random.default_rng(seed), predict=True)
    assert [[g[1] for g in step] for step in without] == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    assert [[g[1] for g in step] for step in with_] == [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    for step in (0, 1):         # powers of two: the predicted scale is the re-cast's, bit for bit
        for w, g in zip(without[step], with_[step]):
            assert g[0] == w[0] and np.array_equal(g[2], w[2])
    for w, g in zip(without[2], with_[2]):      # x1.5: kept at the last step's scale, or predicted 1.5x lower
        assert np.isclose(g[0], w[0] / 1.5, rtol=1e-2) and g[0] != w[0]
    # the rule itself: fmax / (last amax x factor) x 2^-margin, from the history row
    h = s.history[0]
    s.scale[1] = 1.0
    s.predict_scales(0, np.float32(h[0] * 4), (1,))
    assert s.scale[1] == np.float32(57344.0 / np.float32(h[1] * np.float32(np.float32(h[0] * 4) / h[0])) / 2)
    assert s.scale_inv[1] == np.float32(1.0) / s.scale[1]
    for bad in (np.float32(0), np.float32(np.nan), np.float32(np.inf)):     # no prediction: the scale stays
        s.predict_scales(0, bad, (1,))
        assert s.scale[1] == np.float32(57344.0 / np.float32(h[1] * np.float32(np.float32(h[0] * 4) / h[0])) / 2)
    # the first step has no history: nothing predicted
    t = Fp8Scaling(2, ["e5m2"] * 2, np, mode="adaptive")
    t.cast(0, _bf16(rng, (16, 16)), out=np.zeros((16, 16), np.uint8), predict=(1,))
    assert t.scale[1] == 1.0


def test_scaling_predict_refuses_bad_use(rng):
    x, q = _bf16(rng, (16, 16)), np.zeros((16, 16), np.uint8)
    s = Fp8Scaling(3, ["e5m2", "e5m2", "e4m3"], np, mode="adaptive")
    with pytest.raises(ValueError, match="is e4m3"):
        s.cast(0, x, out=q, predict=(2,))
    with pytest.raises(ValueError, match="not another"):
        s.cast(0, x, out=q, predict=(0,))
    with pytest.raises(ValueError, match="not another"):
        s.cast(0, x, out=q, predict=(3,))
    with pytest.raises(ValueError, match="at most 2"):
        s.cast(0, x, out=q, predict=(1, 1, 1))
    with pytest.raises(ValueError, match="guard"):
        s.cast(0, x, out=q, record=False, predict=(1,))
    for mode in ("current", "delayed"):
        t = Fp8Scaling(2, ["e5m2"] * 2, np, mode=mode)
        t.cast(0, x, out=q)
        t.end_step()
        with pytest.raises(ValueError, match="predict"):
            t.cast(0, x, out=q, predict=(1,))


def test_fp8_linears_predict_along_the_residual_stream():
    """Which gradient casts predict which (Fp8Linears._predicted_by): fcproj's predicts its layer's
    fc and attproj gradients, attproj's the layer below's fcproj; none without the setting or
    outside adaptive scaling."""
    from gpucore.fp8_linear import ATTPROJ, FC, FCPROJ, QKV, Fp8Linears
    from gpucore.model import GPT2Config
    cfg = GPT2Config.from_preset("micro")
    f = Fp8Linears(cfg, np, mode="adaptive")
    g = lambda l, j: 12 * l + 3 * j + 2     # noqa: E731 - a linear's output-gradient slot
    assert f._predicted_by(1, FCPROJ) == (g(1, FC), g(1, ATTPROJ))
    assert f._predicted_by(1, ATTPROJ) == (g(0, FCPROJ),)
    assert f._predicted_by(0, ATTPROJ) == () and f._predicted_by(1, FC) == () and f._predicted_by(1, QKV) == ()
    with settings.using(fp8_predict_scales=False):
        assert Fp8Linears(cfg, np, mode="adaptive")._predicted_by(1, FCPROJ) == ()
    assert Fp8Linears(cfg, np, mode="delayed")._predicted_by(1, FCPROJ) == ()


def _gelu_case(rng, R, C, xp):
    dout, x = _bf16(rng, (R, C), 1e-3), _bf16(rng, (R, C), 2.0)
    dout[0, :2] = np.array([1e9, -1e9]).astype(bfloat16)         # saturates
    return xp.asarray(dout), xp.asarray(x)


def _gelu_fused_and_split(dout, x, scale, xp):
    """fp8_gelu_backward against gelu_backward + fp8_quantize: (bytes, bytes_t, amax, fp32 dbias) each."""
    R, C = dout.shape
    res = []
    for fused in (True, False):
        q, qt = xp.full((R, C), 0xAB, np.uint8), xp.full((C, R), 0xAB, np.uint8)
        amax, dbias = xp.zeros(1, F32), xp.full(C, 0.5, F32)
        if fused:
            fp8_gelu_backward(dout, x, scale, out=q, out_t=qt, amax=amax, dbias=dbias)
        else:
            dx = gelu_backward(dout, x, dbias=dbias)
            fp8_quantize(dx, "e5m2", scale, out=q, out_t=qt, amax=amax)
        res.append(tuple(to_cpu(a) for a in (q, qt, amax, dbias)))
    return res


def test_gelu_backward_fused_reference(rng):
    """NumPy: the fused GELU backward + E5M2 cast is gelu_backward then fp8_quantize, bit for bit, and
    its bias sums are gelu_backward's; the gated re-run does nothing on gate 0."""
    dout, x = _gelu_case(rng, 48, 32, np)
    scale = np.array([3000.0], F32)
    (q, qt, am, db), (q2, qt2, am2, db2) = _gelu_fused_and_split(dout, x, scale, np)
    assert np.array_equal(q, q2) and np.array_equal(qt, qt2) and am[0] == am2[0] and np.array_equal(db, db2)
    assert q[0, 0] == fp8_quantize_reference(np.array([[57344.0]], F32), "e5m2", 1.0)[0, 0]   # saturated
    out = np.zeros((48, 32), np.uint8)
    fp8_gelu_backward_gated(dout, x, scale, np.zeros(1, F32), out=out)
    assert not out.any()
    fp8_gelu_backward_gated(dout, x, scale, np.ones(1, F32), out=out)
    assert np.array_equal(out, q)
    with pytest.raises(ValueError, match="at least one"):
        fp8_gelu_backward(dout, x, scale)


def _gelu_t_case(dout, x, xp):
    """fp8_gelu_backward with gelu_t against fp8_gelu_quantize(x, out_t=) and itself without gelu_t:
    (gelu_t, its reference, (q, qt), (q, qt) without gelu_t)."""
    R, C = dout.shape
    scale, gscale = xp.asarray([3000.0], F32), xp.asarray([60.0], F32)
    want = xp.full((C, R), 0xAB, np.uint8)
    fp8_gelu_quantize(x, gscale, out_t=want)
    res = []
    for with_gelu in (True, False):
        q, qt, gt = xp.zeros((R, C), np.uint8), xp.zeros((C, R), np.uint8), xp.full((C, R), 0xCD, np.uint8)
        kw = dict(gelu_t=gt, gelu_scale=gscale) if with_gelu else {}
        fp8_gelu_backward(dout, x, scale, out=q, out_t=qt, amax=xp.zeros(1, F32), dbias=xp.zeros(C, F32), **kw)
        res.append((to_cpu(gt), (to_cpu(q), to_cpu(qt))))
    return res[0][0], to_cpu(want), res[0][1], res[1][1]


def test_gelu_backward_gelu_t_reference(rng):
    """NumPy: gelu_t gets fp8_gelu_quantize's transposed bytes (the GELU output remade for fcproj's
    weight gradient), and the gradient's bytes do not change with it; both or neither of gelu_t,
    gelu_scale."""
    dout, x = _gelu_case(rng, 48, 32, np)
    gt, want, with_g, without = _gelu_t_case(dout, x, np)
    assert np.array_equal(gt, want) and want.any()
    assert all(np.array_equal(a, b) for a, b in zip(with_g, without))
    with pytest.raises(ValueError, match="both or neither"):
        fp8_gelu_backward(dout, x, np.ones(1, F32), out=np.zeros((48, 32), np.uint8), gelu_t=np.zeros((32, 48), np.uint8))
    with pytest.raises(ValueError, match="gelu_t: expected shape"):
        fp8_gelu_backward(dout, x, np.ones(1, F32), out=np.zeros((48, 32), np.uint8),
                          gelu_t=np.zeros((48, 32), np.uint8), gelu_scale=np.ones(1, F32))


# ------------------------------------------------------------------ GPU ----

def _need_fp8():
    from gpucore.ops.fp8 import fp8_supported
    ok, why = fp8_supported()
    if not ok:
        pytest.fail(why)      # the cuda marker says there is a GPU; our test GPUs are Hopper


def test_fp8_transpose_numpy_and_bad_input(rng):
    x8 = rng.integers(0, 256, (48, 80), dtype=np.uint8)
    out = fp8_transpose(x8)
    assert out.shape == (80, 48) and out.tobytes() == np.ascontiguousarray(x8.T).tobytes()
    with pytest.raises(ValueError, match="out"):
        fp8_transpose(x8, out=np.zeros((48, 80), np.uint8))
    with pytest.raises((TypeError, ValueError), match="x8"):
        fp8_transpose(x8.astype(np.int32))


@pytest.mark.cuda
@pytest.mark.parametrize("R,C", [(16, 16), (48, 80), (64, 64), (1040, 784), (8192, 50304), (65536 * 66, 16)])
def test_gpu_fp8_transpose_bitwise(rng, R, C):
    """Every byte lands at its transposed place: edge tiles (R, C not multiples of 64), the LM
    head's chunk shape, and more row tiles than the grid's y limit (the kernel's tile loop)."""
    cp = runtime.cupy
    x8 = cp.asarray(rng.integers(0, 256, (R, C), dtype=np.uint8))
    out = cp.full((C, R), 0xAB, np.uint8)
    fp8_transpose(x8, out=out)
    assert bool((out == x8.T).all())
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_transpose(cp.zeros((24, 16), np.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("R,C", [(16, 16), (48, 80), (64, 64), (1040, 784), (4096, 3072)])
def test_gpu_quantize_bitwise(rng, fmt, R, C):
    _need_fp8()
    cp = runtime.cupy
    x = _bf16(rng, (R, C), 2.0)
    x[0, :3] = np.array([1e4, -1e6, 3e-8]).astype(bfloat16)        # saturation and flush to zero
    scale = F32(37.25)
    out, out_t = cp.full((R, C), 0xAB, np.uint8), cp.full((C, R), 0xAB, np.uint8)
    amax = cp.zeros(1, F32)
    fp8_quantize(cp.asarray(x), fmt, cp.asarray([scale]), out=out, out_t=out_t, amax=amax)
    want = fp8_quantize_reference(x, fmt, scale)
    got = to_cpu(out)
    bad = np.argwhere(got != want)
    assert len(bad) == 0, f"{len(bad)} wrong, first {tuple(bad[0])}: {got[tuple(bad[0])]:#x} want {want[tuple(bad[0])]:#x}"
    assert np.array_equal(to_cpu(out_t), want.T)
    assert float(to_cpu(amax)[0]) == float(np.abs(x.astype(F32)).max())
    # only the transposed output, and only the plain one
    out_t2 = cp.zeros((C, R), np.uint8)
    fp8_quantize(cp.asarray(x), fmt, cp.asarray([scale]), out_t=out_t2)
    assert np.array_equal(to_cpu(out_t2), want.T)


def _tile_colsums_emulated(x, dbias0, rows=128):
    """NumPy float32 emulation of fp8_cast_colsum's bias sums: per tile of `rows` rows, each thread
    group's rows g + 32 h summed in h order, 8 groups in order, the 4 eights in order; then colsum's
    stage 2 over the tiles (stage2_order_sum), added to dbias."""
    R, C = x.shape
    tiles = -(-R // rows)
    v = np.zeros((tiles * rows, C), F32)
    v[:R] = x.astype(F32)
    tile_sums = np.zeros((tiles, C), F32)
    for ty in range(tiles):
        part = v[ty * rows:(ty + 1) * rows].reshape(rows // 32, 32, C)
        s = part[0].copy()
        for h in range(1, rows // 32):
            s = s + part[h]
        eights = []
        for q in range(4):
            acc = s[8 * q].copy()
            for k in range(1, 8):
                acc = acc + s[8 * q + k]
            eights.append(acc)
        tile_sums[ty] = ((eights[0] + eights[1]) + eights[2]) + eights[3]
    return dbias0.astype(F32) + stage2_order_sum(tile_sums)


def test_quantize_dbias_numpy_and_bad_input(rng):
    """NumPy: a gradient's cast with dbias writes the same bytes and adds x's column sums (float64)."""
    x = _bf16(rng, (48, 32), 2.0)
    scale = np.array([5.0], F32)
    out, db = np.zeros((48, 32), np.uint8), np.full(32, 0.25, F32)
    fp8_quantize(x, "e5m2", scale, out=out, dbias=db)
    assert np.array_equal(out, fp8_quantize_reference(x, "e5m2", 5.0))
    assert np.array_equal(db, (0.25 + x.astype(np.float64).sum(axis=0)).astype(F32))
    with pytest.raises(ValueError, match="only a gradient's cast"):
        fp8_quantize(x, "e4m3", scale, out=out, dbias=db)
    with pytest.raises(ValueError, match="dbias"):
        fp8_quantize(x, "e5m2", scale, out=out, dbias=np.zeros(31, F32))
    with pytest.raises(TypeError, match="dbias: dtype"):
        fp8_quantize(x, "e5m2", scale, out=out, dbias=np.zeros(32, np.float16))


@pytest.mark.cuda
@pytest.mark.parametrize("R,C", [(64, 64), (1040, 784), (4096, 2304)])
def test_gpu_quantize_dbias_bitwise(rng, R, C):
    """GPU: the E5M2 cast that also sums the columns (the qkv bias gradient from the dqkv cast) writes
    the plain cast's bytes and amax, and its bias sums equal a float32 emulation of its tree bit for
    bit (partial last tile at 1040 rows)."""
    _need_fp8()
    cp = runtime.cupy
    x = _bf16(rng, (R, C), 2.0)
    scale = cp.asarray([300.0], F32)
    res = []
    for with_bias in (True, False):
        out, out_t = cp.full((R, C), 0xAB, np.uint8), cp.full((C, R), 0xAB, np.uint8)
        amax, db = cp.zeros(1, F32), cp.full(C, 0.5, F32)
        fp8_quantize(cp.asarray(x), "e5m2", scale, out=out, out_t=out_t, amax=amax, dbias=db if with_bias else None)
        res.append([to_cpu(a) for a in (out, out_t, amax, db)])
    (q, qt, am, db), (q2, qt2, am2, db2) = res
    assert np.array_equal(q, q2) and np.array_equal(qt, qt2) and am[0] == am2[0]
    assert np.all(db2 == 0.5)
    want = _tile_colsums_emulated(x, np.full(C, 0.5, F32))
    bad = np.argwhere(db != want)
    assert len(bad) == 0, f"{len(bad)} sums differ, first at {tuple(bad[0])}: {db[bad[0][0]]} vs {want[bad[0][0]]}"
    assert rel_err(db.astype(np.float64) - 0.5, x.astype(np.float64).sum(axis=0)) < 1e-5


@pytest.mark.cuda
def test_gpu_amax_and_nan(rng):
    _need_fp8()
    cp = runtime.cupy
    x = _bf16(rng, (1000, 24))
    a = cp.zeros(1, F32)
    fp8_amax(cp.asarray(x), a)
    assert float(a.get()[0]) == float(np.abs(x.astype(F32)).max())
    x[500, 7] = np.nan
    fp8_amax(cp.asarray(x), a)
    assert np.isnan(a.get()[0])
    s = Fp8Scaling(1, ["e4m3"], cp)
    s.prepare(0, cp.asarray(x[:400]))
    m = float(np.abs(x[:400].astype(F32)).max())
    assert np.isclose(float(s.scale.get()[0]), 448.0 / m, rtol=1e-6)
    s.amax[...] = cp.asarray([np.nan], F32)
    before = s.scale.get().copy()
    s.end_step()
    assert np.array_equal(s.scale.get(), before)


@pytest.mark.cuda
@pytest.mark.parametrize("R,C", [(64, 64), (1040, 784), (4096, 3072)])
def test_gpu_gelu_backward_fused_bitwise(rng, R, C):
    """GPU: fp8_gelu_backward's bytes and amax equal gelu_backward + fp8_quantize's bit for bit (the
    same GELU math, the same rounding to bf16, the same cast); its bias sums (another summation
    order) agree to float32 rounding; the gated re-run writes only on a nonzero gate."""
    _need_fp8()
    cp = runtime.cupy
    dout, x = _gelu_case(rng, R, C, cp)
    scale = cp.asarray([3000.0], F32)
    (q, qt, am, db), (q2, qt2, am2, db2) = _gelu_fused_and_split(dout, x, scale, cp)
    bad = np.argwhere(q != q2)
    assert len(bad) == 0, f"{len(bad)} bytes differ, first at {tuple(bad[0])}"
    assert np.array_equal(qt, qt2) and am[0] == am2[0]
    assert rel_err(db.astype(np.float64), db2.astype(np.float64)) < 1e-5
    out = cp.zeros((R, C), np.uint8)
    fp8_gelu_backward_gated(dout, x, scale, cp.zeros(1, F32), out=out)
    assert not bool(out.any())
    fp8_gelu_backward_gated(dout, x, scale, cp.ones(1, F32), out=out)
    assert np.array_equal(to_cpu(out), q)


@pytest.mark.cuda
@pytest.mark.parametrize("R,C", [(64, 64), (1040, 784), (4096, 3072)])
def test_gpu_gelu_backward_gelu_t_bitwise(rng, R, C):
    """GPU: the fused GELU backward's gelu_t is fp8_gelu_quantize's transposed bytes bit for bit (and
    the NumPy reference's), and writing it leaves the gradient's bytes as they were."""
    _need_fp8()
    cp = runtime.cupy
    dout, x = _gelu_case(rng, R, C, cp)
    gt, want, with_g, without = _gelu_t_case(dout, x, cp)
    bad = np.argwhere(gt != want)
    assert len(bad) == 0, f"{len(bad)} bytes differ, first at {tuple(bad[0])}"
    assert all(np.array_equal(a, b) for a, b in zip(with_g, without))
    ref = np.zeros((C, R), np.uint8)
    fp8_gelu_quantize(to_cpu(x), np.array([60.0], F32), out_t=ref)
    assert np.array_equal(gt, ref)


@pytest.mark.cuda
def test_gpu_scaling_adaptive_matches_numpy(rng):
    """fp8_guard_kernel and the gated re-cast on the GPU: the same gates, scales and bytes as the
    NumPy reference, step by step."""
    _need_fp8()
    seed = int(rng.integers(1 << 30))
    _, want = _adaptive_steps(np, np.random.default_rng(seed))
    _, got = _adaptive_steps(runtime.cupy, np.random.default_rng(seed))
    for k, (w, g) in enumerate(zip(want, got)):
        assert g[4] == w[4] and g[1] == w[1] and g[5] == w[5], f"cast {k}: gate/scale/amax {g[4:]} vs {w[4:]}"
        assert np.array_equal(g[2], w[2]) and np.array_equal(g[3], w[3]), f"cast {k}: bytes differ"


@pytest.mark.cuda
@pytest.mark.parametrize("predict", [False, True])
def test_gpu_scaling_predicted_matches_numpy(rng, predict):
    """fp8_guard_kernel's prediction on the GPU: the same scales, gates and bytes as the NumPy
    reference, step by step, with data that move by other than powers of two (x3, x0.3, x5)."""
    _need_fp8()
    seed = int(rng.integers(1 << 30))
    _, want = _predicted_steps(np, np.random.default_rng(seed), predict, factors=(3.0, 0.3, 5.0))
    _, got = _predicted_steps(runtime.cupy, np.random.default_rng(seed), predict, factors=(3.0, 0.3, 5.0))
    for k, (ws, gs) in enumerate(zip(want, got)):
        for t, (w, g) in enumerate(zip(ws, gs)):
            assert g[0] == w[0] and g[1] == w[1], f"step {k + 1}, tensor {t + 1}: scale/gate {g[:2]} vs {w[:2]}"
            assert np.array_equal(g[2], w[2]), f"step {k + 1}, tensor {t + 1}: bytes differ"


@pytest.mark.cuda
@pytest.mark.parametrize("fa,fb", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")])
@pytest.mark.parametrize("M,N,K", [(16, 16, 16), (64, 48, 96), (1024, 768, 768), (4096, 3072, 768), (2048, 768, 3072)])
@pytest.mark.parametrize("fast", [False, True])
def test_gpu_matmul(rng, fa, fb, M, N, K, fast):
    _need_fp8()
    cp = runtime.cupy
    a, b, bias = _bf16(rng, (M, K)), _bf16(rng, (N, K), 0.05), _bf16(rng, (N,))
    sa, sb = 100.0, 2000.0
    a8, b8 = fp8_quantize_reference(a, fa, sa), fp8_quantize_reference(b, fb, sb)
    sia, sib = cp.asarray([1 / sa], F32), cp.asarray([1 / sb], F32)
    out = cp.full((M, N), np.nan, F32).astype(bfloat16)
    fp8_matmul(cp.asarray(a8), cp.asarray(b8), fa, fb, sia, sib, out=out, bias=cp.asarray(bias), fast_accum=fast)
    ref = (fp8_dequantize(a8, fa, 1 / sa).astype(np.float64) @ fp8_dequantize(b8, fb, 1 / sb).T.astype(np.float64)
           + bias.astype(np.float64))
    got = to_cpu(out).astype(np.float64)
    assert not np.isnan(got).any()
    assert rel_err(got, ref) < (2e-2 if fast else 1e-2)          # bf16 output rounding
    acc = out.copy()
    fp8_matmul(cp.asarray(a8), cp.asarray(b8), fa, fb, sia, sib, out=acc, accumulate=True, fast_accum=fast)
    assert rel_err(to_cpu(acc).astype(np.float64), 2 * ref - bias.astype(np.float64)) < 2e-2
    again = cp.empty_like(out)
    fp8_matmul(cp.asarray(a8), cp.asarray(b8), fa, fb, sia, sib, out=again, bias=cp.asarray(bias), fast_accum=fast)
    assert to_cpu(again).tobytes() == to_cpu(out).tobytes()      # deterministic
    res = _bf16(rng, (M, N), 4.0)
    with_res = cp.empty_like(out)
    fp8_matmul(cp.asarray(a8), cp.asarray(b8), fa, fb, sia, sib, out=with_res, bias=cp.asarray(bias), fast_accum=fast,
               residual=cp.asarray(res))
    assert rel_err(to_cpu(with_res).astype(np.float64), ref + res.astype(np.float64)) < 2e-2


def test_matmul_residual_reference_and_bad_input(rng):
    """residual joins the unrounded sum (one rounding); it must not overlap out or come with accumulate."""
    a, b = _bf16(rng, (16, 32)), _bf16(rng, (48, 32))
    a8, b8 = fp8_quantize_reference(a, "e4m3", 64.0), fp8_quantize_reference(b, "e4m3", 16.0)
    sa, sb = np.array([1 / 64], F32), np.array([1 / 16], F32)
    bias, res = _bf16(rng, (48,)), _bf16(rng, (16, 48), 8.0)
    out = fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, bias=bias, residual=res)
    ref = fp8_matmul_reference(a8, b8, "e4m3", "e4m3", 1 / 64, 1 / 16, bias) + res.astype(np.float64)
    assert np.array_equal(out, ref.astype(bfloat16))
    with pytest.raises(ValueError, match="residual"):
        fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, out=out, residual=out)
    with pytest.raises(ValueError, match="residual"):
        fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, out=out, accumulate=True, residual=res)
    with pytest.raises(ValueError, match="residual"):
        fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, residual=np.zeros((16, 40), bfloat16))


# -------------------------------------------------- the model's FP8 linears ----

from gpucore.model import GPT2, GPT2Config, memory_plan         # noqa: E402


def _model_grads(cfg, xp, x, y, fp8):
    m = GPT2(cfg, xp=xp, dtype="bfloat16", seed=9, fp8=fp8)
    m.zero_grad()
    loss = m.forward(xp.asarray(x), xp.asarray(y), for_backward=True)
    m.backward()
    m.end_step()
    return float(loss), to_cpu(m.grads.flat()).astype(np.float64), m


def _tokens(cfg, B, T, seed=0):
    r = np.random.default_rng(seed)
    return (r.integers(0, cfg.vocab_size, (B, T), dtype=np.int32),
            r.integers(0, cfg.vocab_size, (B, T), dtype=np.int32))


def test_model_fp8_numpy_close_to_bf16():
    """The FP8 linears (NumPy references) give the bf16 model's loss to 1% and its gradients to the
    precision of E5M2 gradients (2 mantissa bits); the scaling state advances at end_step."""
    from gpucore import settings
    cfg = GPT2Config.from_preset("micro")
    x, y = _tokens(cfg, 2, 16)
    l16, g16, _ = _model_grads(cfg, np, x, y, None)
    with settings.using(fp8_lm_head=False):   # the linears alone (the head: test_model_fp8_lm_head_*)
        l8, g8, m = _model_grads(cfg, np, x, y, "delayed")
    assert abs(l8 - l16) < 1e-2 * l16
    assert np.isfinite(g8).all() and rel_err(g8, g16) < 0.15
    s = m.fp8.scaling
    assert s.step_index == 1 and s.started.all() and np.all(s.amax == 0) and np.all(s.history[0] > 0)
    # the gradient slots are E5M2, scaled far above 1 (gradients are small)
    assert np.all(s.scale[2::3] > 1)


def test_model_fp8_scratch_lives_in_the_logits_chunk():
    """The FP8 scratch is carved out of the LM head's logits chunk (idle while the layers run) when
    it fits, so --dtype fp8 plans no more memory than bf16; the results are the same bits as with
    separately allocated scratch."""
    from gpucore.model import memory_plan
    cfg = GPT2Config.from_preset("tiny")
    x, y = _tokens(cfg, 2, 16)
    out = []
    for arena in (True, False):
        m = GPT2(cfg, dtype="bfloat16", seed=3, fp8="current")
        m.allocate_activations(2, 16)
        if not arena:
            m.fp8.bind_arena(None)
        m.zero_grad()
        loss = m.forward(x, y, for_backward=True)
        m.backward()
        shares = any(np.shares_memory(b, m.acts.logits) for b in m.fp8._scratch)
        assert shares == arena
        out.append((np.asarray(loss).tobytes(), m.grads.flat().tobytes()))
    assert out[0] == out[1]
    micro = GPT2Config.from_preset("micro")      # a 64-token vocabulary: too small a chunk
    assert memory_plan(micro, 2, 16, "bf16", fp8=True)["fp8 scratch"] > 0


@pytest.mark.parametrize("fch8", [False, True])
@pytest.mark.parametrize("keep", [False, True])
def test_model_fp8_plans_less_memory_than_bf16(keep, fch8):
    """FP8 keeps x8t (3C or, with keep_gelu, 7C bytes per token and layer) instead of the bf16
    ln1/ln2 (4C) and kept GELU outputs (8C), and its GELU scratch (8C) is the backward's idle dbig:
    d12 B=64 plans (L + 4) x N x C bytes less without keep_gelu, (5L - 4) x N x C with it, and
    4 L x N x C less again with fch kept as E4M3 (adaptive scaling, settings.fp8_fch_e4m3); nothing
    else changes without the FP8 LM head (the linears' scratch lives in the logits); the head adds
    its own scratch and still plans under bf16 at this size."""
    from gpucore.model import memory_plan
    d12 = GPT2Config.from_preset("d12")
    L, N, C = d12.num_layers, 64 * 1024, d12.channels
    with settings.using(fp8_fch_e4m3=fch8):
        p8 = memory_plan(d12, 64, 1024, "bf16", keep_gelu=keep, fp8=True, fp8_lm_head=False)
        assert memory_plan(d12, 64, 1024, "bf16", keep_gelu=keep, fp8="current", fp8_lm_head=False)["activations"] \
            == p8["activations"] + (4 * L * N * C if fch8 else 0)      # fch8 only with adaptive scaling
        head = memory_plan(d12, 64, 1024, "bf16", keep_gelu=keep, fp8=True, fp8_lm_head=True)
    p16 = memory_plan(d12, 64, 1024, "bf16", keep_gelu=keep)
    saved = ((5 * L - 4) if keep else (L + 4)) * N * C + (4 * L * N * C if fch8 else 0)
    assert p16["activations"] - p8["activations"] == saved
    assert {k: v for k, v in p8.items() if k != "activations"} == {k: v for k, v in p16.items() if k != "activations"}
    assert sum(p8.values()) < sum(head.values()) < sum(p16.values())


@pytest.mark.parametrize("mode", ["current", "delayed", "adaptive"])
def test_model_fp8_kept_x8t(mode):
    """The forward's kept FP8 copy of a linear's input (x8t) is the transposed reference cast of that
    input with the scale its cast used (checked on attproj's, whose bf16 input stays per layer);
    keeping fcproj's (keep_gelu) or remaking it in the backward (inside fc's GELU backward, fcproj's
    weight gradient deferred until then) gives the same loss and gradients bit for bit: the same
    bytes from the same fch and scale."""
    from gpucore.fp8_linear import ATTPROJ, kept_x8t
    cfg = GPT2Config.from_preset("tiny")
    x, y = _tokens(cfg, 2, 16)
    C, res = cfg.channels, {}
    for keep in (True, False):
        m = GPT2(cfg, dtype="bfloat16", seed=3, fp8=mode, keep_gelu=keep)
        m.zero_grad()
        loss = m.forward(x, y, for_backward=True)
        assert m.acts.x8t.shape == (cfg.num_layers, 2, 16 * C * (7 if keep else 3))
        for l in range(cfg.num_layers):
            scale = m.fp8.scaling.scale[m.fp8._slot(l, ATTPROJ, 0)]
            want = fp8_quantize_reference(m.acts.atty[l].reshape(-1, C), "e4m3", scale).T
            assert np.array_equal(kept_x8t(m.acts.x8t[l].reshape(-1), ATTPROJ, 32, C), want)
        m.backward()
        res[keep] = (float(loss), m.grads.flat())
    (l1, g1), (l0, g0) = res[True], res[False]
    assert l1 == l0 and g1.tobytes() == g0.tobytes() and np.abs(g1.astype(np.float64)).max() > 0


def test_fp8_linears_deferred_weight_grad_contract():
    """fcproj without its kept x8t: Fp8Linears.backward refuses to run unless told to defer its
    weight gradient (its input is remade by fc's GELU backward), and `then` needs that GELU
    backward; deferred, dweight is untouched until fc's backward runs it. A measured dout (its
    producer's amax) cannot go with the GELU backward, which casts another tensor than dout."""
    from gpucore.fp8_linear import FC, FCPROJ
    cfg = GPT2Config.from_preset("tiny")
    x, y = _tokens(cfg, 2, 16)
    m = GPT2(cfg, dtype="bfloat16", seed=3, fp8="adaptive", keep_gelu=False)
    m.zero_grad()
    m.forward(x, y, for_backward=True)
    a, p, C, N = m.acts, m.params, cfg.channels, 32
    fch, dres = a.fch[0].reshape(N, 4 * C), np.full((N, C), 0.01, dtype=p.fcprojw.dtype)
    dfch, dw = np.zeros((N, 4 * C), p.fcprojw.dtype), np.zeros_like(p.fcprojw[0])
    with pytest.raises(ValueError, match="defer_dweight=True"):
        m.fp8.backward(0, FCPROJ, dres, fch, p.fcprojw[0], dfch, dw, gelu_of=fch)
    later = m.fp8.backward(0, FCPROJ, dres, fch, p.fcprojw[0], dfch, dw, gelu_of=fch, defer_dweight=True)
    assert later is not None and not dw.any() and dfch.any()
    with pytest.raises(ValueError, match="gelu_x2d"):
        m.fp8.backward(0, FC, dfch, a.ln2.reshape(N, C), p.fcw[0], np.zeros((N, C), p.fcw.dtype),
                       np.zeros_like(p.fcw[0]), then=later)
    with pytest.raises(ValueError, match="dout_measured"):
        m.fp8.backward(0, FC, dfch, a.ln2.reshape(N, C), p.fcw[0], np.zeros((N, C), p.fcw.dtype),
                       np.zeros_like(p.fcw[0]), gelu_x2d=fch, dout_measured=True)
    dwfc = np.zeros_like(p.fcw[0])
    m.fp8.backward(0, FC, dfch, a.ln2.reshape(N, C), p.fcw[0], np.zeros((N, C), p.fcw.dtype), dwfc,
                   np.zeros(4 * C, np.float32), x8t=m._kept_x8t(0, FC, N), gelu_x2d=fch, then=later)
    assert dw.any() and dwfc.any()


def test_model_fp8_bad_input():
    cfg = GPT2Config.from_preset("micro")
    with pytest.raises(ValueError, match="bfloat16"):
        GPT2(cfg, dtype="float32", fp8="delayed")
    with pytest.raises(ValueError, match="mode"):
        GPT2(cfg, dtype="bfloat16", fp8="sometimes")
    m = GPT2(cfg, dtype="bfloat16", fp8="delayed")
    x, y = _tokens(cfg, 1, 15)
    with pytest.raises(ValueError, match="multiple of 16"):
        m.forward(x, y)


def test_fp8_supported_names_the_gpu(monkeypatch):
    from gpucore.ops import fp8 as fp8mod
    monkeypatch.setattr(fp8mod.runtime, "gpu_available", lambda: True)
    monkeypatch.setattr(fp8mod.runtime, "device_arch", lambda: "80")
    monkeypatch.setattr(fp8mod.runtime, "device_properties", lambda: {"name": b"NVIDIA A100-SXM4-80GB"})
    ok, why = fp8mod.fp8_supported()
    assert not ok and "A100" in why and "8.0" in why and "--dtype bf16" in why


def _train_args(shards, out, **kw):
    from gpucore.train import TrainArgs
    base = dict(model="tiny", device="cpu", batch_size=1, seq_len=16, steps=4, lr=1e-3, val_every=0,
                sample_every=0, data=str(shards), out_dir=str(out), dtype="fp8")
    return TrainArgs(**(base | kw))


@pytest.mark.parametrize("mode", ["delayed", "adaptive"])
def test_train_fp8_cpu_resumes_bit_identically(shards, tmp_path, mode):
    """--dtype fp8 on the NumPy backend: the scales travel in the checkpoint, so a resumed run
    continues exactly as the straight one."""
    from gpucore.checkpoint import load_checkpoint
    from gpucore.train import run
    lines = []
    with settings.using(fp8_fch_e4m3=True):      # adaptive: fch as E4M3, its delayed scales in the checkpoint
        straight = run(_train_args(shards, tmp_path / "a", ckpt_every=2, fp8_scaling=mode), echo=lines.append)
        assert any(f"FP8 linears ({mode} scaling)" in s for s in lines)
        assert all(np.isfinite(straight["losses"]))
        resumed = run(_train_args(shards, tmp_path / "b", resume=str(tmp_path / "a" / "ckpt_000002.ckpt"),
                                  dtype="auto"), echo=lambda s: None)     # the mode comes from the checkpoint
    assert resumed["losses"] == straight["losses"][2:]
    a, meta = load_checkpoint(tmp_path / "a" / "ckpt_000004.ckpt")
    assert meta["fp8"]["mode"] == mode and meta["fp8"]["step_index"] == 4 and "fp8_scale" in a
    # adaptive keeps fch as E4M3 with delayed scales of its own: they travel too
    assert ("fp8_fch_scale" in a and meta["fp8"]["fch"]["step_index"] == 4) == (mode == "adaptive")


def test_train_fp8_resume_keeps_the_saved_lm_head_and_says_so(shards, tmp_path):
    """A run saved with the FP8 LM head, resumed while settings.fp8_lm_head says off, resumes with
    the head on (the checkpoint's scaling state) and says so in one line."""
    from gpucore import settings
    from gpucore.train import run
    straight = run(_train_args(shards, tmp_path / "a", ckpt_every=2), echo=lambda s: None)
    lines = []
    with settings.using(fp8_lm_head=False):
        resumed = run(_train_args(shards, tmp_path / "b", resume=str(tmp_path / "a" / "ckpt_000002.ckpt"),
                                  dtype="auto"), echo=lines.append)
    assert any("resuming with the FP8 LM head on, as the checkpoint was saved" in s for s in lines)
    assert resumed["losses"] == straight["losses"][2:]


@pytest.mark.parametrize("saved", [False, True])
def test_train_fp8_resume_keeps_the_saved_fch_and_says_so(shards, tmp_path, saved):
    """fch's format (settings.fp8_fch_e4m3) is the checkpoint's on resume: a run saved with fch in
    bf16 (the default before the 72nd session) resumed under the other setting goes on in bf16, bit
    for bit the straight run, and says so in one line; the other way round too. The same setting
    resumes without the line."""
    from gpucore import settings
    from gpucore.train import run
    with settings.using(fp8_fch_e4m3=saved):
        straight = run(_train_args(shards, tmp_path / "a", ckpt_every=2), echo=lambda s: None)
    ckpt = str(tmp_path / "a" / "ckpt_000002.ckpt")
    for now in (not saved, saved):
        lines = []
        with settings.using(fp8_fch_e4m3=now):
            resumed = run(_train_args(shards, tmp_path / f"b{now}", resume=ckpt, dtype="auto"), echo=lines.append)
        said = [s for s in lines if s.startswith("resuming with fch")]
        word, other = ("E4M3", "bf16") if saved else ("bf16", "E4M3")
        assert said == ([f"resuming with fch (the GELU input kept for the backward) in {word}, as the checkpoint "
                         f"was saved (settings.fp8_fch_e4m3 says {other})"] if now != saved else [])
        assert resumed["losses"] == straight["losses"][2:]


@pytest.mark.cuda
def test_gpu_train_fp8_resume_keeps_the_saved_fch(shards, tmp_path):
    """The same on the GPU: saved with fch in bf16, resumed under fch as E4M3 (the default), bit for bit."""
    from gpucore import settings
    from gpucore.train import run
    _need_fp8()
    with settings.using(fp8_fch_e4m3=False):
        straight = run(_train_args(shards, tmp_path / "a", ckpt_every=2, device="cuda"), echo=lambda s: None)
    lines = []
    with settings.using(fp8_fch_e4m3=True):
        resumed = run(_train_args(shards, tmp_path / "b", resume=str(tmp_path / "a" / "ckpt_000002.ckpt"),
                                  dtype="auto", device="cuda"), echo=lines.append)
    assert any(s.startswith("resuming with fch (the GELU input kept for the backward) in bf16") for s in lines)
    assert resumed["losses"] == straight["losses"][2:]


def test_fp8_resume_settings_read_from_the_checkpoint():
    from gpucore.train import fp8_resume_settings
    cfg = GPT2Config.from_preset("tiny")
    n = 12 * cfg.num_layers
    assert fp8_resume_settings(cfg, None) == {} and fp8_resume_settings(cfg, {"params": np.zeros(3)}) == {}
    assert fp8_resume_settings(cfg, {"fp8_scale": np.zeros(n)}) == {"fp8_lm_head": False, "fp8_fch_e4m3": False}
    assert fp8_resume_settings(cfg, {"fp8_scale": np.zeros(n + 3), "fp8_fch_scale": np.zeros(2)}) == \
        {"fp8_lm_head": True, "fp8_fch_e4m3": True}


def test_train_fp8_adaptive_is_the_default(shards, tmp_path):
    from gpucore.train import run
    lines = []
    res = run(_train_args(shards, tmp_path / "f", steps=2), echo=lines.append)
    assert any("FP8 linears (adaptive scaling)" in s for s in lines) and all(np.isfinite(res["losses"]))


def test_train_fp8_errors_are_one_line(shards, tmp_path):
    from gpucore.train import TrainError, run
    with pytest.raises(TrainError, match="multiple of 16"):
        run(_train_args(shards, tmp_path / "c", seq_len=15), echo=lambda s: None)
    run(_train_args(shards, tmp_path / "d", steps=2, dtype="bf16"), echo=lambda s: None)
    with pytest.raises(TrainError, match="trained in bfloat16"):
        run(_train_args(shards, tmp_path / "e", resume=str(tmp_path / "d"), dtype="fp8"), echo=lambda s: None)


@pytest.mark.cuda
@pytest.mark.parametrize("mode,lm_head", [("delayed", False), ("adaptive", False), ("current", False),
                                          ("adaptive", True)])
def test_gpu_model_fp8_close_to_bf16_and_deterministic(mode, lm_head):
    """lm_head: settings.fp8_lm_head (the LM head's GEMMs in FP8 too; E5M2 dlnf: looser gradients)."""
    from gpucore import settings
    _need_fp8()
    cp = runtime.cupy
    cfg = GPT2Config.from_preset("tiny")
    x, y = _tokens(cfg, 4, 64)
    l16, g16, _ = _model_grads(cfg, cp, x, y, None)
    with settings.using(fp8_lm_head=lm_head):
        l8, g8, _ = _model_grads(cfg, cp, x, y, mode)
        l8b, g8b, _ = _model_grads(cfg, cp, x, y, mode)
        # the NumPy references agree with the GPU's FP8 path (the same casts; GEMM rounding apart)
        l8n, g8n, _ = _model_grads(cfg, np, x, y, mode)
    assert abs(l8 - l16) < 1e-2 * l16
    assert np.isfinite(g8).all() and rel_err(g8, g16) < (0.2 if lm_head else 0.15)
    assert l8 == l8b and g8.tobytes() == g8b.tobytes()
    # 6e-2: the residual adds moved into the projections' GEMM epilogues (one rounding, fast FP8
    # accumulation before it) read 0.0503 on an H100 (adaptive + FP8 LM head)
    assert abs(l8 - l8n) < 2e-3 * l8n and rel_err(g8, g8n) < 6e-2


# ------------------------------------------------------- the FP8 LM head ----

def _head_grads(cfg, xp, x, y, lm_head):
    from gpucore import settings
    with settings.using(fp8_lm_head=lm_head):
        return _model_grads(cfg, xp, x, y, "adaptive")


def test_model_fp8_lm_head_numpy_close_to_bf16():
    """settings.fp8_lm_head: logits and dlnf from FP8 GEMMs (NumPy references); the loss stays
    within 1% of bf16's and the gradients within E5M2 precision; the head's three scaling slots
    follow the layers' (x E4M3, W E4M3, dlogits E5M2 at the fixed power-of-two scale)."""
    from gpucore.ops.classifier import dlogits_fp8_scale
    cfg = GPT2Config.from_preset("micro")
    x, y = _tokens(cfg, 2, 16)
    l16, g16, _ = _model_grads(cfg, np, x, y, None)
    l8, g8, m8 = _head_grads(cfg, np, x, y, False)
    lh, gh, mh = _head_grads(cfg, np, x, y, True)
    assert abs(lh - l16) < 1e-2 * l16
    assert np.isfinite(gh).all() and rel_err(gh, g16) < 0.2
    assert (lh, gh.tobytes()) != (l8, g8.tobytes())      # the head really ran in FP8
    L = cfg.num_layers
    assert m8.fp8.scaling.n == 12 * L and mh.fp8.scaling.n == 12 * L + 3
    s = mh.fp8.scaling
    assert s.formats[12 * L:] == ["e4m3", "e4m3", "e5m2"]
    assert float(s.scale[12 * L + 2]) == dlogits_fp8_scale(1.0 / x.size)


def _head_dwte_grads(cfg, xp, x, y, dwte):
    """(grads without wte's, wte's grad, loss) with the FP8 head, its dwte GEMM in FP8 or bf16."""
    from gpucore import settings
    with settings.using(fp8_lm_head=True, fp8_lm_head_dwte=dwte, fp8_lm_head_sparse=0.0):   # dwte's source alone
        loss, g, m = _model_grads(cfg, xp, x, y, "adaptive")
    start = m.grads.layout.offsets["wte"] // m.grads.wte.itemsize
    mask = np.ones(g.size, bool)
    mask[start:start + m.grads.wte.size] = False
    return g[mask], g[~mask], loss


@pytest.mark.parametrize("device", ["numpy", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_model_fp8_lm_head_dwte_changes_only_dwte(device):
    """settings.fp8_lm_head_dwte: dwte from the E5M2 dlogits (transposed per chunk) instead of the
    bf16 ones. Nothing but wte's gradient reads it, so every other gradient and the loss are bitwise
    those of the bf16-dwte head; wte's stays within E5M2 precision of it (and differs: it ran)."""
    if device == "cuda":
        _need_fp8()
    xp = np if device == "numpy" else runtime.cupy
    cfg = GPT2Config.from_preset("micro" if xp is np else "tiny")
    x, y = _tokens(cfg, 2 if xp is np else 4, 16 if xp is np else 64)
    rest8, wte8, l8 = _head_dwte_grads(cfg, xp, x, y, True)
    rest16, wte16, l16 = _head_dwte_grads(cfg, xp, x, y, False)
    assert l8 == l16 and rest8.tobytes() == rest16.tobytes()
    assert np.isfinite(wte8).all() and wte8.tobytes() != wte16.tobytes()
    assert rel_err(wte8, wte16) < 0.1


@pytest.mark.parametrize("fast", [True, False])
def test_fp8_fast_accumulation_only_where_the_settings_say(monkeypatch, fast):
    """Forward GEMMs and (settings.fp8_fast_accum_dgrad) the linears' dx GEMMs take Hopper's fast
    accumulation; every weight gradient (K = tokens) and the LM head's dlnf keep it exact."""
    from gpucore import settings
    import gpucore.fp8_linear as fl
    cfg = GPT2Config.from_preset("micro")
    x, y = _tokens(cfg, 2, 16)
    calls = []
    real = fl.fp8_matmul

    def spy(a8, b8, a_fmt, b_fmt, *args, **kwargs):
        calls.append((a_fmt, kwargs.get("accumulate", False), kwargs.get("fast_accum", False), b8.shape))
        return real(a8, b8, a_fmt, b_fmt, *args, **kwargs)

    monkeypatch.setattr(fl, "fp8_matmul", spy)
    with settings.using(fp8_fast_accum_dgrad=fast, fp8_lm_head=True):
        _model_grads(cfg, np, x, y, "adaptive")
    L, Vp = cfg.num_layers, cfg.padded_vocab_size
    fwd = [c for c in calls if c[0] == "e4m3"]
    dw = [c for c in calls if c[0] == "e5m2" and c[1]]
    dx = [c for c in calls if c[0] == "e5m2" and not c[1]]
    assert len(fwd) == 4 * L + 1 and all(c[2] for c in fwd)
    assert len(dw) == 4 * L + 1 and not any(c[2] for c in dw)          # + the head's dwte
    assert len(dx) == 4 * L + 1
    assert dx[0][3] == (cfg.channels, Vp) and not dx[0][2]              # the head's dlnf (b = wte8T) runs first
    assert all(c[2] == fast for c in dx[1:])


def test_resume_keeps_the_checkpoints_fp8_lm_head():
    """A training resumed from an FP8 checkpoint takes the LM head's precision from the checkpoint
    (its scaling state: 12 tensors per layer, + 3 with the FP8 head), whatever settings.fp8_lm_head
    says now."""
    from gpucore.fp8_linear import Fp8Linears
    from gpucore.train import saved_fp8_lm_head
    cfg = GPT2Config.from_preset("micro")
    for head in (False, True):
        st = Fp8Linears(cfg, np, mode="adaptive", lm_head=head).scaling.state()
        assert saved_fp8_lm_head(cfg, {"fp8_scale": st["scale"]}) is head
    assert saved_fp8_lm_head(cfg, {"params": np.zeros(3)}) is None and saved_fp8_lm_head(cfg, None) is None


def test_model_fp8_lm_head_plans_its_scratch_and_checks_resumed_state():
    from gpucore.model import memory_plan
    from gpucore.fp8_linear import Fp8Linears
    cfg = GPT2Config.from_preset("tiny")
    off = memory_plan(cfg, 4, 64, "bfloat16", fp8=True, fp8_lm_head=False)
    on = memory_plan(cfg, 4, 64, "bfloat16", fp8=True, fp8_lm_head=True)
    N, C, Vp = 4 * 64, cfg.channels, cfg.padded_vocab_size
    assert on["fp8 scratch"] - off.get("fp8 scratch", 0) == N * C + 2 * Vp * C + N * Vp
    saved = Fp8Linears(cfg, np, mode="adaptive", lm_head=False).scaling.state()
    with pytest.raises(ValueError, match="fp8_lm_head must be what the saving run had"):
        Fp8Linears(cfg, np, mode="adaptive", lm_head=True).scaling.load_state(saved)


@pytest.mark.cuda
@pytest.mark.parametrize("R,C", [(1040, 784), (4096, 3072), (16384, 768)])
def test_gpu_gated_recast_on_its_capped_grid_is_the_cast(rng, R, C):
    """The gated re-cast runs on a grid of a few blocks per SM that walk the tiles in a loop: on a
    nonzero gate its bytes (both orientations) are fp8_quantize's; on a zero gate nothing is written."""
    from gpucore.ops.fp8 import _grid, fp8_requantize_gated
    _need_fp8()
    cp = runtime.cupy
    assert _grid(R, C, True)[1] < _grid(R, C, False)[1] or R <= 1040     # the loop really runs
    x = cp.asarray(_bf16(rng, (R, C)))
    scale = cp.asarray([50.0], F32)
    q, qt = fp8_quantize(x, "e4m3", scale, out=cp.empty((R, C), np.uint8), out_t=cp.empty((C, R), np.uint8))
    out, out_t = cp.zeros((R, C), np.uint8), cp.zeros((C, R), np.uint8)
    fp8_requantize_gated(x, "e4m3", scale, cp.zeros(1, F32), out=out, out_t=out_t)
    assert not bool(out.any()) and not bool(out_t.any())
    fp8_requantize_gated(x, "e4m3", scale, cp.ones(1, F32), out=out, out_t=out_t)
    assert to_cpu(out).tobytes() == to_cpu(q).tobytes() and to_cpu(out_t).tobytes() == to_cpu(qt).tobytes()


# ---------------------------------------------- GELU + cast (fcproj's input) ----

def test_gelu_quantize_numpy_is_gelu_then_the_cast(rng):
    from gpucore.ops.fp8 import fp8_gelu_quantize, fp8_gelu_quantize_gated
    from gpucore.ops.gelu import gelu
    x = _bf16(rng, (32, 48), 3.0)
    scale = np.asarray([40.0], F32)
    want, want_t = fp8_quantize(gelu(x), "e4m3", scale, out=np.zeros((32, 48), np.uint8),
                                out_t=np.zeros((48, 32), np.uint8))
    am = np.zeros(1, F32)
    got, got_t = fp8_gelu_quantize(x, scale, out=np.zeros((32, 48), np.uint8), out_t=np.zeros((48, 32), np.uint8),
                                   amax=am)
    assert got.tobytes() == want.tobytes() and got_t.tobytes() == want_t.tobytes()
    assert am[0] == np.abs(gelu(x).astype(np.float32)).max()
    out = np.zeros((32, 48), np.uint8)
    fp8_gelu_quantize_gated(x, scale, np.zeros(1, F32), out=out)
    assert not out.any()


@pytest.mark.cuda
@pytest.mark.parametrize("R,C", [(64, 64), (1040, 784), (4096, 3072)])
def test_gpu_gelu_quantize_is_bitwise_the_gelu_kernel_then_the_cast(rng, R, C):
    """fp8_gelu_quantize's bytes (both orientations) and amax are gelu (bf16 kernel) + fp8_quantize's;
    its gated re-run (capped grid) writes the same bytes on a nonzero gate and nothing on zero."""
    from gpucore.ops.fp8 import fp8_gelu_quantize, fp8_gelu_quantize_gated
    from gpucore.ops.gelu import gelu
    _need_fp8()
    cp = runtime.cupy
    x = cp.asarray(_bf16(rng, (R, C), 3.0))
    scale = cp.asarray([40.0], F32)
    am_want, am_got = cp.zeros(1, F32), cp.zeros(1, F32)
    q, qt = fp8_quantize(gelu(x), "e4m3", scale, out=cp.empty((R, C), np.uint8), out_t=cp.empty((C, R), np.uint8),
                         amax=am_want)
    g, gt = fp8_gelu_quantize(x, scale, out=cp.empty((R, C), np.uint8), out_t=cp.empty((C, R), np.uint8), amax=am_got)
    assert to_cpu(g).tobytes() == to_cpu(q).tobytes() and to_cpu(gt).tobytes() == to_cpu(qt).tobytes()
    assert float(am_got[0]) == float(am_want[0])
    out, out_t = cp.zeros((R, C), np.uint8), cp.zeros((C, R), np.uint8)
    fp8_gelu_quantize_gated(x, scale, cp.zeros(1, F32), out=out, out_t=out_t)
    assert not bool(out.any()) and not bool(out_t.any())
    fp8_gelu_quantize_gated(x, scale, cp.ones(1, F32), out=out, out_t=out_t)
    assert to_cpu(out).tobytes() == to_cpu(q).tobytes() and to_cpu(out_t).tobytes() == to_cpu(qt).tobytes()


def test_fp8_tile_geometry_matches_the_kernels():
    """ops/fp8.py sizes the launch grids from constants that must equal fp8.cu's compiled-in tile
    geometry (a mismatch leaves tiles uncast or writes past the bias partials)."""
    import re
    from pathlib import Path
    from gpucore.ops import fp8
    src = (Path(runtime.KERNEL_DIR) / "fp8.cu").read_text()
    for macro, value in (("CAST_ROWS", fp8.CAST_ROWS), ("GELU_BWD_ROWS", fp8.GELU_BWD_ROWS),
                         ("TRANSPOSE_CT", fp8.TRANSPOSE_TILES), ("TILE", fp8.TILE)):
        m = re.search(rf"#define {macro} (\d+)", src)
        assert m and int(m.group(1)) == value, macro


@pytest.mark.parametrize("device", ["numpy", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_model_fp8_lm_head_sparse_dlogits(device):
    """settings.fp8_lm_head_sparse: the E5M2 dlogits thinned without bias. The forward is untouched
    (the loss bit for bit), the gradients stay near the dense ones and are deterministic, and the
    seed the kernel reads is the scaling's step count after end_step."""
    from gpucore import settings
    from gpucore.ops.classifier import sparse_tau_of
    if device == "cuda":
        _need_fp8()
    xp = runtime.cupy if device == "cuda" else np
    cfg = GPT2Config.from_preset("micro" if device == "numpy" else "tiny")
    x, y = _tokens(cfg, 2 if device == "numpy" else 4, 16 if device == "numpy" else 64)
    # micro's 61 tokens: probabilities ~1/61, half of them thinned; tiny's 50257 at initialization:
    # every probability (~2e-5) below 2^-13, all thinned -- the worst case (0.046 in NumPy)
    prob = 2.0 ** -6 if device == "numpy" else 2.0 ** -13
    with settings.using(fp8_lm_head=True, fp8_lm_head_dwte=True):
        with settings.using(fp8_lm_head_sparse=0.0):
            ld, gd, _ = _model_grads(cfg, xp, x, y, "adaptive")
        with settings.using(fp8_lm_head_sparse=prob):
            ls, gs, m = _model_grads(cfg, xp, x, y, "adaptive")
            ls2, gs2, _ = _model_grads(cfg, xp, x, y, "adaptive")
    assert ls == ld and gs.tobytes() == gs2.tobytes() and ls2 == ls
    assert gs.tobytes() != gd.tobytes() and np.isfinite(gs).all()
    assert rel_err(gs, gd) < 0.08         # the FP8 head alone is 0.2 from bf16 (test above)
    assert m.fp8.head_sparse == prob and int(to_cpu(m.head_seed)[0]) == m.steps_done == m.fp8.scaling.step_index == 1
    grad_scale = 1.0 / x.size
    s8 = float(m.fp8.scaling.scale[12 * cfg.num_layers + 2])
    assert m.fp8.head_sparse_tau == sparse_tau_of(prob, grad_scale, s8)
    assert np.log2(m.fp8.head_sparse_tau) == round(np.log2(prob * grad_scale * s8))
    with settings.using(fp8_lm_head=True, fp8_lm_head_dwte=False, fp8_lm_head_sparse=prob):
        assert GPT2(cfg, xp=xp, dtype="bfloat16", seed=9, fp8="adaptive").fp8.head_sparse == 0.0
    with settings.using(fp8_lm_head_sparse=-1.0), pytest.raises(ValueError, match="fp8_lm_head_sparse"):
        GPT2(cfg, xp=xp, dtype="bfloat16", seed=9, fp8="adaptive")


@pytest.mark.parametrize("device", ["numpy", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_model_bf16_lm_head_sparse_dlogits(device):
    """settings.bf16_lm_head_sparse: the bf16 head's dlogits thinned without bias. The loss is bit
    for bit the dense one, the gradients near it and deterministic; each step draws anew."""
    from gpucore import settings
    xp = runtime.cupy if device == "cuda" else np
    cfg = GPT2Config.from_preset("micro" if device == "numpy" else "tiny")
    x, y = _tokens(cfg, 2 if device == "numpy" else 4, 16 if device == "numpy" else 64)
    prob = 2.0 ** -6 if device == "numpy" else 2.0 ** -13
    ld, gd, _ = _model_grads(cfg, xp, x, y, None)
    with settings.using(bf16_lm_head_sparse=prob):
        ls, gs, m = _model_grads(cfg, xp, x, y, None)
        ls2, gs2, _ = _model_grads(cfg, xp, x, y, None)
        m.zero_grad()
        m.forward(xp.asarray(x), xp.asarray(y), for_backward=True)   # step 1's draws
        m.backward()
        g_next = to_cpu(m.grads.flat()).astype(np.float64)
    assert ls == ld and ls2 == ls and gs.tobytes() == gs2.tobytes()
    assert gs.tobytes() != gd.tobytes() and np.isfinite(gs).all() and rel_err(gs, gd) < 0.08
    assert g_next.tobytes() != gs.tobytes() and rel_err(g_next, gd) < 0.08
    assert m.bf16_head_sparse == prob and m.steps_done == 1
    with settings.using(bf16_lm_head_sparse=prob):    # float32 models keep dense dlogits
        assert GPT2(cfg, xp=xp, dtype="float32", seed=9).bf16_head_sparse == 0.0


@pytest.mark.parametrize("device", ["numpy", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("fp8", [None, "adaptive"])
def test_thinned_dlogits_draw_anew_for_each_micro_batch(device, fp8):
    """GPT2.set_micro_batch: each micro-batch of a step (over all ranks) draws its own thinning
    thresholds, so the same rows of two micro-batches do not share their errors; micro-batch 0 draws
    by the step count alone (one-GPU runs without accumulation unchanged), and going back to an
    index draws its bits again."""
    from gpucore.model import head_draw_seed
    if device == "cuda" and fp8:
        _need_fp8()
    xp = runtime.cupy if device == "cuda" else np
    cfg = GPT2Config.from_preset("micro" if device == "numpy" else "tiny")
    x, y = _tokens(cfg, 2 if device == "numpy" else 4, 16 if device == "numpy" else 64)
    prob = 2.0 ** -6 if device == "numpy" else 2.0 ** -13
    thin = {"fp8_lm_head": True, "fp8_lm_head_dwte": True, "fp8_lm_head_sparse": prob} if fp8 else \
        {"bf16_lm_head_sparse": prob}
    with settings.using(**thin):
        m = GPT2(cfg, xp=xp, dtype="bfloat16", seed=9, fp8=fp8)
        m.set_step(5)

        def grads(index):
            m.set_micro_batch(index)
            assert int(to_cpu(m.head_seed)[0]) == head_draw_seed(5, index)
            m.zero_grad()
            m.forward(xp.asarray(x), xp.asarray(y), for_backward=True)
            m.backward()
            return to_cpu(m.grads.flat()).astype(np.float64)
        g0, g1, g2, g0_again = grads(0), grads(1), grads(2), grads(0)
    assert head_draw_seed(5, 0) == 5 and len({head_draw_seed(s, k) for s in range(50) for k in range(50)}) == 2500
    assert g0.tobytes() == g0_again.tobytes()
    assert g1.tobytes() != g0.tobytes() and g2.tobytes() != g1.tobytes() and g2.tobytes() != g0.tobytes()
    assert np.isfinite(g1).all() and rel_err(g1, g0) < 0.1   # the same gradient, another draw


def test_train_step_numbers_micro_batches_over_ranks():
    """train_step hands each micro-batch its index over all ranks (rank * grad_accum + i), so that
    ranks and micro-batches of one step draw apart (the test above)."""
    from types import SimpleNamespace
    from gpucore.optim import AdamW
    from gpucore.train import train_step
    cfg = GPT2Config.from_preset("micro")
    x, y = _tokens(cfg, 1, 8)
    for rank, accum, want in ((0, 1, [0]), (0, 3, [0, 1, 2]), (2, 3, [6, 7, 8])):
        m = GPT2(cfg, xp=np, dtype="float32", seed=1)
        seen = []
        real = m.set_micro_batch
        m.set_micro_batch = lambda i: (seen.append(i), real(i))
        reducer = SimpleNamespace(overlap=False, comm=SimpleNamespace(rank=rank), finish=lambda: None,
                                  layer_done=lambda layer: None)
        train_step(m, AdamW(m), lambda: (x, y), accum, 1e-3, reducer=reducer if rank else None)
        assert seen == want + [0], (rank, accum, seen)     # then end_step: the next step's first


# ------------------------------------------------- fch kept as E4M3 (fp8_fch_e4m3) ----

def _x8_case(rng, R, C, xp):
    """E4M3 bytes of a GELU input (fch) with its scale_inv, and the bf16 values kernels read them as."""
    from gpucore.ops.fp8 import fp8_dequantize_bf16
    x = _bf16(rng, (R, C), 2.0)
    x8 = fp8_quantize_reference(x, "e4m3", 448.0 / 8.0)
    si = F32(8.0 / 448.0)
    return xp.asarray(x8), xp.asarray(np.array([si], F32)), xp.asarray(fp8_dequantize_bf16(x8, si))


def test_dequantize_bf16_is_the_fp32_product_rounded(rng):
    """fp8_dequantize_bf16: every E4M3 byte times scale_inv in fp32, rounded to bf16 (nearest even);
    the NaN bytes stay NaN."""
    from gpucore.ops.fp8 import fp8_dequantize_bf16
    q = np.arange(256, dtype=np.uint8).reshape(16, 16)
    si = F32(0.0123)
    got = fp8_dequantize_bf16(q, si)
    want = (q.view(ml_dtypes.float8_e4m3fn).astype(F32) * si).astype(bfloat16)
    assert got.dtype == bfloat16 and got.tobytes() == want.tobytes()
    assert np.isnan(got.astype(F32)).sum() == 2 and got.astype(F32)[0, 1] == np.float32(2.0 ** -9 * si).astype(bfloat16)   # subnormal


def test_gelu_kernels_x8_numpy_read_the_dequantized_values(rng):
    """NumPy: the GELU cast and the GELU backward given E4M3 x with x_scale_inv are their bf16 selves
    on fp8_dequantize_bf16(x): bytes, amax, bias sums, gelu_t, gates; x's dtype must match."""
    from gpucore.ops.fp8 import fp8_gelu_quantize, fp8_gelu_quantize_gated
    x8, si, xd = _x8_case(rng, 48, 32, np)
    dout = _bf16(rng, (48, 32), 1e-3)
    s = np.array([40.0], F32)
    outs = []
    for x, kw in ((x8, dict(x_scale_inv=si)), (xd, {})):
        q, qt, am = np.zeros((48, 32), np.uint8), np.zeros((32, 48), np.uint8), np.zeros(1, F32)
        fp8_gelu_quantize(x, s, out=q, out_t=qt, amax=am, **kw)
        g, gt, gam, db, gelt = (np.zeros((48, 32), np.uint8), np.zeros((32, 48), np.uint8), np.zeros(1, F32),
                                np.zeros(32, F32), np.zeros((32, 48), np.uint8))
        fp8_gelu_backward(dout, x, np.array([3000.0], F32), out=g, out_t=gt, amax=gam, dbias=db, gelu_t=gelt,
                          gelu_scale=s, **kw)
        gated = np.zeros((48, 32), np.uint8)
        fp8_gelu_quantize_gated(x, s, np.zeros(1, F32), out=gated, **kw)
        assert not gated.any()
        fp8_gelu_backward_gated(dout, x, s, np.ones(1, F32), out=gated, **kw)
        outs.append((q, qt, am, g, gt, gam, db, gelt, gated))
    for a, b in zip(*outs):
        assert a.tobytes() == b.tobytes()
    assert outs[0][0].any() and outs[0][3].any()
    with pytest.raises((TypeError, ValueError), match="x"):
        fp8_gelu_quantize(xd, s, out=np.zeros((48, 32), np.uint8), x_scale_inv=si)      # bf16 x with a scale
    with pytest.raises((TypeError, ValueError), match="x"):
        fp8_gelu_backward(dout, x8, s, out=np.zeros((48, 32), np.uint8))             # E4M3 x without its scale


def test_matmul_e4m3_out_reference_and_bad_input(rng):
    """fp8_matmul(out_scale=): out gets the E4M3 bytes of the float32 result times out_scale
    (saturating), out_amax max |result| (set, not folded); not with accumulate / gelu_out / residual."""
    a, b, bias = _bf16(rng, (32, 64)), _bf16(rng, (48, 64), 0.05), _bf16(rng, (48,))
    a8, b8 = fp8_quantize_reference(a, "e4m3", 64.0), fp8_quantize_reference(b, "e4m3", 2048.0)
    sa, sb = np.array([1 / 64], F32), np.array([1 / 2048], F32)
    r = fp8_matmul_reference(a8, b8, "e4m3", "e4m3", 1 / 64, 1 / 2048, bias).astype(F32)
    out, amax = np.zeros((32, 48), np.uint8), np.full(1, 7.0, F32)
    fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, out=out, bias=bias, out_scale=np.array([50.0], F32), out_amax=amax)
    assert out.tobytes() == fp8_quantize_reference(r, "e4m3", 50.0).tobytes()
    assert amax[0] == np.abs(r).max()
    big = fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, bias=bias, out_scale=np.array([1e6], F32))
    assert big.dtype == np.uint8 and set(np.unique(big & 0x7F)) <= {0, 0x7E} | set(range(0x7E))
    assert (big & 0x7F).max() == 0x7E                                          # 448: saturated, not NaN
    for kw in (dict(accumulate=True, out=out), dict(residual=_bf16(rng, (32, 48)))):
        with pytest.raises(ValueError, match="out_scale"):
            fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, out_scale=np.ones(1, F32), **kw)
    with pytest.raises(ValueError, match="out_amax"):
        fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, out_amax=np.zeros(1, F32))
    with pytest.raises((TypeError, ValueError), match="out"):
        fp8_matmul(a8, b8, "e4m3", "e4m3", sa, sb, out=np.zeros((32, 48), bfloat16), out_scale=np.ones(1, F32))


def _fch_run(xp, fch8, mode="adaptive", steps=2):
    """Two training steps of the tiny model in FP8 with settings.fp8_fch_e4m3 = fch8: (losses, grads,
    model)."""
    cfg = GPT2Config.from_preset("tiny")
    x, y = _tokens(cfg, 4, 64)
    with settings.using(fp8_fch_e4m3=fch8):
        m = GPT2(cfg, xp=xp, dtype="bfloat16", seed=9, fp8=mode)
        losses = []
        for _ in range(steps):
            m.zero_grad()
            losses.append(float(m.forward(xp.asarray(x), xp.asarray(y), for_backward=True)))
            m.backward()
            m.end_step()
    return losses, to_cpu(m.grads.flat()).astype(np.float64), m


def test_model_fp8_fch_e4m3_numpy():
    """NumPy: with adaptive scaling fch is kept as E4M3 (uint8 activations) with delayed scales of its
    own, set from the fc GEMM's amax at end_step; losses and gradients stay close to bf16 fch's (one
    more E4M3 rounding, of GELU's input); other scaling modes keep bf16 fch."""
    l8, g8, m8 = _fch_run(np, True)
    l16, g16, m16 = _fch_run(np, False)
    assert m8.acts.fch.dtype == np.uint8 and m16.acts.fch.dtype == bfloat16 and m16.fp8.fch_scaling is None
    fs = m8.fp8.fch_scaling
    scale = np.asarray(fs.scale)
    assert fs.mode == "delayed" and np.all(scale != 1.0) and np.all(np.isfinite(scale))
    L = m8.config.num_layers
    amax = np.asarray(fs.history).max(axis=0)
    assert np.allclose(scale, 448.0 / amax * 2.0 ** -settings.current().fp8_fch_margin, rtol=1e-6) and len(scale) == L
    assert all(abs(a - b) < 1e-2 * b for a, b in zip(l8, l16))
    assert rel_err(g8, g16) < 0.1
    _, _, mc = _fch_run(np, True, mode="current", steps=1)
    assert mc.acts.fch.dtype == bfloat16 and mc.fp8.fch_scaling is None


def test_model_fp8_fch_choice_is_the_models():
    """fch's dtype follows the model's FP8 linears (decided when they were built), not the settings
    when the buffers are allocated: a model built with fp8_fch_e4m3 and first run outside it keeps fch
    as E4M3, with the losses of a run made wholly inside it; and the other way round."""
    cfg = GPT2Config.from_preset("tiny")
    x, y = _tokens(cfg, 4, 64)
    for fch8 in (True, False):
        with settings.using(fp8_fch_e4m3=fch8):
            m = GPT2(cfg, xp=np, dtype="bfloat16", seed=9, fp8="adaptive")
        with settings.using(fp8_fch_e4m3=not fch8):
            m.zero_grad()
            loss = float(m.forward(x, y, for_backward=True))
            plan = m.memory_plan(4, 64)
        assert m.acts.fch.dtype == (np.uint8 if fch8 else bfloat16)
        mine, other = (memory_plan(cfg, 4, 64, "bfloat16", keep_gelu=m.keep_gelu, fp8="adaptive", fp8_fch=f)
                       for f in (fch8, not fch8))
        assert plan["activations"] == mine["activations"] != other["activations"]
        assert loss == _fch_run(np, fch8, steps=1)[0][0]


@pytest.mark.cuda
@pytest.mark.parametrize("R,C", [(64, 64), (1040, 784), (4096, 3072)])
def test_gpu_gelu_kernels_x8_bitwise(rng, R, C):
    """GPU: the _x8 GELU cast and GELU backward write the bytes, amax, gelu_t and (to float32
    rounding) bias sums of their bf16 kernels on the dequantized x, bit for bit; gated alike."""
    from gpucore.ops.fp8 import fp8_gelu_quantize, fp8_gelu_quantize_gated
    _need_fp8()
    cp = runtime.cupy
    x8, si, xd = _x8_case(rng, R, C, cp)
    dout = cp.asarray(_bf16(rng, (R, C), 1e-3))
    s, gs = cp.asarray([40.0], F32), cp.asarray([3000.0], F32)
    res = []
    for x, kw in ((x8, dict(x_scale_inv=si)), (xd, {})):
        q, qt, am = cp.zeros((R, C), np.uint8), cp.zeros((C, R), np.uint8), cp.zeros(1, F32)
        fp8_gelu_quantize(x, s, out=q, out_t=qt, amax=am, **kw)
        g, gt, gam, db, gelt = (cp.zeros((R, C), np.uint8), cp.zeros((C, R), np.uint8), cp.zeros(1, F32),
                                cp.zeros(C, F32), cp.zeros((C, R), np.uint8))
        fp8_gelu_backward(dout, x, gs, out=g, out_t=gt, amax=gam, dbias=db, gelu_t=gelt, gelu_scale=s, **kw)
        q0, g0 = cp.zeros((R, C), np.uint8), cp.zeros((R, C), np.uint8)
        fp8_gelu_quantize_gated(x, s, cp.zeros(1, F32), out=q0, **kw)
        fp8_gelu_backward_gated(dout, x, gs, cp.zeros(1, F32), out=g0, **kw)
        assert not bool(q0.any()) and not bool(g0.any())
        q1, g1 = cp.zeros((R, C), np.uint8), cp.zeros((R, C), np.uint8)
        fp8_gelu_quantize_gated(x, s, cp.ones(1, F32), out=q1, **kw)
        fp8_gelu_backward_gated(dout, x, gs, cp.ones(1, F32), out=g1, **kw)
        res.append([to_cpu(a) for a in (q, qt, am, g, gt, gam, gelt, q1, g1, db)])
    for k, (a, b) in enumerate(zip(res[0][:-1], res[1][:-1])):
        bad = np.argwhere(a != b)
        assert len(bad) == 0, f"output {k}: {len(bad)} values differ, first at {tuple(bad[0])}"
    assert res[0][0].any() and res[0][3].any()
    assert np.array_equal(res[0][7], res[0][0]) and np.array_equal(res[0][8], res[0][3])
    assert rel_err(res[0][-1].astype(np.float64), res[1][-1].astype(np.float64)) < 1e-5
    # and both against the NumPy reference of the E4M3 input
    want = np.zeros((R, C), np.uint8)
    fp8_gelu_quantize(to_cpu(x8), np.array([40.0], F32), out=want, x_scale_inv=to_cpu(si))
    assert np.array_equal(res[0][0], want)


@pytest.mark.cuda
@pytest.mark.parametrize("M,N,K", [(64, 48, 96), (4096, 3072, 768), (1024, 6400, 1600)])
def test_gpu_matmul_e4m3_out(rng, M, N, K):
    """GPU: cuBLASLt's E4M3 output (fc's fch) against the reference cast of the float32 result: the
    dequantized values within E4M3 rounding plus fast accumulation, >= 90% of the bytes equal, amax
    within 1%, saturation to 448 (never NaN), deterministic."""
    from gpucore.ops.fp8 import fp8_dequantize
    _need_fp8()
    cp = runtime.cupy
    a, b, bias = _bf16(rng, (M, K)), _bf16(rng, (N, K), 0.05), _bf16(rng, (N,))
    a8, b8 = fp8_quantize_reference(a, "e4m3", 100.0), fp8_quantize_reference(b, "e4m3", 2000.0)
    sia, sib = cp.asarray([1 / 100], F32), cp.asarray([1 / 2000], F32)
    r = fp8_matmul_reference(a8, b8, "e4m3", "e4m3", 1 / 100, 1 / 2000, bias).astype(F32)
    scale = F32(224.0 / np.abs(r).max())
    out, amax = cp.full((M, N), 0xAB, np.uint8), cp.zeros(1, F32)
    fp8_matmul(cp.asarray(a8), cp.asarray(b8), "e4m3", "e4m3", sia, sib, out=out, bias=cp.asarray(bias),
               fast_accum=True, out_scale=cp.asarray([scale]), out_amax=amax)
    got, want = to_cpu(out), fp8_quantize_reference(r, "e4m3", scale)
    assert (got == want).mean() > 0.9
    assert rel_err(fp8_dequantize(got, "e4m3", 1 / scale).astype(np.float64), r.astype(np.float64)) < 0.05
    assert abs(float(amax[0]) - np.abs(r).max()) < 1e-2 * np.abs(r).max()
    again = cp.zeros((M, N), np.uint8)
    fp8_matmul(cp.asarray(a8), cp.asarray(b8), "e4m3", "e4m3", sia, sib, out=again, bias=cp.asarray(bias),
               fast_accum=True, out_scale=cp.asarray([scale]), out_amax=amax)
    assert to_cpu(again).tobytes() == got.tobytes()
    fp8_matmul(cp.asarray(a8), cp.asarray(b8), "e4m3", "e4m3", sia, sib, out=again, bias=cp.asarray(bias),
               fast_accum=True, out_scale=cp.asarray([scale * 64]))
    sat = to_cpu(again) & 0x7F
    assert sat.max() == 0x7E and (sat == 0x7E).mean() > 0.05           # 448, not NaN (0x7F)


@pytest.mark.cuda
def test_gpu_model_fp8_fch_e4m3_close_and_deterministic():
    """GPU: FP8 training steps with fch kept as E4M3 stay close to bf16 fch's, repeat bit for bit, and
    agree with the NumPy references (the same casts; GEMM rounding apart)."""
    _need_fp8()
    cp = runtime.cupy
    l8, g8, m8 = _fch_run(cp, True)
    l8b, g8b, _ = _fch_run(cp, True)
    l16, g16, _ = _fch_run(cp, False)
    l8n, g8n, _ = _fch_run(np, True)
    assert m8.acts.fch.dtype == np.uint8
    assert l8 == l8b and g8.tobytes() == g8b.tobytes()
    assert all(abs(a - b) < 1e-2 * b for a, b in zip(l8, l16)) and rel_err(g8, g16) < 0.1
    assert all(abs(a - b) < 2e-3 * b for a, b in zip(l8, l8n)) and rel_err(g8, g8n) < 6e-2
