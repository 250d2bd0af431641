"""gpucore.adamw_update / grad_norm: reference vs an independent formulation, GPU vs reference, bad input."""
import math

import numpy as np
import pytest

import gpucore
from gpucore import runtime
from gpucore.ops.adamw import adamw_reference, decay_boundaries, grad_norm_reference
from conftest import rel_err, to_cpu

GRAD_DTYPES = [np.float32, gpucore.bfloat16]


def _state(rng, n, grad_dtype=np.float32):
    params = rng.standard_normal(n).astype(np.float32)
    grads = (rng.standard_normal(n) * 0.1).astype(grad_dtype)
    m = (rng.standard_normal(n) * 0.01).astype(np.float32)
    v = (rng.random(n) * 1e-3).astype(np.float32)
    return params, grads, m, v


# ------------------------------------------------------------------ CPU ----

def test_reference_matches_pytorch_style_loop(rng):
    """Element by element, as torch.optim.AdamW writes it: decay first, then the Adam step."""
    n = 23
    params, grads, m, v = _state(rng, n)
    kw = dict(lr=0.01, step=3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
              decay_spans=[(2, 9), (15, 20)], max_grad_norm=0.05, grad_scale=0.5)
    p_ref, m_ref, v_ref = adamw_reference(params, grads, m, v, **kw)
    norm = math.sqrt(sum(float(g) ** 2 for g in grads))
    clip = min(1.0, 0.05 / (norm + 1e-6))
    for i in range(n):
        g = float(grads[i]) * 0.5 * clip
        p = float(params[i])
        if 2 <= i < 9 or 15 <= i < 20:
            p *= 1 - 0.01 * 0.1
        mi = 0.9 * float(m[i]) + 0.1 * g
        vi = 0.95 * float(v[i]) + 0.05 * g * g
        p -= 0.01 * (mi / (1 - 0.9 ** 3)) / (math.sqrt(vi / (1 - 0.95 ** 3)) + 1e-8)
        assert m_ref[i] == pytest.approx(mi, rel=1e-12)
        assert v_ref[i] == pytest.approx(vi, rel=1e-12)
        assert p_ref[i] == pytest.approx(p, rel=1e-12, abs=1e-15)


def test_decay_boundaries():
    assert decay_boundaries([(5, 10), (0, 3), (3, 4), (8, 12), (20, 20)], 30) == [0, 4, 5, 12]
    assert decay_boundaries(None, 7) == [0, 7]
    assert decay_boundaries([], 7) == []
    with pytest.raises(ValueError, match="decay_spans: span"):
        decay_boundaries([(3, 2)], 7)
    with pytest.raises(ValueError, match="decay_spans: span"):
        decay_boundaries([(0, 8)], 7)
    with pytest.raises(TypeError, match="decay_spans: each span"):
        decay_boundaries([(0, 1.5)], 7)


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_public_numpy_path(rng, grad_dtype):
    n = 50
    params, grads, m, v = _state(rng, n, grad_dtype)
    kw = dict(lr=1e-2, step=5, weight_decay=0.1, decay_spans=[(0, 20), (30, 41)], grad_scale=2.0)
    p_ref, m_ref, v_ref = adamw_reference(params, grads, m, v, max_grad_norm=1e-3, **kw)
    p_noclip, _, _ = adamw_reference(params, grads, m, v, **kw)
    lowp = np.zeros(n, gpucore.bfloat16)
    out = gpucore.adamw_update(params, grads, m, v, max_grad_norm=1e-3, params_lowp=lowp, **kw)
    assert out is params
    np.testing.assert_allclose(params, p_ref, rtol=1e-6)
    np.testing.assert_allclose(m, m_ref, rtol=1e-6)
    np.testing.assert_allclose(v, v_ref, rtol=1e-6)
    np.testing.assert_array_equal(lowp, params.astype(gpucore.bfloat16))
    # the clip is active (the norm is far above 1e-3): without it the step differs
    norm = gpucore.grad_norm(grads)
    assert norm.shape == () and norm.dtype == np.float32
    assert float(norm) == pytest.approx(grad_norm_reference(grads), rel=1e-6)
    assert not np.allclose(p_noclip, p_ref, rtol=1e-4)


def test_grad_norm_reference(rng):
    g = rng.standard_normal(1000).astype(np.float32)
    assert grad_norm_reference(g) == pytest.approx(float(np.linalg.norm(g.astype(np.float64))), rel=1e-12)


def test_adamw_bad_input(rng):
    n = 8
    params, grads, m, v = _state(rng, n)
    ok = dict(lr=1e-3, step=1)
    with pytest.raises(TypeError, match="params: dtype"):
        gpucore.adamw_update(params.astype(gpucore.bfloat16), grads, m, v, **ok)
    with pytest.raises(ValueError, match="params: expected 1 dimensions"):
        gpucore.adamw_update(params.reshape(2, 4), grads, m, v, **ok)
    with pytest.raises(ValueError, match="grads: expected shape"):
        gpucore.adamw_update(params, grads[:4].copy(), m, v, **ok)
    with pytest.raises(TypeError, match="grads: dtype"):
        gpucore.adamw_update(params, grads.astype(np.float16), m, v, **ok)
    with pytest.raises(TypeError, match="m: dtype"):
        gpucore.adamw_update(params, grads, m.astype(gpucore.bfloat16), v, **ok)
    with pytest.raises(ValueError, match="v: expected shape"):
        gpucore.adamw_update(params, grads, m, v[:7].copy(), **ok)
    with pytest.raises(TypeError, match="params_lowp: dtype"):
        gpucore.adamw_update(params, grads, m, v, params_lowp=params.copy(), **ok)
    with pytest.raises(ValueError, match="step: must be >= 1"):
        gpucore.adamw_update(params, grads, m, v, lr=1e-3, step=0)
    with pytest.raises(TypeError, match="step: expected an int"):
        gpucore.adamw_update(params, grads, m, v, lr=1e-3, step=1.0)
    with pytest.raises(TypeError, match="lr: expected a number"):
        gpucore.adamw_update(params, grads, m, v, lr=None, step=1)
    with pytest.raises(ValueError, match="beta2: must be <"):
        gpucore.adamw_update(params, grads, m, v, beta2=1.0, **ok)
    with pytest.raises(ValueError, match="max_grad_norm: must be >"):
        gpucore.adamw_update(params, grads, m, v, max_grad_norm=0.0, **ok)
    with pytest.raises(ValueError, match="grad_norm: expected a 0-d"):
        gpucore.adamw_update(params, grads, m, v, grad_norm=np.ones(2, np.float32), max_grad_norm=1.0, **ok)
    with pytest.raises(ValueError, match="decay_spans: span"):
        gpucore.adamw_update(params, grads, m, v, decay_spans=[(0, 9)], weight_decay=0.1, **ok)
    with pytest.raises(ValueError, match="grads: expected 1 dimensions"):
        gpucore.grad_norm(grads.reshape(2, 4))
    before = params.copy()
    with pytest.raises(TypeError):
        gpucore.adamw_update(params, grads, m, v, lr="x", step=1)
    np.testing.assert_array_equal(params, before)


# ------------------------------------------------------------------ GPU ----

SIZES = [1, 7, 1000, 4096 + 3, (1 << 20) + 5]


def _spans(n):
    """Decay spans with odd boundaries (not multiples of 4), a touching pair, and gaps."""
    if n < 10:
        return [(1, n - 1)] if n > 2 else []
    return [(1, n // 3), (n // 3, n // 3 + 5), (n // 2 + 1, n // 2 + 2), (n - n // 5, n - 3)]


@pytest.mark.cuda
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("clip", [False, True])
def test_gpu_adamw_matches_reference_and_is_deterministic(rng, grad_dtype, n, clip):
    cp = runtime.cupy
    params, grads, m, v = _state(rng, n, grad_dtype)
    kw = dict(lr=0.05, step=7, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.3,
              decay_spans=_spans(n), grad_scale=0.75)
    max_norm = 0.01 if clip else None                  # far below the norm: the clip is active
    p_ref, m_ref, v_ref = adamw_reference(params, grads, m, v, max_grad_norm=max_norm, **kw)

    def run():
        pg, gg, mg, vg = (cp.asarray(a) for a in (params, grads, m, v))
        lowp = cp.full(n, np.nan, dtype=np.float32).astype(gpucore.bfloat16)
        norm = gpucore.grad_norm(gg) if clip else None  # stays on the device
        gpucore.adamw_update(pg, gg, mg, vg, grad_norm=norm, max_grad_norm=max_norm, params_lowp=lowp, **kw)
        return to_cpu(pg), to_cpu(mg), to_cpu(vg), to_cpu(lowp)

    p1, m1, v1, l1 = run()
    # compare the update (p_new - p_old), not p: p itself would hide errors in the step. Over many
    # elements, relative errors of the whole update and of m, v (as always). With a handful of
    # elements (n = 1, 7) one element decides, and its value can be ill-conditioned: m = 0.9 m +
    # 0.1 g may cancel to ~1e-6 of its terms, and an update of ~3e-7 on p ~ 1.5 is below one float32
    # ulp of p (both found by the seeded rng). There, each element is bounded by its terms' size.
    d_ref = p_ref - params
    if n >= 1000:
        assert rel_err(p1.astype(np.float64) - params, d_ref) < 1e-4, "params"
        assert rel_err(m1, m_ref) < 1e-5, "m"
        assert rel_err(v1, v_ref) < 1e-5, "v"
    else:
        g = np.abs(grads.astype(np.float64)) * kw["grad_scale"]               # the clip only shrinks it
        def ulp(x):
            return np.spacing(np.abs(x).astype(np.float32)).astype(np.float64)
        m_bound = 1e-5 * (0.9 * np.abs(m) + 0.1 * g) + ulp(m_ref)
        p_bound = 1e-4 * (np.abs(d_ref) + kw["lr"] * kw["weight_decay"] * np.abs(params)) + ulp(p_ref)
        assert np.all(np.abs(m1 - m_ref) <= m_bound), ("m", m1, m_ref)
        assert np.all(np.abs(v1 - v_ref) <= 1e-5 * np.abs(v_ref) + ulp(v_ref)), ("v", v1, v_ref)
        assert np.all(np.abs(p1 - p_ref) <= p_bound), ("params", p1, p_ref)
    np.testing.assert_array_equal(l1, p1.astype(gpucore.bfloat16))
    p2, m2, v2, l2 = run()
    assert p1.tobytes() == p2.tobytes() and m1.tobytes() == m2.tobytes() and v1.tobytes() == v2.tobytes()
    assert l1.tobytes() == l2.tobytes()


@pytest.mark.cuda
def test_gpu_decay_only_inside_spans(rng):
    """With zero grads and m = v = 0, only weight decay moves a parameter: check exactly where."""
    cp = runtime.cupy
    n = 4099
    spans = [(3, 10), (10, 17), (1001, 1002), (4000, 4097)]
    params = np.ones(n, np.float32)
    pg = cp.asarray(params)
    zeros = cp.zeros(n, np.float32)
    gpucore.adamw_update(pg, zeros, zeros.copy(), zeros.copy(), lr=0.5, step=1, weight_decay=0.5,
                         decay_spans=spans)
    decayed = to_cpu(pg) != 1.0
    expected = np.zeros(n, bool)
    for a, b in spans:
        expected[a:b] = True
    np.testing.assert_array_equal(decayed, expected)
    np.testing.assert_allclose(to_cpu(pg)[expected], 0.75, rtol=1e-7)


@pytest.mark.cuda
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_gpu_adamw_unaligned_views(rng, grad_dtype):
    cp = runtime.cupy
    n = 1001
    params, grads, m, v = _state(rng, n + 1, grad_dtype)
    pg, gg, mg, vg = (cp.asarray(a)[1:] for a in (params, grads, m, v))   # 4 (2) bytes off alignment
    kw = dict(lr=0.05, step=2, weight_decay=0.1, decay_spans=[(5, 500)])
    p_ref, m_ref, v_ref = adamw_reference(params[1:], grads[1:], m[1:], v[1:], **kw)
    gpucore.adamw_update(pg, gg, mg, vg, **kw)
    assert rel_err(to_cpu(pg).astype(np.float64) - params[1:], p_ref - params[1:]) < 1e-4
    assert rel_err(to_cpu(mg), m_ref) < 1e-5


@pytest.mark.cuda
def test_gpu_nan_norm_is_not_silently_ignored(rng):
    cp = runtime.cupy
    params, grads, m, v = (cp.asarray(a) for a in _state(rng, 64))
    gpucore.adamw_update(params, grads, m, v, lr=1e-3, step=1, grad_norm=cp.asarray(np.float32(np.nan)),
                         max_grad_norm=1.0)
    assert np.isnan(to_cpu(params)).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("n", [1, 5, 1000, 65536 + 7, (1 << 22) + 3, 124_475_904])
def test_gpu_grad_norm(rng, dtype, n):
    cp = runtime.cupy
    g = rng.standard_normal(n, dtype=np.float32).astype(dtype)
    gg = cp.asarray(g)
    out = cp.full((), np.nan, dtype=np.float32)
    gpucore.grad_norm(gg, out=out)
    ref = grad_norm_reference(g)
    assert abs(float(out) - ref) <= 1e-5 * ref
    assert to_cpu(gpucore.grad_norm(gg)).tobytes() == to_cpu(out).tobytes(), "grad_norm not deterministic"
