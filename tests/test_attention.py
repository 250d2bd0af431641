"""Causal attention: the float64 reference, its gradient, and both GPU versions against it.

CPU: reference vs an independent per-row loop, reference backward vs finite
differences, argument checks, the Python/CUDA configuration tables agreeing.
GPU (pytest -m cuda): v1 (cuBLAS + softmax kernels, fp32 and bf16) and v2 (flash,
bf16) forward and backward on shapes with T not a multiple of any tile, hd 64
and 128; outputs poisoned with NaN first; bitwise determinism; v2's scratch is
O(B*NH*T). On a failure the message names the worst (batch, head, 16-row block)
so a fragment-layout or masking bug shows up as a pattern (e.g. only diagonal
blocks, only rows >= 64, only head 1).
"""
import math
import re
from pathlib import Path

import numpy as np
import pytest

import gpucore
from gpucore import runtime
from gpucore.ops import attention as attn
from conftest import poison, rel_err, to_cpu
from gradcheck import assert_grad_close, numerical_grad

BF16 = gpucore.bfloat16


def _qkv(rng, B, T, NH, hd, dtype=np.float32, sigma=1.0):
    return (sigma * rng.standard_normal((B, T, 3 * NH * hd))).astype(dtype)


def _naive_forward(qkv, NH):
    """One query row at a time, straight from the definition (float64)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hd = C // NH
    x = qkv.astype(np.float64)
    out = np.zeros((B, T, C))
    lse = np.zeros((B, NH, T))
    for b in range(B):
        for h in range(NH):
            cols = slice(h * hd, (h + 1) * hd)
            q, k, v = x[b, :, cols], x[b, :, C:][:, cols], x[b, :, 2 * C:][:, cols]
            for i in range(T):
                s = np.array([q[i] @ k[j] for j in range(i + 1)]) / math.sqrt(hd)
                w = np.exp(s - s.max())
                out[b, i, cols] = (w / w.sum()) @ v[: i + 1]
                lse[b, h, i] = s.max() + math.log(w.sum())
    return out, lse


# ------------------------------------------------------------------- CPU -----

@pytest.mark.parametrize("B,T,NH,hd", [(1, 1, 1, 4), (2, 5, 2, 3), (1, 9, 3, 8)])
def test_reference_forward_matches_naive_loop(rng, B, T, NH, hd):
    qkv = _qkv(rng, B, T, NH, hd)
    out, lse = attn.attention_forward_reference(qkv, NH)
    n_out, n_lse = _naive_forward(qkv, NH)
    np.testing.assert_allclose(out, n_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, n_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("B,T,NH,hd", [(1, 1, 1, 2), (2, 4, 2, 3), (1, 5, 1, 4)])
def test_reference_backward_gradcheck(rng, B, T, NH, hd):
    qkv = _qkv(rng, B, T, NH, hd).astype(np.float64)
    dout = rng.standard_normal((B, T, NH * hd))
    analytic = attn.attention_backward_reference(dout, qkv, NH)
    numeric = numerical_grad(lambda x: attn.attention_forward_reference(x, NH)[0], qkv, dout)
    assert_grad_close(analytic, numeric, rtol=1e-6, name="dqkv")
    # causality: the last value row is seen by the last query only, so dout of the
    # earlier rows must not reach it
    if T > 1:
        C = NH * hd
        dout2 = dout.copy()
        dout2[:, :-1] = rng.standard_normal(dout2[:, :-1].shape)
        other = attn.attention_backward_reference(dout2, qkv, NH)
        np.testing.assert_array_equal(other[:, -1, 2 * C:], analytic[:, -1, 2 * C:])
        assert not np.allclose(other[:, 0], analytic[:, 0])


def test_reference_backward_gradcheck_not_causal(rng):
    qkv = rng.standard_normal((1, 4, 3 * 2 * 3))
    dout = rng.standard_normal((1, 4, 6))
    analytic = attn.attention_backward_reference(dout, qkv, 2, causal=False)
    numeric = numerical_grad(lambda x: attn.attention_forward_reference(x, 2, causal=False)[0], qkv, dout)
    assert_grad_close(analytic, numeric, rtol=1e-6, name="dqkv (not causal)")


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_public_api_on_numpy(rng, dtype):
    B, T, NH, hd = 2, 6, 2, 4
    qkv = _qkv(rng, B, T, NH, hd, dtype)
    out, lse = gpucore.attention_forward(qkv, NH)
    assert out.shape == (B, T, NH * hd) and out.dtype == dtype
    assert lse.shape == (B, NH, T) and lse.dtype == np.float32
    ref_out, ref_lse = _naive_forward(qkv, NH)
    np.testing.assert_allclose(out.astype(np.float64), ref_out, rtol=1e-2 if dtype == BF16 else 1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
    dout = rng.standard_normal(out.shape).astype(dtype)
    dqkv = np.full(qkv.shape, np.nan, dtype=dtype)
    r = gpucore.attention_backward(dout, qkv, out, lse, NH, dqkv=dqkv)
    assert r is dqkv and not np.isnan(dqkv.astype(np.float32)).any()
    ref = attn.attention_backward_reference(dout, qkv, NH)
    assert rel_err(dqkv, ref) < (1e-2 if dtype == BF16 else 1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_convenience_numpy(rng, causal):
    B, NH, T, hd = 2, 3, 5, 4
    q, k, v = (rng.standard_normal((B, NH, T, hd)).astype(np.float32) for _ in range(3))
    y = gpucore.attention(q, k, v, causal=causal)
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)) / 2.0
    if causal:
        s[..., np.triu(np.ones((T, T), dtype=bool), 1)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(y, p @ v, rtol=1e-5, atol=1e-6)
    if causal:   # the same as the fused-qkv API on packed inputs
        qkv = np.concatenate([a.transpose(0, 2, 1, 3).reshape(B, T, NH * hd) for a in (q, k, v)], axis=-1)
        out, _ = gpucore.attention_forward(qkv, NH)
        np.testing.assert_allclose(y.transpose(0, 2, 1, 3).reshape(B, T, -1), out, rtol=1e-6, atol=1e-7)


def test_bad_input(rng):
    qkv = _qkv(rng, 2, 4, 2, 4)
    with pytest.raises(ValueError, match="qkv: last dimension must be 3"):
        gpucore.attention_forward(qkv[..., :-1].copy(), 2)
    with pytest.raises(ValueError, match="num_heads: 3 does not divide"):
        gpucore.attention_forward(qkv, 3)
    with pytest.raises(ValueError, match="num_heads"):
        gpucore.attention_forward(qkv, 0)
    with pytest.raises(ValueError, match="qkv: expected 3 dimensions"):
        gpucore.attention_forward(qkv[0], 2)
    with pytest.raises(TypeError, match="qkv: dtype"):
        gpucore.attention_forward(qkv.astype(np.float64), 2)
    with pytest.raises(ValueError, match="out: expected shape"):
        gpucore.attention_forward(qkv, 2, out=np.zeros((2, 4, 7), np.float32))
    with pytest.raises(TypeError, match="lse: dtype"):
        gpucore.attention_forward(qkv, 2, lse=np.zeros((2, 2, 4), BF16))
    with pytest.raises(ValueError, match="version"):
        gpucore.attention_forward(qkv, 2, version=4)
    out, lse = gpucore.attention_forward(qkv, 2)
    with pytest.raises(ValueError, match="dout: expected shape"):
        gpucore.attention_backward(out[:, :3].copy(), qkv, out, lse, 2)
    with pytest.raises(TypeError, match="dout: dtype bfloat16 differs"):
        gpucore.attention_backward(out.astype(BF16), qkv, out, lse, 2)
    with pytest.raises(ValueError, match="lse: expected shape"):
        gpucore.attention_backward(out, qkv, out, lse[:, :1].copy(), 2)
    with pytest.raises(ValueError, match="qkv: array must be C-contiguous"):
        gpucore.attention_forward(np.asfortranarray(qkv), 2)
    with pytest.raises(ValueError, match="k: expected shape"):
        gpucore.attention(np.zeros((1, 2, 3, 4), np.float32), np.zeros((1, 2, 4, 4), np.float32),
                          np.zeros((1, 2, 3, 4), np.float32))


def _instantiations(path, macro):
    return [tuple(int(x) for x in m.split(","))
            for m in re.findall(rf"^{macro}\(([\d, ]+)\)", Path(path).read_text(), re.MULTILINE)]


def test_python_tables_match_kernel_instantiations():
    kdir = runtime.KERNEL_DIR

    def table(rows):
        t = {}
        for hd, *cfg in rows:
            t.setdefault(hd, []).append(tuple(cfg))
        return t

    assert table(_instantiations(kdir / "flash_attention.cu", "FLASH_FWD")) == attn.FWD_CONFIGS
    bwd = kdir / "flash_attention_bwd.cu"
    assert table(_instantiations(bwd, "FLASH_BWD_DKDV")) == attn.DKDV_CONFIGS
    assert table(_instantiations(bwd, "FLASH_BWD_DQ")) == attn.DQ_CONFIGS
    assert {hd for (hd,) in _instantiations(bwd, "FLASH_BWD_PRE")} == set(attn.FWD_CONFIGS)
    assert set(attn.DKDV_CONFIGS) == set(attn.DQ_CONFIGS) == set(attn.FWD_CONFIGS)
    for hd, cfgs in attn.FWD_CONFIGS.items():
        for w, mt, bn in cfgs:
            assert attn._fwd_smem(hd, w, mt, bn) <= 163 * 1024      # fits sm_80 too
            assert (16 * mt * w * hd // 8) % (32 * w) == 0 and (bn * hd // 8) % (32 * w) == 0
    for hd in attn.DKDV_CONFIGS:
        for w, bm in attn.DKDV_CONFIGS[hd]:
            assert attn._dkdv_smem(hd, w, bm) <= 163 * 1024 and (bm * hd // 8) % (32 * w) == 0
        for w, bn in attn.DQ_CONFIGS[hd]:
            assert attn._dq_smem(hd, w, bn) <= 163 * 1024 and (bn * hd // 8) % (32 * w) == 0


def test_scratch_is_linear_in_T_for_flash():
    B, NH, hd = 64, 12, 64
    for T in (1024, 4096):
        assert attn.scratch_bytes(B, T, NH, hd, BF16, 2) == 0
        assert attn.scratch_bytes(B, T, NH, hd, BF16, 2, backward=True) == 4 * B * NH * T
        assert attn.scratch_bytes(B, T, NH, hd, BF16, 1, backward=True) > B * NH * T * T * 4


@pytest.mark.skipif(runtime.cupy is None, reason="needs CuPy + NVRTC")
def test_attention_kernel_names_match_the_launchers():
    """Every name ops/attention.py launches exists (sm_90 only: tests/test_runtime.py covers archs and spills)."""
    files = [runtime.KERNEL_DIR / f for f in ("attention.cu", "flash_attention.cu", "flash_attention_bwd.cu")]
    rows = runtime.check_kernels(("90",), files)
    assert not [r for r in rows if not r["ok"]]
    names = {r["kernel"] for r in rows}
    for hd in attn.FWD_CONFIGS:
        assert {f"attention_forward_kernel_v2_hd{hd}_w{w}_mt{mt}_n{n}_bf16"
                for w, mt, n in attn.FWD_CONFIGS[hd]} <= names
        assert {f"attention_backward_dkdv_kernel_v2_hd{hd}_w{w}_m{m}_bf16" for w, m in attn.DKDV_CONFIGS[hd]} <= names
        assert {f"attention_backward_dq_kernel_v2_hd{hd}_w{w}_n{n}_bf16" for w, n in attn.DQ_CONFIGS[hd]} <= names
        assert f"attention_backward_preprocess_kernel_v2_hd{hd}_bf16" in names
    assert {"attention_softmax_forward_kernel_v1_bf16", "attention_permute_kernel_v1_f32"} <= names


# ------------------------------------------------------------------- GPU -----

def _locate(out, ref, B, T, NH, hd, S=1):
    """Where the error is: worst (b, part, head, 16-row block) by relative error, as text."""
    o = np.asarray(out, np.float64).reshape(B, T, S, NH, hd)
    r = np.asarray(ref, np.float64).reshape(B, T, S, NH, hd)
    nb = -(-T // 16)
    rows = []
    for b in range(B):
        for s in range(S):
            for h in range(NH):
                for blk in range(nb):
                    sl = slice(16 * blk, 16 * blk + 16)
                    d = o[b, sl, s, h] - r[b, sl, s, h]
                    err = float(np.linalg.norm(d) / max(np.linalg.norm(r[b, sl, s, h]), 1e-30))
                    nan = int(np.isnan(o[b, sl, s, h]).sum())
                    rows.append((err if not nan else np.inf, b, s, h, blk, nan))
    rows.sort(reverse=True)
    part = "qkv" if S == 3 else "o"
    lines = [f"  b={b} {part[s]} head={h} rows {16 * blk}..{min(16 * blk + 15, T - 1)}: rel err {e:.3e}"
             + (f" ({nan} NaN)" if nan else "") for e, b, s, h, blk, nan in rows[:8]]
    n_bad = sum(1 for e, *_ in rows if e > 1e-2)
    return f"{n_bad}/{len(rows)} blocks above 1e-2; worst:\n" + "\n".join(lines)


def _lse_locate(lse, ref):
    d = np.abs(np.asarray(lse, np.float64) - ref)
    b, h, t = np.unravel_index(np.nanargmax(np.where(np.isnan(d), np.inf, d)), d.shape)
    return f"max |lse err| {np.nanmax(d):.3e} at b={b} h={h} t={t}; NaN: {int(np.isnan(d).sum())}"


def _tol(dtype):
    return 1e-2 if dtype == BF16 else 1e-5


SHAPES = [  # (B, NH, T, hd)
    (1, 1, 1, 64), (2, 3, 17, 64), (1, 2, 64, 64), (2, 2, 100, 64), (1, 2, 129, 64),
    (1, 3, 257, 64), (1, 2, 1024, 64),
    (5, 7, 129, 64),   # 35 heads: v3's block order walks groups of 16 heads, the last one short
    (1, 1, 1, 128), (2, 1, 17, 128), (1, 2, 100, 128), (1, 2, 257, 128), (1, 1, 1024, 128),
    (3, 6, 200, 128),
]
CASES = ([(2, BF16, s) for s in SHAPES] + [(1, BF16, s) for s in SHAPES[1:6:2] + SHAPES[8:10]]
         + [(1, np.float32, s) for s in SHAPES[1:6:2] + SHAPES[8:10] + [(2, 2, 33, 32)]])


def _ids(c):
    v, dt, (B, NH, T, hd) = c
    return f"v{v}-{np.dtype(dt).name}-B{B}-NH{NH}-T{T}-hd{hd}"


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gpu_forward(rng, case):
    cp = runtime.cupy
    version, dtype, (B, NH, T, hd) = case
    qkv = _qkv(rng, B, T, NH, hd, dtype, sigma=1.5)
    out = poison((B, T, NH * hd), dtype)
    lse = poison((B, NH, T), np.float32)
    gpucore.attention_forward(cp.asarray(qkv), NH, out=out, lse=lse, version=version)
    ref_out, ref_lse = attn.attention_forward_reference(qkv, NH)
    o, l_ = to_cpu(out), to_cpu(lse)
    err = rel_err(o, ref_out)
    assert err < _tol(dtype), f"out rel err {err:.3e}\n{_locate(o, ref_out, B, T, NH, hd)}"
    lse_err = np.abs(l_.astype(np.float64) - ref_lse)
    assert np.all(lse_err < (2e-3 if dtype == BF16 else 1e-4)), _lse_locate(l_, ref_lse)


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gpu_backward(rng, case):
    cp = runtime.cupy
    version, dtype, (B, NH, T, hd) = case
    qkv = _qkv(rng, B, T, NH, hd, dtype, sigma=1.5)
    dout = rng.standard_normal((B, T, NH * hd)).astype(dtype)
    qkv_g, dout_g = cp.asarray(qkv), cp.asarray(dout)
    out, lse = gpucore.attention_forward(qkv_g, NH, version=version)
    dqkv = poison(qkv.shape, dtype)
    gpucore.attention_backward(dout_g, qkv_g, out, lse, NH, dqkv=dqkv, version=version)
    ref = attn.attention_backward_reference(dout, qkv, NH)
    d = to_cpu(dqkv)
    C = NH * hd
    # fp32: dS = P (dP - D) cancels, so allow a little more than the forward
    tol = _tol(dtype) if dtype == BF16 else 3e-5
    for s, name in enumerate("qkv"):
        part, rpart = d[..., s * C:(s + 1) * C], ref[..., s * C:(s + 1) * C]
        err = rel_err(part, rpart)
        assert err < tol, f"d{name} rel err {err:.3e}\n{_locate(d, ref, B, T, NH, hd, S=3)}"


FLASH_VARIANTS = ([("fwd", hd, c) for hd, cs in attn.FWD_CONFIGS.items() for c in cs[1:]]
                  + [("dkdv", hd, c) for hd, cs in attn.DKDV_CONFIGS.items() for c in cs[1:]]
                  + [("dq", hd, c) for hd, cs in attn.DQ_CONFIGS.items() for c in cs[1:]])


@pytest.mark.cuda
@pytest.mark.parametrize("variant", FLASH_VARIANTS, ids=lambda v: f"{v[0]}-hd{v[1]}-" + "-".join(map(str, v[2])))
def test_gpu_flash_tile_variants(rng, variant):
    """The non-default tile configurations (timed by `bench attention --opt sweep=1`) are correct too."""
    cp = runtime.cupy
    kind, hd, cfg = variant
    B, NH, T = 2, 2, 301
    C = NH * hd
    qkv = _qkv(rng, B, T, NH, hd, BF16, sigma=1.5)
    dout = rng.standard_normal((B, T, C)).astype(BF16)
    qkv_g, dout_g = cp.asarray(qkv), cp.asarray(dout)
    out, lse = poison((B, T, C), BF16), poison((B, NH, T), np.float32)
    attn._forward_v2(qkv_g, NH, out, lse, cfg=cfg if kind == "fwd" else None)
    ref_out, _ = attn.attention_forward_reference(qkv, NH)
    assert rel_err(to_cpu(out), ref_out) < 1e-2, _locate(to_cpu(out), ref_out, B, T, NH, hd)
    dqkv = poison(qkv.shape, BF16)
    attn._backward_v2(dout_g, qkv_g, out, lse, NH, dqkv, dkdv_cfg=cfg if kind == "dkdv" else None,
                      dq_cfg=cfg if kind == "dq" else None)
    ref = attn.attention_backward_reference(dout, qkv, NH)
    d = to_cpu(dqkv)
    assert rel_err(d, ref) < 1e-2, _locate(d, ref, B, T, NH, hd, S=3)


@pytest.mark.cuda
@pytest.mark.parametrize("version,dtype,hd", [(2, BF16, 64), (2, BF16, 128), (1, BF16, 64), (1, np.float32, 64)])
def test_gpu_deterministic(rng, version, dtype, hd):
    cp = runtime.cupy
    B, NH, T = 2, 3, 300
    qkv = cp.asarray(_qkv(rng, B, T, NH, hd, dtype))
    dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(dtype))
    runs = []
    for _ in range(2):
        out, lse = gpucore.attention_forward(qkv, NH, version=version)
        dqkv = gpucore.attention_backward(dout, qkv, out, lse, NH, version=version)
        runs.append([to_cpu(a).tobytes() for a in (out, lse, dqkv)])
    assert runs[0] == runs[1]


@pytest.mark.cuda
def test_gpu_default_version_is_flash_for_bf16(rng):
    cp = runtime.cupy
    qkv = cp.asarray(_qkv(rng, 1, 70, 2, 64, BF16))
    out, lse = gpucore.attention_forward(qkv, 2)
    out2, lse2 = gpucore.attention_forward(qkv, 2, version=2)
    assert to_cpu(out).tobytes() == to_cpu(out2).tobytes()
    with pytest.raises(TypeError, match="version 2 takes bfloat16"):
        gpucore.attention_forward(qkv.astype(np.float32), 2, version=2)
    with pytest.raises(ValueError, match="head dims"):
        gpucore.attention_forward(cp.asarray(_qkv(rng, 1, 8, 2, 32, BF16)), 2, version=2)


class _PeakHook(runtime.cupy.cuda.MemoryHook if runtime.cupy is not None else object):
    """Peak bytes taken from CuPy's memory pool while active (what a call allocates)."""
    name = "gpucore_test_peak"

    def __init__(self):
        self.cur = self.peak = 0

    def malloc_postprocess(self, **kw):
        self.cur += kw["mem_size"]
        self.peak = max(self.peak, self.cur)

    def free_postprocess(self, **kw):
        self.cur -= kw["mem_size"]


@pytest.mark.cuda
def test_gpu_flash_scratch_is_O_BNHT(rng):
    cp = runtime.cupy
    B, NH, T, hd = 2, 4, 2048, 64
    qkv = cp.asarray(_qkv(rng, B, T, NH, hd, BF16))
    dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(BF16))
    out, lse = gpucore.attention_forward(qkv, NH, version=2)
    dqkv = cp.empty_like(qkv)
    gpucore.attention_backward(dout, qkv, out, lse, NH, dqkv=dqkv, version=2)   # compile first
    cp.cuda.Device().synchronize()
    with _PeakHook() as fwd:
        gpucore.attention_forward(qkv, NH, out=out, lse=lse, version=2)
    with _PeakHook() as bwd:
        gpucore.attention_backward(dout, qkv, out, lse, NH, dqkv=dqkv, version=2)
    assert fwd.peak == 0
    assert bwd.peak <= -(-4 * B * NH * T // 512) * 512           # D only, pool-rounded
    with _PeakHook() as v1:
        gpucore.attention_forward(qkv, NH, out=out, lse=lse, version=1)
    assert v1.peak >= B * NH * T * T * 4                           # v1 stores the scores


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,hd", [(BF16, 64), (np.float32, 16)])
def test_gpu_attention_convenience(rng, causal, dtype, hd):
    cp = runtime.cupy
    B, NH, T = 2, 3, 45
    q, k, v = (rng.standard_normal((B, NH, T, hd)).astype(dtype) for _ in range(3))
    y = gpucore.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=causal)
    ref = gpucore.attention(q.astype(np.float64).astype(np.float32), k.astype(np.float32),
                            v.astype(np.float32), causal=causal)
    assert y.shape == q.shape and y.dtype == dtype
    assert rel_err(to_cpu(y), ref) < _tol(dtype)


# ------------------------------------------------------- version 3 backward -----
# kernels_cu/flash_attention_v3_bwd.cu (wgmma, sm_90a). The forward here is v2 (measured
# correct on an H200), so a failure points at the v3 backward alone; the messages name
# dq / dk / dv and the worst (b, head, 16-row block): all blocks bad -> a fragment layout or
# descriptor; only diagonal blocks -> the causal mask; only the last block -> T tails.

def test_v3_tables_match_kernel_instantiations():
    src = runtime.KERNEL_DIR / "flash_attention_v3_bwd.cu"

    def table(rows):
        t = {}
        for hd, *cfg in rows:
            t.setdefault(hd, []).append(tuple(cfg))
        return t

    # instantiations are (hd, warpgroups, tile, min blocks per SM); the tables omit the last
    def same(kernels, configs):   # order-free: the Python tables put the measured default first
        return {hd: sorted(v) for hd, v in kernels.items()} == {hd: sorted(v) for hd, v in configs.items()}

    # fused-D dq kernels (FLASH_V3_DQF) are the table's (warpgroups, BN, V3_FD) entries, register-A
    # ones (FLASH_V3_*_RA) the (warpgroups, tile, V3_RA) entries
    assert same(table([r[:3] for r in _instantiations(src, "FLASH_V3_DKDV")]
                      + [(*r[:3], attn.V3_RA) for r in _instantiations(src, "FLASH_V3_DKDV_RA")]), attn.V3_DKDV_CONFIGS)
    assert same(table([r[:3] for r in _instantiations(src, "FLASH_V3_DQ")]
                      + [(*r[:3], attn.V3_FD) for r in _instantiations(src, "FLASH_V3_DQF")]
                      + [(*r[:3], attn.V3_RA) for r in _instantiations(src, "FLASH_V3_DQ_RA")]), attn.V3_DQ_CONFIGS)
    assert set(attn.V3_DKDV_CONFIGS) == set(attn.V3_DQ_CONFIGS) <= set(attn.FWD_CONFIGS)
    for hd in attn.V3_DKDV_CONFIGS:
        for g, bm, *var in attn.V3_DKDV_CONFIGS[hd]:
            assert var in ([], [attn.V3_RA]) and (not var or (bm, hd) == (64, 64))
            assert bm in (64, 128) and attn._v3_dkdv_smem(hd, g, bm) <= 227 * 1024
            assert (bm * hd // 8) % (128 * g) == 0 and (64 * g * hd // 8) % (128 * g) == 0
        for g, bn, *var in attn.V3_DQ_CONFIGS[hd]:
            assert bn in (64, 128) and attn._v3_dq_smem(hd, g, bn) <= 227 * 1024
            assert var in ([], [attn.V3_FD], [attn.V3_RA]) and (var != [attn.V3_RA] or (bn, hd) == (64, 64))
            assert (bn * hd // 8) % (128 * g) == 0


def test_v3_backward_version_argument_on_numpy(rng):
    qkv = _qkv(rng, 1, 5, 2, 4)
    out, lse = gpucore.attention_forward(qkv, 2)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    ref = attn.attention_backward_reference(dout, qkv, 2)
    assert rel_err(gpucore.attention_backward(dout, qkv, out, lse, 2, version=3), ref) < 1e-6
    with pytest.raises(ValueError, match="version"):
        gpucore.attention_backward(dout, qkv, out, lse, 2, version=4)


@pytest.mark.skipif(runtime.cupy is None, reason="needs CuPy + NVRTC")
def test_v3_backward_kernels_compile_for_sm90a_without_spills():
    src = runtime.KERNEL_DIR / "flash_attention_v3_bwd.cu"
    rows = runtime.check_kernels(("90a",), [src])
    assert rows and not [r for r in rows if not r["ok"]], rows
    # ptxas info C7510..C7515: wgmma serialised (e.g. too few registers) -- correct but slow
    log = runtime.compile_cubin(src, "90a", verbose_ptxas=True).log
    assert "serialized" not in log, [ln for ln in log.splitlines() if "serialized" in ln]
    names = {r["kernel"] for r in rows}
    for hd in attn.V3_DKDV_CONFIGS:
        suffix = lambda c: attn.V3_VARIANT_SUFFIX[attn._v3_variant(c)]  # noqa: E731
        assert {f"attention_backward_dkdv_kernel_v3_hd{hd}_g{c[0]}_m{c[1]}{suffix(c)}_bf16"
                for c in attn.V3_DKDV_CONFIGS[hd]} <= names
        assert {f"attention_backward_dq_kernel_v3_hd{hd}_g{c[0]}_n{c[1]}{suffix(c)}_bf16"
                for c in attn.V3_DQ_CONFIGS[hd]} <= names


def _need_sm90():
    if runtime.device_arch() != attn.V3_ARCH[:-1]:
        pytest.skip(f"version 3 backward needs sm_{attn.V3_ARCH[:-1]}")


def _v3_case(rng, B, NH, T, hd, run):
    """v2 forward, then `run(dout, qkv, out, lse, dqkv)` into a NaN-poisoned dqkv; checks dq, dk, dv."""
    cp = runtime.cupy
    C = NH * hd
    qkv = _qkv(rng, B, T, NH, hd, BF16, sigma=1.5)
    dout = rng.standard_normal((B, T, C)).astype(BF16)
    qkv_g, dout_g = cp.asarray(qkv), cp.asarray(dout)
    out, lse = gpucore.attention_forward(qkv_g, NH, version=2)
    dqkv = poison(qkv.shape, BF16)
    run(dout_g, qkv_g, out, lse, dqkv)
    ref = attn.attention_backward_reference(dout, qkv, NH)
    d = to_cpu(dqkv)
    for s, name in enumerate("qkv"):
        part, rpart = d[..., s * C:(s + 1) * C], ref[..., s * C:(s + 1) * C]
        err = rel_err(part, rpart)
        assert err < 1e-2, f"d{name} rel err {err:.3e}\n{_locate(d, ref, B, T, NH, hd, S=3)}"


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-NH{}-T{}-hd{}".format(*s))
def test_gpu_backward_v3(rng, shape):
    _need_sm90()
    B, NH, T, hd = shape
    _v3_case(rng, B, NH, T, hd,
             lambda do, qkv, o, l, dqkv: gpucore.attention_backward(do, qkv, o, l, NH, dqkv=dqkv, version=3))


V3_VARIANTS = ([("dkdv", hd, c) for hd, cs in attn.V3_DKDV_CONFIGS.items() for c in cs[1:]]
               + [("dq", hd, c) for hd, cs in attn.V3_DQ_CONFIGS.items() for c in cs[1:]])


@pytest.mark.cuda
@pytest.mark.parametrize("variant", V3_VARIANTS, ids=lambda v: f"{v[0]}-hd{v[1]}-" + "-".join(map(str, v[2])))
@pytest.mark.parametrize("T", [100, 301])
def test_gpu_backward_v3_tile_variants(rng, variant, T):
    _need_sm90()
    kind, hd, cfg = variant
    kw = {"dkdv_cfg" if kind == "dkdv" else "dq_cfg": cfg}
    _v3_case(rng, 2, 2, T, hd, lambda do, qkv, o, l, dqkv: attn._backward_v3(do, qkv, o, l, 2, dqkv, **kw))


@pytest.mark.cuda
@pytest.mark.parametrize("hd", [64, 128])
def test_gpu_v3_block_order_same_bits(rng, hd):
    """V3_HEAD_GROUP only reorders blocks: every group size (0 = the old order) gives the same
    bits, forward and backward, with 35 heads (two full groups of 16 and a short one)."""
    _need_sm90()
    cp = runtime.cupy
    B, NH, T = 5, 7, 200
    qkv = cp.asarray(_qkv(rng, B, T, NH, hd, BF16))
    dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(BF16))
    default, runs = attn.V3_HEAD_GROUP, []
    try:
        for group in (0, 1, 16, 64):
            attn.V3_HEAD_GROUP = group
            out, lse = gpucore.attention_forward(qkv, NH, version=3)
            dqkv = gpucore.attention_backward(dout, qkv, out, lse, NH, version=3)
            runs.append(b"".join(to_cpu(x).tobytes() for x in (out, lse, dqkv)))
    finally:
        attn.V3_HEAD_GROUP = default
    assert all(r == runs[0] for r in runs[1:])


def _v3_backward_case(rng, hd, B=2, NH=3, T=300):
    """(NH, qkv, dout, out, lse) on the GPU for the v3 backward tests: bf16, T not a tile multiple,
    forward by v2 (the backward under test gets the same inputs whatever v3's forward does)."""
    cp = runtime.cupy
    qkv = cp.asarray(_qkv(rng, B, T, NH, hd, BF16))
    dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(BF16))
    out, lse = gpucore.attention_forward(qkv, NH, version=2)
    return NH, qkv, dout, out, lse


@pytest.mark.cuda
@pytest.mark.parametrize("hd", [64, 128])
def test_gpu_deterministic_v3(rng, hd):
    _need_sm90()
    NH, qkv, dout, out, lse = _v3_backward_case(rng, hd)
    runs = [to_cpu(gpucore.attention_backward(dout, qkv, out, lse, NH, version=3)).tobytes() for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.cuda
@pytest.mark.parametrize("hd", [64, 128])
def test_gpu_backward_v3_streams_and_fused_d_same_bits(rng, hd):
    """The concurrent dQ pass (side stream) gives the bits of the one-stream order, run after run,
    also on a non-default caller stream; the fused-D dq configs are deterministic and correct."""
    _need_sm90()
    cp = runtime.cupy
    NH, qkv, dout, out, lse = _v3_backward_case(rng, hd)

    def run(**kw):
        dqkv = poison(qkv.shape, BF16)
        attn._backward_v3(dout, qkv, out, lse, NH, dqkv, **kw)
        return to_cpu(dqkv).tobytes()        # reads on the caller's stream: must see the side stream's dQ

    one = run(streams=False)
    assert run(streams=True) == one and run(streams=True) == one
    with cp.cuda.Stream(non_blocking=True):
        assert run(streams=True) == one
    for cfg in [c for c in attn.V3_DQ_CONFIGS[hd] if attn._v3_variant(c) == attn.V3_FD]:
        fd = [run(dq_cfg=cfg) for _ in range(2)]
        assert fd[0] == fd[1], cfg
        ref = np.frombuffer(one, dtype=BF16).astype(np.float32)
        got = np.frombuffer(fd[0], dtype=BF16).astype(np.float32)
        assert rel_err(got, ref) < 1e-2, cfg


@pytest.mark.cuda
def test_gpu_default_backward_is_v3_on_sm90(rng):
    _need_sm90()
    cp = runtime.cupy
    NH, qkv, dout, out, lse = _v3_backward_case(rng, 64, B=1, NH=2, T=70)
    d_default = gpucore.attention_backward(dout, qkv, out, lse, NH)
    d3 = gpucore.attention_backward(dout, qkv, out, lse, NH, version=3)
    if attn.V3_BWD_DEFAULT:
        assert to_cpu(d_default).tobytes() == to_cpu(d3).tobytes()
    q32 = qkv.astype(np.float32)
    o32, l32 = gpucore.attention_forward(q32, NH, version=1)
    with pytest.raises(TypeError, match="version 3 backward takes bfloat16"):
        gpucore.attention_backward(dout.astype(np.float32), q32, o32, l32, NH, version=3)
    q32h = cp.asarray(_qkv(rng, 1, 8, 2, 32, BF16))
    o32h, l32h = gpucore.attention_forward(q32h, 2)
    with pytest.raises(ValueError, match="head dims"):
        gpucore.attention_backward(cp.zeros_like(o32h), q32h, o32h, l32h, 2, version=3)


# ------------------------------------------------------- version 3 forward -----
# kernels_cu/flash_attention_v3.cu (wgmma, sm_90a). Its out/lse feed v2's backward (measured
# correct on an H200), so test_gpu_v3_forward_v2_backward checks the layouts end to end. The
# messages name the worst (b, head, 16-row block): every block bad -> a fragment layout or a
# descriptor (S = Q K^T: smem layout / K-major descriptor; O += P V: register-A packing / the
# MN-major V descriptor); rows 64..127 of each tile only -> warpgroup 1's Q descriptor offset;
# diagonal blocks only -> the causal mask; the last block only -> T tails (zero-fill / stores).

def _v3_fwd_table():
    """hd -> sorted configs of both v3 forward files (2-tuples: flash_attention_v3.cu,
    (g, bn, stages): the pipelined flash_attention_v3p.cu); order is set in Python only."""
    t = {}
    for hd, g, bn, _minb in _instantiations(runtime.KERNEL_DIR / "flash_attention_v3.cu", "FLASH_FWD_V3"):
        t.setdefault(hd, []).append((g, bn))
    for hd, g, bn, st, _minb in _instantiations(runtime.KERNEL_DIR / "flash_attention_v3p.cu", "FLASH_FWD_V3P"):
        t.setdefault(hd, []).append((g, bn, st))
    return {hd: sorted(c) for hd, c in t.items()}


def test_v3_forward_table_matches_kernel_instantiations():
    assert _v3_fwd_table() == {hd: sorted(c) for hd, c in attn.V3_FWD_CONFIGS.items()}
    assert set(attn.V3_FWD_CONFIGS) <= set(attn.FWD_CONFIGS)   # v2 is the fallback for the same hd
    for hd, cfgs in attn.V3_FWD_CONFIGS.items():
        assert hd in (64, 128)
        for g, bn, *st in cfgs:
            nt = 128 * g
            assert g in (1, 2) and bn in (64, 128) and attn._v3_fwd_smem(hd, g, bn, *st) <= 227 * 1024
            assert not st or st[0] in (3, 4)
            assert (64 * g * hd // 8) % nt == 0 and (bn * hd // 8) % nt == 0   # copy loops divide evenly


def test_v3_forward_version_argument_on_numpy(rng):
    qkv = _qkv(rng, 1, 5, 2, 4)
    ref_out, ref_lse = attn.attention_forward_reference(qkv, 2)
    out, lse = gpucore.attention_forward(qkv, 2, version=3)   # NumPy: the reference, any version
    assert rel_err(out, ref_out) < 1e-6 and np.allclose(lse, ref_lse, atol=1e-6)
    with pytest.raises(ValueError, match="version"):
        gpucore.attention_forward(qkv, 2, version=4)


@pytest.mark.skipif(runtime.cupy is None, reason="needs CuPy + NVRTC")
def test_v3_forward_kernels_compile_for_sm90a_without_spills():
    rows = runtime.check_kernels(("90a",), [runtime.KERNEL_DIR / "flash_attention_v3.cu",
                                            runtime.KERNEL_DIR / "flash_attention_v3p.cu"])
    assert rows and not [r for r in rows if not r["ok"]], rows
    # ptxas C7520 etc.: wgmma serialised (e.g. a branch while one is in flight) -- the pipelined
    # kernels would still be correct but lose their overlap
    log = runtime.compile_cubin(runtime.KERNEL_DIR / "flash_attention_v3p.cu", "90a", verbose_ptxas=True).log
    assert "serialized" not in log, [ln for ln in log.splitlines() if "serialized" in ln]
    names = {r["kernel"] for r in rows}
    for hd, cfgs in attn.V3_FWD_CONFIGS.items():
        assert {f"attention_forward_kernel_v3_hd{hd}_g{c[0]}_n{c[1]}" + "".join(f"_s{x}" for x in c[2:]) + "_bf16"
                for c in cfgs} <= names


def _need_sm90_fwd():
    if runtime.device_arch() != attn.V3_FWD_ARCH[:-1]:
        pytest.skip(f"version 3 forward needs sm_{attn.V3_FWD_ARCH[:-1]}")


def _v3_forward_check(rng, B, NH, T, hd, cfg=None, sigma=1.5):
    """v3 forward (config cfg) into NaN-poisoned out/lse vs the float64 reference."""
    cp = runtime.cupy
    qkv = _qkv(rng, B, T, NH, hd, BF16, sigma=sigma)
    out = poison((B, T, NH * hd), BF16)
    lse = poison((B, NH, T), np.float32)
    attn._forward_v3(cp.asarray(qkv), NH, out, lse, cfg=cfg)
    ref_out, ref_lse = attn.attention_forward_reference(qkv, NH)
    o, l_ = to_cpu(out), to_cpu(lse)
    err = rel_err(o, ref_out)
    assert not np.isnan(o.astype(np.float32)).any(), f"NaN in out\n{_locate(o, ref_out, B, T, NH, hd)}"
    assert err < 1e-2, f"cfg {cfg}: out rel err {err:.3e}\n{_locate(o, ref_out, B, T, NH, hd)}"
    lse_err = np.abs(l_.astype(np.float64) - ref_lse)
    assert np.all(lse_err < 2e-3), f"cfg {cfg}: " + _lse_locate(l_, ref_lse)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-NH{}-T{}-hd{}".format(*s))
def test_gpu_forward_v3(rng, shape):
    """Default config per hd over T in {1, 17, 64, 100, 129, 257, 1024}, via the public API."""
    _need_sm90_fwd()
    test_gpu_forward(rng, (3, BF16, shape))


V3_FWD_VARIANTS = [(hd, c) for hd, cs in attn.V3_FWD_CONFIGS.items() for c in cs]


@pytest.mark.cuda
@pytest.mark.parametrize("variant", V3_FWD_VARIANTS,
                         ids=lambda v: f"hd{v[0]}-g{v[1][0]}-n{v[1][1]}" + "".join(f"-s{x}" for x in v[1][2:]))
@pytest.mark.parametrize("T", [1, 64, 100, 129, 301])
def test_gpu_forward_v3_tile_variants(rng, variant, T):
    _need_sm90_fwd()
    hd, cfg = variant
    _v3_forward_check(rng, 2, 2, T, hd, cfg=cfg)


@pytest.mark.cuda
@pytest.mark.parametrize("hd", [64, 128])
def test_gpu_forward_v3_sharp_softmax(rng, hd):
    """Large scores (sigma 4): the running max changes often, exercising the O rescale."""
    _need_sm90_fwd()
    _v3_forward_check(rng, 1, 2, 300, hd, sigma=4.0)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(2, 3, 17, 64), (1, 2, 129, 64), (2, 2, 257, 64), (1, 2, 100, 128),
                                   (1, 1, 1024, 64)], ids=lambda s: "B{}-NH{}-T{}-hd{}".format(*s))
def test_gpu_v3_forward_v2_backward(rng, shape):
    """v3's out/lse drive v2's backward to the reference gradients (the layouts agree)."""
    _need_sm90_fwd()
    cp = runtime.cupy
    B, NH, T, hd = shape
    C = NH * hd
    qkv = _qkv(rng, B, T, NH, hd, BF16, sigma=1.5)
    dout = rng.standard_normal((B, T, C)).astype(BF16)
    qkv_g, dout_g = cp.asarray(qkv), cp.asarray(dout)
    out, lse = gpucore.attention_forward(qkv_g, NH, version=3)
    out2, lse2 = gpucore.attention_forward(qkv_g, NH, version=2)
    assert rel_err(to_cpu(out), to_cpu(out2)) < 1e-2
    assert float(cp.abs(lse - lse2).max()) < 2e-3
    dqkv = poison(qkv.shape, BF16)
    gpucore.attention_backward(dout_g, qkv_g, out, lse, NH, dqkv=dqkv, version=2)
    ref = attn.attention_backward_reference(dout, qkv, NH)
    d = to_cpu(dqkv)
    for s, name in enumerate("qkv"):
        err = rel_err(d[..., s * C:(s + 1) * C], ref[..., s * C:(s + 1) * C])
        assert err < 1e-2, f"d{name} rel err {err:.3e}\n{_locate(d, ref, B, T, NH, hd, S=3)}"


@pytest.mark.cuda
@pytest.mark.parametrize("hd", [64, 128])
def test_gpu_deterministic_v3_forward(rng, hd):
    _need_sm90_fwd()
    cp = runtime.cupy
    NH = 3
    qkv = cp.asarray(_qkv(rng, 2, 300, NH, hd, BF16))
    runs = [[to_cpu(a).tobytes() for a in gpucore.attention_forward(qkv, NH, version=3)] for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.cuda
def test_gpu_default_forward_is_v3_on_sm90(rng):
    _need_sm90_fwd()
    cp = runtime.cupy
    NH = 2
    qkv = cp.asarray(_qkv(rng, 1, 70, NH, 64, BF16))
    o_def, l_def = gpucore.attention_forward(qkv, NH)
    o3, l3 = gpucore.attention_forward(qkv, NH, version=3)
    if attn.V3_FWD_DEFAULT:
        assert to_cpu(o_def).tobytes() == to_cpu(o3).tobytes()
        assert to_cpu(l_def).tobytes() == to_cpu(l3).tobytes()
    with pytest.raises(TypeError, match="version 3 forward takes bfloat16"):
        gpucore.attention_forward(qkv.astype(np.float32), NH, version=3)
    with pytest.raises(ValueError, match="head dims"):
        gpucore.attention_forward(cp.asarray(_qkv(rng, 1, 8, 2, 32, BF16)), 2, version=3)
    o32, _ = gpucore.attention_forward(cp.asarray(_qkv(rng, 1, 8, 2, 32, BF16)), 2)   # default falls back
    assert not np.isnan(to_cpu(o32).astype(np.float32)).any()
