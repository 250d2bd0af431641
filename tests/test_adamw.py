"""gpucore.adamw_update / grad_norm: reference vs an independent formulation, GPU vs reference, bad input.

Also the bf16-without-master-weights modes (master_weights="bf16" / "sr" / "kahan") and
stochastic_round: the hash against plain Python integers, unbiasedness, determinism, Kahan against
fp32 master weights on a toy problem where plain bf16 stalls, GPU kernels against the NumPy ones.
"""
import math

import numpy as np
import pytest

import gpucore
from gpucore import runtime
from gpucore.ops.adamw import (adamw_lowp_reference, adamw_reference, decay_boundaries, grad_norm_reference,
                               sr_bits_reference, sr_keys, stochastic_round)
from conftest import poison, rel_err, to_cpu

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


# ---------------------------------------------- bf16 params without master weights (CPU) ----

LOWP_MODES = ["bf16", "sr", "kahan"]
_M32 = 0xFFFFFFFF


def _py_mix32(x):
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _bf16_ulp(x):
    """The bf16 spacing at |x| (normal numbers): 2^(exponent - 7)."""
    return np.exp2(np.floor(np.log2(np.abs(np.asarray(x, np.float64)))) - 7)


def _lowp_state(rng, n, grad_dtype=np.float32):
    params, grads, m, v = _state(rng, n, grad_dtype)
    comp = (rng.standard_normal(n) * 1e-3).astype(gpucore.bfloat16)
    return params.astype(gpucore.bfloat16), grads, m, v, comp


def test_sr_bits_match_python_integers():
    """The NumPy uint32 hash (what the kernel computes) against the same formula on Python ints."""
    k1, k2 = sr_keys(1234, 56)
    assert (k1, k2) != sr_keys(1234, 57) and (k1, k2) != sr_keys(1235, 56)
    assert 0 <= k1 <= _M32 and 0 <= k2 <= _M32
    offset = 2**32 - 3                               # the index wraps mod 2^32, as the kernel's u32
    bits = sr_bits_reference(9, k1, k2, offset)
    want = [_py_mix32((_py_mix32(((i + offset) & _M32) ^ k1) + k2) & _M32) >> 16 for i in range(9)]
    assert bits.dtype == np.uint32 and bits.tolist() == want


def test_stochastic_round_is_unbiased_and_exact_where_it_must_be(rng):
    ulp = 2.0 ** -7                                  # bf16 spacing in [1, 2)
    frac = np.array([0.0, 0.01, 0.25, 0.5, 0.75, 0.99, 0.3, 0.7], np.float64)
    x = np.concatenate([1 + frac * ulp, -(1.5 + frac * ulp)]).astype(np.float32)   # exact in float32
    lo = np.trunc(x.astype(np.float64) / ulp) * ulp                                # toward zero
    K = 4000
    acc = np.zeros(x.size)
    for step in range(1, K + 1):
        r = stochastic_round(x, seed=11, step=step).astype(np.float64)
        assert np.all((r == lo) | (r == lo + np.sign(x) * ulp)), "only the two neighbours"
        acc += r
    mean = acc / K
    # the mean of K Bernoulli(f) choices has standard deviation ulp sqrt(f (1 - f) / K) <= ulp/126;
    # 5 of them (plus an exactness floor for f = 0) never fail by chance (p < 1e-6 per element)
    sd = ulp * np.sqrt(np.concatenate([frac, frac]) * (1 - np.concatenate([frac, frac])) / K)
    assert np.all(np.abs(mean - x) <= 5 * sd + 1e-12), (mean - x) / ulp
    # across elements too (one step, many indices): a quarter of them round up
    y = np.full(100_000, 1 + 0.25 * ulp, np.float32)
    up = (stochastic_round(y, seed=3, step=1).astype(np.float64) > 1).mean()
    assert abs(up - 0.25) < 0.007                                   # sd = 0.0014
    # bf16 values, zero, infinities and NaN come back unchanged
    special = np.array([1.0, -2.5, 0.0, -0.0, np.inf, -np.inf, 3.0e38, np.nan], np.float32)
    out = stochastic_round(special, seed=1, step=1).astype(np.float32)
    np.testing.assert_array_equal(out[:6], special[:6])
    assert np.isnan(out[7])
    assert abs(float(out[6]) - 3.0e38) <= 2.0 ** (127 - 7)          # a finite neighbour (bf16 max 3.39e38)


def test_stochastic_round_is_deterministic_per_seed_and_step(rng):
    x = rng.standard_normal(10_000).astype(np.float32)
    a = stochastic_round(x, seed=5, step=9)
    assert a.tobytes() == stochastic_round(x, seed=5, step=9).tobytes()
    # another step or seed redraws: for values spread across the ulp, ~1/3 of the roundings differ
    for other in (stochastic_round(x, seed=5, step=10), stochastic_round(x, seed=6, step=9)):
        changed = (other.view(np.uint16) != a.view(np.uint16)).mean()
        assert 0.2 < changed < 0.5
    # a shard with index_offset rounds as the whole buffer does
    part = stochastic_round(x[1234:], seed=5, step=9, index_offset=1234)
    assert part.tobytes() == a[1234:].tobytes()
    with pytest.raises(ValueError, match="seed: must be in"):
        stochastic_round(x, seed=-1, step=1)
    with pytest.raises(TypeError, match="x: dtype"):
        stochastic_round(x.astype(gpucore.bfloat16), seed=1, step=1)


@pytest.mark.parametrize("mode", LOWP_MODES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_lowp_public_path_and_rounding_rules(rng, mode, grad_dtype):
    """Public NumPy path == adamw_lowp_reference, and each mode's rounding of the fp32 AdamW value."""
    n = 300
    params, grads, m, v, comp = _lowp_state(rng, n, grad_dtype)
    kw = dict(lr=0.05, step=4, weight_decay=0.1, decay_spans=[(10, 200)], max_grad_norm=1.0, grad_scale=0.5)
    p_ref, m_ref, v_ref, c_ref = adamw_lowp_reference(params, grads, m, v, master_weights=mode,
                                                      kahan_comp=comp if mode == "kahan" else None, seed=3, **kw)
    f32 = adamw_reference(params.astype(np.float32), grads, m, v, **kw)[0].astype(np.float32)   # fp32 value
    p, mm, vv, c = params.copy(), m.copy(), v.copy(), comp.copy()
    out = gpucore.adamw_update(p, grads, mm, vv, master_weights=mode,
                               kahan_comp=c if mode == "kahan" else None, seed=3, **kw)
    assert out is p and p.dtype == gpucore.bfloat16
    np.testing.assert_array_equal(p, p_ref)
    # float32 storage of m (~1e-2): 1e-6 relative, or 1e-9 absolute where it cancels to near zero
    np.testing.assert_allclose(mm, m_ref, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(vv, v_ref, rtol=1e-6)
    moved = p.astype(np.float32) != params.astype(np.float32)
    assert moved.mean() > 0.5                                            # the steps are a few ulps
    f64 = f32.astype(np.float64)
    if mode == "bf16":
        np.testing.assert_array_equal(p, f32.astype(gpucore.bfloat16))
    elif mode == "sr":   # one of the two bf16 neighbours of the fp32 value, each chosen somewhere
        lo = np.trunc(f64 / _bf16_ulp(f32)) * _bf16_ulp(f32)
        got = p.astype(np.float64)
        assert np.all((got == lo) | (got == lo + np.sign(f64) * _bf16_ulp(f32)))
        assert 0.1 < (got == lo).mean() < 0.9
        assert (p != f32.astype(gpucore.bfloat16)).any()                 # not round-to-nearest
    else:                # p + comp carries the fp32 value to bf16 precision of the (small) compensation
        np.testing.assert_array_equal(c, c_ref)
        u = (f64 - params.astype(np.float64)) + comp.astype(np.float64)    # update + old compensation
        total = p.astype(np.float64) + c.astype(np.float64)
        assert np.all(np.abs(total - (params.astype(np.float64) + u)) <= 2.0 ** -8 * np.abs(u) + 1e-7)
        assert np.abs(c.astype(np.float64)).max() <= 0.5 * _bf16_ulp(p).max()


def test_lowp_toy_quadratic_kahan_follows_fp32_master_where_bf16_stalls(rng):
    """Many small AdamW steps (lr 1e-4, bf16 ulp 2^-7..2^-6) towards a target 0..8 ulps away.

    Plain bf16 rounding loses every update (each is under half an ulp): the params never move.
    Kahan carries the lost part: p + comp tracks the fp32 master run (measured 2e-4), and both end
    within one bf16 ulp of the target. SR moves on average as fp32 does.
    """
    n = 256
    p0 = (1 + rng.random(n)).astype(np.float32).astype(gpucore.bfloat16)      # in [1, 2]
    target = p0.astype(np.float64) + rng.uniform(-0.06, 0.06, n)

    def run(mode, steps=1000, lr=1e-4):
        p = p0.copy()
        m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
        master = p.astype(np.float32) if mode == "fp32" else None
        comp = np.zeros(n, gpucore.bfloat16) if mode == "kahan" else None
        for t in range(1, steps + 1):
            g = (p.astype(np.float64) - target).astype(np.float32)        # the gradient at the bf16 weights
            if mode == "fp32":
                gpucore.adamw_update(master, g, m, v, lr=lr, step=t, params_lowp=p)
            else:
                gpucore.adamw_update(p, g, m, v, lr=lr, step=t, master_weights=mode, kahan_comp=comp, seed=5)
        exact = master.astype(np.float64) if mode == "fp32" else p.astype(np.float64)
        if comp is not None:
            exact = exact + comp.astype(np.float64)
        return p.astype(np.float64), exact

    runs = {mode: run(mode) for mode in ("fp32", "bf16", "sr", "kahan")}
    ulp = _bf16_ulp(target)
    assert np.array_equal(runs["bf16"][0], p0.astype(np.float64))           # stalled: not one ulp moved
    assert np.abs(runs["fp32"][1] - target).max() < 0.01                     # fp32 gets there (0.005)
    assert np.all(np.abs(runs["kahan"][0] - target) <= ulp)
    assert np.abs(runs["kahan"][1] - runs["fp32"][1]).max() < 1e-3
    # SR: each step moves an element up one ulp with probability ~1/78 (a random walk that drifts
    # as fp32 does), so single elements lag (one was still 5 ulps off after 1000 steps, 1.6 after
    # 2000) while the population gets there: mean distance 3.9 ulps at the start, 0.5 measured
    start = np.abs(p0.astype(np.float64) - target) / ulp
    sr_err = np.abs(runs["sr"][0] - target) / ulp
    assert start.mean() > 3 and sr_err.mean() < 1.0


def test_lowp_bad_input(rng):
    params, grads, m, v, comp = _lowp_state(rng, 8)
    ok = dict(lr=1e-3, step=1)
    with pytest.raises(ValueError, match="master_weights: must be one of"):
        gpucore.adamw_update(params, grads, m, v, master_weights="fp16", **ok)
    with pytest.raises(TypeError, match="params: dtype must be bfloat16"):
        gpucore.adamw_update(params.astype(np.float32), grads, m, v, master_weights="sr", **ok)
    with pytest.raises(ValueError, match="kahan_comp: required"):
        gpucore.adamw_update(params, grads, m, v, master_weights="kahan", **ok)
    with pytest.raises(ValueError, match="kahan_comp: required"):
        gpucore.adamw_update(params.astype(np.float32), grads, m, v, kahan_comp=comp, **ok)
    with pytest.raises(TypeError, match="kahan_comp: dtype"):
        gpucore.adamw_update(params, grads, m, v, master_weights="kahan", kahan_comp=m.copy(), **ok)
    with pytest.raises(ValueError, match="params_lowp: only with"):
        gpucore.adamw_update(params, grads, m, v, master_weights="sr", params_lowp=params.copy(), **ok)
    with pytest.raises(ValueError, match="seed: must be in"):
        gpucore.adamw_update(params, grads, m, v, master_weights="sr", seed=-1, **ok)
    with pytest.raises(TypeError, match="index_offset: expected an int"):
        gpucore.adamw_update(params, grads, m, v, master_weights="sr", index_offset=1.5, **ok)
    before = params.copy()
    gpucore.adamw_update(params, grads, m, v, master_weights="none-sr", lr=0.0, step=1)   # the alias; lr 0
    assert params.tobytes() == before.tobytes()


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
def test_gpu_bf16_copy_of_nan_params_keeps_the_exact_bits(rng):
    """The bf16 working copy is cvt.rn.bf16x2's, except in a float4 group holding a NaN, which takes
    float_to_bf16 (sign | 0x7fc0, as the CPU cast): a NaN parameter, from a NaN gradient, in some
    groups and not in others."""
    cp = runtime.cupy
    n = 4096
    params, grads, m, v = _state(rng, n)
    grads[[5, 6, 1001, 4095]] = np.float32("nan")
    grads[[2000]] = -np.float32("nan")
    lowp = cp.zeros(n, gpucore.bfloat16)
    pg = cp.asarray(params)
    gpucore.adamw_update(pg, cp.asarray(grads), cp.asarray(m), cp.asarray(v), lr=1e-3, step=3,
                         params_lowp=lowp)
    p = to_cpu(pg)
    assert np.isnan(p).sum() == 5
    got = to_cpu(lowp).view(np.uint16)
    nan = np.isnan(p)
    want = np.where(nan, (p.view(np.uint32) >> 16 & 0x8000) | 0x7fc0, p.astype(gpucore.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(got, want.astype(np.uint16))


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



@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 7, 1000, (1 << 20) + 5])
def test_gpu_stochastic_round_is_bitwise_the_numpy_one(rng, n):
    cp = runtime.cupy
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    if n >= 7:
        x[:5] = [np.nan, np.inf, -np.inf, 0.0, -np.nan]
    out = poison(n, gpucore.bfloat16)
    stochastic_round(cp.asarray(x), seed=2**40 + 7, step=123, index_offset=77, out=out)
    want = stochastic_round(x, seed=2**40 + 7, step=123, index_offset=77)
    assert to_cpu(out).view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


def _bf16_bits_apart(a, b):
    """|a - b| in bf16 ulps (same-sign values: the bit patterns are ordered)."""
    return np.abs(a.view(np.uint16).astype(np.int64) - b.view(np.uint16).astype(np.int64))


def _lowp_update_bound(params, grads, m, v_ref, comp, kw, scale):
    """Per element, a bound on |kernel's fp32 value - reference's| before the bf16 rounding.

    The kernel forms d = -lr (m_hat / (sqrt(v_hat) + eps) + wd p) and p + d (+ comp) in fp32, each
    operation within 2^-24 of its own result (sqrtf and / are IEEE; FMA contraction only removes
    roundings). Those results can cancel: m = beta1 m + (1 - beta1) g (terms of opposite sign), the
    two terms of d, and above all p + d -> ~0 when the step takes p across zero. So the error is a
    few 2^-24 of the terms' magnitudes T = |p| + |comp| + lr ((beta1 |m| + (1 - beta1) |g|) / bc1 /
    (sqrt(v_hat) + eps) + wd |p|), not of the result: 1e-6 T is ~16 ulps of T, a 2x margin over the
    ~8 roundings on the path. A wrong coefficient (beta, bias correction, lr) moves d by >= 1e-2 of
    itself: this bound hides it only where the bf16 ulp does, which the bitwise-equal fraction
    checks catch."""
    lr, b1, b2, step = kw["lr"], kw["beta1"], kw["beta2"], kw["step"]
    p = params.astype(np.float64)
    g = np.abs(grads.astype(np.float64)) * scale
    wd = np.zeros(p.size)
    for a, b in _spans(p.size):
        wd[a:b] = kw["weight_decay"]
    m_terms = (b1 * np.abs(m.astype(np.float64)) + (1 - b1) * g) / (1 - b1 ** step)
    t = np.abs(p) + lr * (m_terms / (np.sqrt(v_ref / (1 - b2 ** step)) + kw["eps"]) + wd * np.abs(p))
    if comp is not None:
        t += np.abs(comp.astype(np.float64))
    return 1e-6 * t


def _bf16_ulp_at(a, b):
    """bf16 spacing at max(|a|, |b|) elementwise (0 where both are 0)."""
    x = np.maximum(np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64)))
    with np.errstate(divide="ignore"):
        return np.where(x > 0, np.exp2(np.floor(np.log2(np.where(x > 0, x, 1.0))) - 7), 0.0)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", LOWP_MODES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("clip", [False, True])
def test_gpu_adamw_lowp_matches_reference_and_is_deterministic(rng, mode, grad_dtype, n, clip):
    cp = runtime.cupy
    params, grads, m, v, comp = _lowp_state(rng, n, grad_dtype)
    kw = dict(lr=0.05, step=7, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.3,
              decay_spans=_spans(n), grad_scale=0.75, master_weights=mode, seed=99, index_offset=1000)
    max_norm = 0.01 if clip else None
    kcomp = comp if mode == "kahan" else None
    # With clipping both sides take the GPU's fp32 norm (test_gpu_grad_norm checks it against
    # float64): one step from identical inputs, so only the update's own rounding differs.
    norm = gpucore.grad_norm(cp.asarray(grads)) if clip else None
    p_ref, m_ref, v_ref, c_ref = adamw_lowp_reference(params, grads, m, v, kahan_comp=kcomp, max_grad_norm=max_norm,
                                                      grad_norm=to_cpu(norm) if clip else None, **kw)

    def run():
        pg, gg, mg, vg = (cp.asarray(a) for a in (params, grads, m, v))
        cg = cp.asarray(comp) if mode == "kahan" else None
        gpucore.adamw_update(pg, gg, mg, vg, grad_norm=norm, max_grad_norm=max_norm, kahan_comp=cg, **kw)
        return to_cpu(pg), to_cpu(mg), to_cpu(vg), (to_cpu(cg) if cg is not None else None)

    p1, m1, v1, c1 = run()
    scale = kw["grad_scale"]                                   # the clip only shrinks g: a bound still
    err = _lowp_update_bound(params, grads, m, v_ref, kcomp, kw, scale)
    # The kernel's fp32 value x_k and the reference's x_r differ by at most err (above); rounding
    # both to bf16 (nearest: half an ulp each; stochastic: the same 16 bits added to both, then
    # truncated) leaves them at most err + one bf16 ulp apart. Where p + d cancels towards 0 the
    # bf16 ulp there is tiny and err is many of them: that is why err is absolute, not in ulps.
    dp = np.abs(p1.astype(np.float64) - p_ref.astype(np.float64))
    assert np.all(dp <= err + _bf16_ulp_at(p1, p_ref)), "params"
    # A rounding differs only where a bf16 boundary falls between x_k and x_r: err / ulp(x) ~ 2^-16
    # (T ~ |p|) of the elements; on the 2^20 elements here a handful, and it was 8 at most in an fp32
    # emulation of the kernel. 1e-3 of n (+ 2) leaves a wide margin; a wrong hash or rounding
    # flips ~1/3 (sr) of them, a 1e-2 error in d ~5% (0.05 / 2^-8 of the elements' 1e-2 shift).
    flipped = int((p1.view(np.uint16) != p_ref.view(np.uint16)).sum())
    assert flipped <= 2 + n // 1000, ("bf16 roundings that differ", flipped, n)
    if n >= 1000:
        assert rel_err(m1, m_ref) < 1e-5 and rel_err(v1, v_ref) < 1e-5
    else:
        np.testing.assert_allclose(m1, m_ref, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(v1, v_ref, rtol=1e-5, atol=1e-12)
    if mode == "kahan":
        # Where params agree, comp = bf16(u - (s - p)) with s - p exact and u - (s - p) exact
        # (Sterbenz: the two are within a bf16 ulp of p of each other), so comp's fp32 value differs
        # exactly by u's error (<= err), then bf16 rounding to nearest of both: <= err + one bf16
        # ulp of the larger comp (2^-7 of it at most). No bitwise-equal fraction here: comp is
        # ~2^-9 |p|, so its bf16 ulp is ~2^-17 |p| and a few 2^-24 T flip ~1% of its roundings (an
        # fp32 emulation of the kernel: 0.4-1%). A wrong compensation (not added, the kept error's
        # sign flipped) is off by comp itself, ~1e-3 here: 1e3 times err.
        same = p1.view(np.uint16) == p_ref.view(np.uint16)
        dc = np.abs(c1.astype(np.float64) - c_ref.astype(np.float64))
        assert np.all((dc <= err + _bf16_ulp_at(c1, c_ref))[same]), "kahan comp"
    p2, m2, v2, c2 = run()
    assert p1.tobytes() == p2.tobytes() and m1.tobytes() == m2.tobytes() and v1.tobytes() == v2.tobytes()
    if mode == "kahan":
        assert c1.tobytes() == c2.tobytes()


@pytest.mark.cuda
@pytest.mark.parametrize("mode", LOWP_MODES)
def test_gpu_adamw_lowp_unaligned_views(rng, mode):
    """Odd offsets (2-byte params, 4-byte moments): the lowp kernel is elementwise, any alignment."""
    cp = runtime.cupy
    n = 1001
    params, grads, m, v, comp = _lowp_state(rng, n + 1, gpucore.bfloat16)
    kw = dict(lr=0.05, step=2, weight_decay=0.1, decay_spans=[(5, 500)], master_weights=mode, seed=1)
    kcomp = comp[1:] if mode == "kahan" else None
    p_ref, m_ref, _, _ = adamw_lowp_reference(params[1:], grads[1:], m[1:], v[1:], kahan_comp=kcomp, **kw)
    pg, gg, mg, vg, cg = (cp.asarray(a)[1:] for a in (params, grads, m, v, comp))
    gpucore.adamw_update(pg, gg, mg, vg, kahan_comp=cg if mode == "kahan" else None, **kw)
    assert np.all(_bf16_bits_apart(to_cpu(pg), p_ref) <= 1)
    assert rel_err(to_cpu(mg), m_ref) < 1e-5
