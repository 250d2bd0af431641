"""gpucore.optim: the learning-rate schedule and AdamW over the model's flat buffers.

AdamW's arithmetic is tested with its kernel (tests/test_adamw.py); here the
wiring: which elements decay, clipping by the global norm, bf16 master
weights, the step count, state round trips. The expected values are written
out independently in float64 below.
"""
import math

import numpy as np
import pytest

from gpucore import bfloat16, runtime
from gpucore.model import GPT2, GPT2Config, parameter_specs
from gpucore.optim import AdamW, lr_schedule
from conftest import rel_err, to_cpu


def test_lr_schedule():
    assert lr_schedule(0, 1.0, 100) == 1.0 and lr_schedule(99, 1.0, 100) == 1.0   # constant by default
    # warmup: linear from lr/warmup to lr
    assert [lr_schedule(s, 1.0, 100, warmup_steps=4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # cosine from lr at the end of warmup to lr*final at the last step
    assert lr_schedule(10, 6e-4, 110, 10, 0.1) == pytest.approx(6e-4)
    assert lr_schedule(60, 6e-4, 110, 10, 0.1) == pytest.approx(6e-5 + 0.5 * 5.4e-4)
    assert lr_schedule(110, 6e-4, 110, 10, 0.1) == pytest.approx(6e-5)
    assert lr_schedule(500, 6e-4, 110, 10, 0.0) == pytest.approx(0.0)
    lrs = [lr_schedule(s, 1.0, 50, 5, 0.0) for s in range(5, 51)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def _model_with_grads(cfg, dtype, rng, xp=np, scale=1.0):
    m = GPT2(cfg, xp=xp, dtype=dtype, seed=3)
    g = rng.standard_normal(m.num_parameters).astype(np.float32) * np.float32(scale)
    m.allocate_grads().flat()[...] = xp.asarray(g.astype(m.dtype))
    return m


def _expected(p, g, m, v, t, lr, wd_mask, wd, b1=0.9, b2=0.95, eps=1e-8, clip=None):
    p, g, m, v = (np.asarray(a, np.float64) for a in (p, g, m, v))
    if clip:
        g = g * min(1.0, clip / (np.linalg.norm(g) + 1e-6))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    upd = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return p - lr * (upd + np.where(wd_mask, wd, 0.0) * p), m, v


@pytest.mark.parametrize("clip,scale", [(None, 1.0), (1.0, 1.0), (1e6, 1.0)])
def test_adamw_step_decay_and_clip(rng, clip, scale):
    cfg = GPT2Config.from_preset("micro")
    model = _model_with_grads(cfg, "float32", rng, scale=scale)
    opt = AdamW(model, weight_decay=0.1, max_grad_norm=clip)
    assert opt.master is None                       # fp32: the params are the master weights
    mask = np.zeros(model.num_parameters, bool)
    for a, b in model.decay_spans():
        mask[a:b] = True
    p0, g = model.params.flat().copy(), model.grads.flat().copy()
    m, v = np.zeros_like(p0), np.zeros_like(p0)
    exp_p = p0
    for t in (1, 2):
        norm = opt.step(3e-3)
        assert float(norm) == pytest.approx(np.linalg.norm(g.astype(np.float64)), rel=1e-6)
        exp_p, m, v = _expected(exp_p, g, m, v, t, 3e-3, mask, 0.1, clip=clip)
    assert opt.step_count == 2
    np.testing.assert_allclose(model.params.flat(), exp_p, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(opt.m, m, rtol=1e-5, atol=1e-9)
    # layernorm weights (no decay, gradient-driven only) vs a decayed matrix with zero grad
    ln = model.layout.offsets["ln1w"] // 4
    assert not mask[ln]


def test_adamw_weight_decay_only_on_matrices(rng):
    """With zero gradients AdamW only decays: matrices shrink by (1 - lr*wd), the rest stays."""
    cfg = GPT2Config.from_preset("micro")
    model = GPT2(cfg, seed=3)
    model.zero_grad()
    before = {n: model.params[n].copy() for n, _, _ in parameter_specs(cfg)}
    AdamW(model, weight_decay=0.5, max_grad_norm=None).step(0.1)
    for name, _, decay in parameter_specs(cfg):
        want = before[name] * np.float32(1 - 0.05) if decay else before[name]
        np.testing.assert_allclose(model.params[name], want, rtol=1e-6, err_msg=name)


def test_adamw_bf16_master_weights(rng):
    cfg = GPT2Config.from_preset("micro")
    model = _model_with_grads(cfg, "bfloat16", rng)
    opt = AdamW(model, weight_decay=0.0, max_grad_norm=1.0)
    assert opt.master.dtype == np.float32
    np.testing.assert_array_equal(opt.master, model.params.flat().astype(np.float32))
    opt.step(1e-3)
    assert model.params.flat().dtype == bfloat16
    np.testing.assert_array_equal(model.params.flat(), opt.master.astype(bfloat16))
    # fp32 masters keep updates smaller than a bf16 ulp: params are bf16(master), not master itself
    assert not np.array_equal(opt.master, model.params.flat().astype(np.float32))


def test_adamw_state_round_trip(rng):
    cfg = GPT2Config.from_preset("micro")
    model = _model_with_grads(cfg, "bfloat16", rng)
    opt = AdamW(model)
    opt.step(1e-3)
    arrays, meta = {k: to_cpu(v).copy() for k, v in opt.state_arrays().items()}, opt.state_meta()
    params = model.params.flat().copy()
    opt.step(1e-3)
    after = model.params.flat().copy()
    model.load_flat(params)
    opt2 = AdamW(model)
    opt2.load_state(arrays, meta)
    assert opt2.step_count == 1
    opt2.step(1e-3)
    assert model.params.flat().tobytes() == after.tobytes()
    with pytest.raises(ValueError, match="'m' has shape"):
        opt2.load_state({**arrays, "m": arrays["m"][:-1]}, meta)
    with pytest.raises(RuntimeError, match="no gradients"):
        AdamW(GPT2(cfg)).step(1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_adamw_matches_numpy(rng, dtype):
    cp = runtime.cupy
    cfg = GPT2Config.from_preset("tiny")
    out = {}
    for xp in (np, cp):
        model = _model_with_grads(cfg, dtype, np.random.default_rng(0), xp=xp, scale=1e-2)
        opt = AdamW(model, weight_decay=0.1, max_grad_norm=1.0)
        norms = [float(opt.step(lr)) for lr in (1e-3, 2e-3, 3e-3)]
        out[xp] = norms, to_cpu(opt.master_params).copy(), to_cpu(opt.v).copy()
    assert np.allclose(out[np][0], out[cp][0], rtol=1e-5)
    assert rel_err(out[cp][1], out[np][1]) < 1e-6
    assert rel_err(out[cp][2], out[np][2]) < 1e-5
    assert not math.isnan(out[cp][1].sum())
