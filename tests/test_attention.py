"""Causal attention, the production path: the float64 reference, its gradient, and v1 / v2 / v3
with their default configs against it.

CPU: reference vs an independent per-row loop, reference backward vs finite
differences, argument checks, the default configs instantiated in the kernel files,
the version picker reading gpucore.settings.
GPU (pytest -m cuda): v1 (cuBLAS + softmax kernels, fp32 and bf16), v2 (flash, bf16)
and v3 (Hopper wgmma, sm_90 only) forward and backward on shapes with T not a multiple
of any tile, hd 64 and 128; outputs poisoned with NaN first; bitwise determinism; the
flash scratch is O(B*NH*T). On a failure the message names the worst (batch, head,
16-row block) so a fragment-layout or masking bug shows up as a pattern (e.g. only
diagonal blocks, only rows >= 64, only head 1).
The non-default configs and the non-pipelined v3 forward: tests/ladder/test_attention.py;
the helpers both use: tests/attention_checks.py.
"""
import math

import numpy as np
import pytest

import gpucore
from gpucore import runtime, settings
from gpucore.bench.attention import peak_hook
from gpucore.ops import attention as attn
from gpucore.ops.fp8 import fp8_amax
from attention_checks import (BF16, check_v2_config_limits, check_v3_backward, check_v3_bwd_config_limits,
                              check_v3_forward, check_v3_fwd_config_limits, instantiations, kernel_rows, locate,
                              lse_locate, make_qkv, need_sm90, v2_instantiations, v2_names, v3_backward_bits,
                              v3_backward_case, v3_bwd_instantiations, v3_bwd_names, v3_fwd_instantiations,
                              v3_fwd_names)
from conftest import poison, rel_err, to_cpu
from gradcheck import assert_grad_close, numerical_grad

# the production default configs as one-entry tables (hd -> [config]), the shape of the ladder's tables
DEFAULT_V2_FWD, DEFAULT_V2_DKDV, DEFAULT_V2_DQ, DEFAULT_V3_FWD, DEFAULT_V3_DKDV, DEFAULT_V3_DQ = (
    {hd: [cfg] for hd, cfg in table.items()} for table in (attn.V2_FWD_CONFIG, attn.V2_DKDV_CONFIG, attn.V2_DQ_CONFIG,
                                                           attn.V3_FWD_CONFIG, attn.V3_DKDV_CONFIG, attn.V3_DQ_CONFIG))


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
    qkv = make_qkv(rng, B, T, NH, hd)
    out, lse = attn.attention_forward_reference(qkv, NH)
    n_out, n_lse = _naive_forward(qkv, NH)
    np.testing.assert_allclose(out, n_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, n_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("B,T,NH,hd", [(1, 1, 1, 2), (2, 4, 2, 3), (1, 5, 1, 4)])
def test_reference_backward_gradcheck(rng, B, T, NH, hd):
    qkv = make_qkv(rng, B, T, NH, hd).astype(np.float64)
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
    qkv = make_qkv(rng, B, T, NH, hd, dtype)
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
    qkv = make_qkv(rng, 2, 4, 2, 4)
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


def test_python_tables_match_kernel_instantiations():
    """The v2 default configs are instantiated (the other instantiations: tests/ladder)."""
    fwd, dkdv, dq = v2_instantiations()
    for table, kernels in ((attn.V2_FWD_CONFIG, fwd), (attn.V2_DKDV_CONFIG, dkdv), (attn.V2_DQ_CONFIG, dq)):
        assert set(table) == set(kernels)
        assert all(cfg in kernels[hd] for hd, cfg in table.items()), (table, kernels)
    bwd = runtime.KERNEL_DIR / "attention" / "flash_bwd.cu"
    assert {hd for (hd,) in instantiations(bwd, "FLASH_BWD_PRE")} == set(attn.V2_FWD_CONFIG)
    assert set(attn.V2_DKDV_CONFIG) == set(attn.V2_DQ_CONFIG) == set(attn.V2_FWD_CONFIG)
    check_v2_config_limits(DEFAULT_V2_FWD, DEFAULT_V2_DKDV, DEFAULT_V2_DQ)


def test_scratch_is_linear_in_T_for_flash():
    B, NH, hd = 64, 12, 64
    for T in (1024, 4096):
        assert attn.scratch_bytes(B, T, NH, hd, BF16, 2) == 0
        assert attn.scratch_bytes(B, T, NH, hd, BF16, 2, backward=True) == 4 * B * NH * T
        assert attn.scratch_bytes(B, T, NH, hd, BF16, 1, backward=True) > B * NH * T * T * 4


@pytest.mark.skipif(runtime.cupy is None, reason="needs CuPy + NVRTC")
def test_attention_kernel_names_match_the_launchers():
    """Every name ops/attention.py launches exists (sm_90 only: tests/test_runtime.py covers archs and spills)."""
    rows = kernel_rows("90", "attention/classic.cu", "attention/flash_fwd.cu", "attention/flash_bwd.cu")
    assert not [r for r in rows if not r["ok"]]
    names = {r["kernel"] for r in rows}
    assert v2_names(DEFAULT_V2_FWD, DEFAULT_V2_DKDV, DEFAULT_V2_DQ) <= names
    assert {f"attention_backward_preprocess_kernel_v2_hd{hd}_bf16" for hd in attn.V2_FWD_CONFIG} <= names
    assert {"attention_softmax_forward_kernel_v1_bf16", "attention_permute_kernel_v1_f32"} <= names


def test_default_version_follows_settings():
    """pick_version (no GPU needed) is the production path of ops/attention.py's docstring, and reads
    settings.attention_v3_forward / attention_v3_backward each call."""
    pick = attn.pick_version
    for what in ("forward", "backward"):
        flag = f"attention_v3_{what}"
        assert pick(what, None, BF16, 64, "90") == 3
        assert pick(what, None, BF16, 128, "90") == 3
        assert pick(what, None, BF16, 64, "80") == 2          # no wgmma: v2
        assert pick(what, None, BF16, 64, "90", misaligned="qkv") == 1
        assert pick(what, None, BF16, 32, "90") == 1          # other head dims: v1
        assert pick(what, None, np.float32, 64, "90") == 1
        with settings.using(**{flag: False}):
            assert pick(what, None, BF16, 64, "90") == 2
            assert pick(what, None, BF16, 128, "90") == 2
            assert pick(what, None, np.float32, 64, "90") == 1
            assert pick(what, 3, BF16, 64, "90") == 3          # an explicit version ignores the setting
        assert pick(what, None, BF16, 64, "90") == 3           # restored after the block
        with settings.using(attention_v3_forward=what != "forward", attention_v3_backward=what != "backward"):
            assert pick(what, None, BF16, 64, "90") == 2        # each op reads its own flag
        for v in (1, 2, 3):
            assert pick(what, v, BF16, 64, "90") == v
        assert pick(what, 1, np.float32, 32, "80") == 1
        with pytest.raises(TypeError, match=f"version 3 {what} takes bfloat16"):
            pick(what, 3, np.float32, 64, "90")
        with pytest.raises(ValueError, match="head dims"):
            pick(what, 3, BF16, 32, "90")
        with pytest.raises(ValueError, match="sm_90"):
            pick(what, 3, BF16, 64, "80")
        with pytest.raises(ValueError, match="out: version 3 .* 16-byte aligned"):
            pick(what, 3, BF16, 64, "90", misaligned="out")
        with pytest.raises(TypeError, match="version 2 takes bfloat16"):
            pick(what, 2, np.float32, 64, "90")
        with pytest.raises(ValueError, match="head dims"):
            pick(what, 2, BF16, 32, "90")
        with pytest.raises(ValueError, match="version"):
            pick(what, 4, BF16, 64, "90")


def test_launchers_refuse_ladder_configs():
    """The non-pipelined forward's configs and the fused-D dQ pass are the ladder's (before any launch)."""
    qkv = np.zeros((1, 4, 3 * 64), BF16)
    with pytest.raises(ValueError, match="forward_v3_serial"):
        attn.forward_v3(qkv, 1, None, None, config=(2, 64))
    with pytest.raises(ValueError, match="fused-D"):
        attn.backward_v3(None, qkv, None, None, 1, None, dq_config=(2, 64, 1))


def test_v3_compile_options_follow_settings():
    """The block order's head group is compiled in from settings.attention_head_group, read each call."""
    with settings.using(attention_head_group=16):
        assert attn.v3_compile_options() == ("-DV3_HEAD_GROUP=16",)
        with settings.using(attention_head_group=0):
            assert attn.v3_compile_options() == ("-DV3_HEAD_GROUP=0",)
        assert attn.v3_compile_options() == ("-DV3_HEAD_GROUP=16",)


# ------------------------------------------------------------------- GPU -----

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
    qkv = make_qkv(rng, B, T, NH, hd, dtype, sigma=1.5)
    out = poison((B, T, NH * hd), dtype)
    lse = poison((B, NH, T), np.float32)
    gpucore.attention_forward(cp.asarray(qkv), NH, out=out, lse=lse, version=version)
    ref_out, ref_lse = attn.attention_forward_reference(qkv, NH)
    o, l_ = to_cpu(out), to_cpu(lse)
    err = rel_err(o, ref_out)
    assert err < _tol(dtype), f"out rel err {err:.3e}\n{locate(o, ref_out, B, T, NH, hd)}"
    lse_err = np.abs(l_.astype(np.float64) - ref_lse)
    assert np.all(lse_err < (2e-3 if dtype == BF16 else 1e-4)), lse_locate(l_, ref_lse)


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gpu_backward(rng, case):
    cp = runtime.cupy
    version, dtype, (B, NH, T, hd) = case
    qkv = make_qkv(rng, B, T, NH, hd, dtype, sigma=1.5)
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
        assert err < tol, f"d{name} rel err {err:.3e}\n{locate(d, ref, B, T, NH, hd, S=3)}"


@pytest.mark.cuda
@pytest.mark.parametrize("version,dtype,hd", [(2, BF16, 64), (2, BF16, 128), (1, BF16, 64), (1, np.float32, 64)])
def test_gpu_deterministic(rng, version, dtype, hd):
    cp = runtime.cupy
    B, NH, T = 2, 3, 300
    qkv = cp.asarray(make_qkv(rng, B, T, NH, hd, dtype))
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
    qkv = cp.asarray(make_qkv(rng, 1, 70, 2, 64, BF16))
    out, lse = gpucore.attention_forward(qkv, 2)
    out2, lse2 = gpucore.attention_forward(qkv, 2, version=2)
    assert to_cpu(out).tobytes() == to_cpu(out2).tobytes()
    with pytest.raises(TypeError, match="version 2 takes bfloat16"):
        gpucore.attention_forward(qkv.astype(np.float32), 2, version=2)
    with pytest.raises(ValueError, match="head dims"):
        gpucore.attention_forward(cp.asarray(make_qkv(rng, 1, 8, 2, 32, BF16)), 2, version=2)


@pytest.mark.cuda
def test_gpu_flash_scratch_is_O_BNHT(rng):
    cp = runtime.cupy
    B, NH, T, hd = 2, 4, 2048, 64
    qkv = cp.asarray(make_qkv(rng, B, T, NH, hd, BF16))
    dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(BF16))
    out, lse = gpucore.attention_forward(qkv, NH, version=2)
    dqkv = cp.empty_like(qkv)
    gpucore.attention_backward(dout, qkv, out, lse, NH, dqkv=dqkv, version=2)   # compile first
    cp.cuda.Device().synchronize()
    with peak_hook() as fwd:
        gpucore.attention_forward(qkv, NH, out=out, lse=lse, version=2)
    with peak_hook() as bwd:
        gpucore.attention_backward(dout, qkv, out, lse, NH, dqkv=dqkv, version=2)
    assert fwd.peak == 0
    assert bwd.peak <= -(-4 * B * NH * T // 512) * 512           # D only, pool-rounded
    with peak_hook() as v1:
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
# kernels_cu/attention/flash_v3_bwd.cu (wgmma, sm_90a). The forward here is v2 (measured
# correct on an H200), so a failure points at the v3 backward alone; the messages name
# dq / dk / dv and the worst (b, head, 16-row block): all blocks bad -> a fragment layout or
# descriptor; only diagonal blocks -> the causal mask; only the last block -> T tails.

def test_v3_tables_match_kernel_instantiations():
    """The v3 backward's default configs are instantiated (all instantiations: tests/ladder)."""
    dkdv, dq = v3_bwd_instantiations()
    for table, kernels in ((attn.V3_DKDV_CONFIG, dkdv), (attn.V3_DQ_CONFIG, dq)):
        assert set(table) == set(kernels)
        assert all(cfg in kernels[hd] for hd, cfg in table.items()), (table, kernels)
    assert set(attn.V3_DKDV_CONFIG) == set(attn.V3_DQ_CONFIG) <= set(attn.V2_FWD_CONFIG)
    check_v3_bwd_config_limits(DEFAULT_V3_DKDV, DEFAULT_V3_DQ)


def test_v3_onepass_sizes_and_bad_head_dim():
    """The one-pass backward's shared memory (one warpgroup: two blocks per SM fit sm_90's 228 KB;
    two: one block), its f32 dQ scratch in scratch_bytes when the setting is on, and a head dim
    or warpgroup count it has no kernel for refused before any launch."""
    assert attn.v3_onepass_smem(64, 2) == 216064
    assert attn.v3_onepass_smem(64, 2) + attn.ONEPASS_SUMS_BYTES <= 227 * 1024
    with settings.using(attention_v3_onepass="on"):
        assert attn.scratch_bytes(2, 100, 3, 64, BF16, 3, backward=True) == 4 * 2 * 3 * 100 + 4 * 2 * 3 * 64 * 128
    with settings.using(attention_v3_onepass="off"):
        assert attn.scratch_bytes(2, 100, 3, 64, BF16, 3, backward=True) == 4 * 2 * 3 * 100
    qkv = np.zeros((1, 4, 3 * 128), BF16)
    with pytest.raises(ValueError, match="head dim"):
        attn.backward_v3_onepass(None, qkv, None, None, 1, None)
    with pytest.raises(ValueError, match="warpgroups"):
        attn.backward_v3_onepass(None, qkv, None, None, 2, None, wgs=3)


def test_v3_onepass_auto_rule():
    """settings.attention_v3_onepass "auto" gives the one-pass backward the heads of the most
    leading batch elements whose blocks (one per batch x head) fill their waves of the SMs to
    ONEPASS_MIN_WAVE_FILL, the rest to the two passes: d12 B=64 and d24 B=32 on 132 SMs all, d48
    B=16 (400 heads: 76%) the first 15 (375: 94.7%), small batches and hd 128 none; "on" / "off"
    force it (hd 64 only); any other value is refused."""
    assert attn.wave_fill(768, 132) == 768 / 792 and attn.wave_fill(0, 132) == 0.0
    assert attn.onepass_batches(64, 12, 64, 132, "auto") == 64       # 768 heads: 97% of 6 waves
    assert attn.onepass_batches(32, 16, 64, 132, "auto") == 32       # 512: 97% of 4
    assert attn.onepass_batches(16, 25, 64, 132, "auto") == 15       # 375 of 400: 94.7% of 3
    assert attn.onepass_batches(16, 20, 64, 132, "auto") == 13       # d36: 260 of 320, 98.5% of 2
    assert attn.onepass_batches(8, 12, 64, 132, "auto") == 0         # 96: one short wave
    assert attn.onepass_batches(64, 12, 128, 132, "auto") == 0       # no hd-128 kernel
    assert attn.onepass_batches(8, 12, 64, 132, "on") == 8 and attn.onepass_batches(8, 12, 128, 132, "on") == 0
    assert attn.onepass_batches(64, 12, 64, 132, "off") == 0
    with pytest.raises(ValueError, match="auto, on or off"):
        attn.onepass_batches(64, 12, 64, 132, "yes")
    with settings.using(attention_v3_onepass="off"):
        assert attn.onepass_batches(64, 12, 64, 132) == 0


def test_v3_backward_version_argument_on_numpy(rng):
    qkv = make_qkv(rng, 1, 5, 2, 4)
    out, lse = gpucore.attention_forward(qkv, 2)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    ref = attn.attention_backward_reference(dout, qkv, 2)
    assert rel_err(gpucore.attention_backward(dout, qkv, out, lse, 2, version=3), ref) < 1e-6
    with pytest.raises(ValueError, match="version"):
        gpucore.attention_backward(dout, qkv, out, lse, 2, version=4)


def _sm90a_kernels_compiled(name):
    """The kernel names of attention/<name> compiled for sm_90a, after asserting every kernel
    compiled without spills and no wgmma was serialised (ptxas info C7510..C7515: e.g. too few
    registers -- correct but slow)."""
    rows = kernel_rows("90a", f"attention/{name}")
    assert rows and not [r for r in rows if not r["ok"]], rows
    log = runtime.compile_cubin(runtime.KERNEL_DIR / "attention" / name, "90a", verbose_ptxas=True).log
    assert "serialized" not in log, [ln for ln in log.splitlines() if "serialized" in ln]
    return {r["kernel"] for r in rows}


@pytest.mark.skipif(runtime.cupy is None, reason="needs CuPy + NVRTC")
def test_v3_onepass_kernel_compiles_for_sm90a_without_spills():
    names = _sm90a_kernels_compiled("flash_v3_bwd1.cu")
    assert ({f"attention_backward_onepass_kernel_v3_hd{hd}_g{g}_bf16" for hd in attn.ONEPASS_HD for g in attn.ONEPASS_WGS}
            <= names)


@pytest.mark.skipif(runtime.cupy is None, reason="needs CuPy + NVRTC")
def test_v3_backward_kernels_compile_for_sm90a_without_spills():
    names = _sm90a_kernels_compiled("flash_v3_bwd.cu")
    assert v3_bwd_names(DEFAULT_V3_DKDV, DEFAULT_V3_DQ, attn.V3_VARIANT_SUFFIX) <= names


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-NH{}-T{}-hd{}".format(*s))
def test_gpu_backward_v3(rng, shape):
    need_sm90()
    B, NH, T, hd = shape
    check_v3_backward(rng, B, NH, T, hd,
             lambda do, qkv, o, l, dqkv: gpucore.attention_backward(do, qkv, o, l, NH, dqkv=dqkv, version=3))


@pytest.mark.cuda
@pytest.mark.parametrize("hd", [64, 128])
def test_gpu_v3_block_order_same_bits(rng, hd):
    """settings.attention_head_group only reorders blocks: every group size (0 = the old order) gives
    the same bits, forward and backward, with 35 heads (two full groups of 16 and a short one)."""
    need_sm90()
    cp = runtime.cupy
    B, NH, T = 5, 7, 200
    qkv = cp.asarray(make_qkv(rng, B, T, NH, hd, BF16))
    dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(BF16))
    runs = []
    for group in (0, 1, 16, 64):
        with settings.using(attention_head_group=group):
            out, lse = gpucore.attention_forward(qkv, NH, version=3)
            dqkv = gpucore.attention_backward(dout, qkv, out, lse, NH, version=3)
            runs.append(b"".join(to_cpu(x).tobytes() for x in (out, lse, dqkv)))
    assert all(r == runs[0] for r in runs[1:])


@pytest.mark.cuda
@pytest.mark.parametrize("hd", [64, 128])
def test_gpu_deterministic_v3(rng, hd):
    need_sm90()
    NH, qkv, dout, out, lse = v3_backward_case(rng, hd)
    runs = [to_cpu(gpucore.attention_backward(dout, qkv, out, lse, NH, version=3)).tobytes() for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.cuda
@pytest.mark.parametrize("hd", [64, 128])
def test_gpu_backward_v3_streams_same_bits(rng, hd):
    """The concurrent dQ pass (side stream) gives the bits of the one-stream order, run after run,
    also on a non-default caller stream; streams=None follows settings.attention_v3_streams.
    (The fused-D dq configs: tests/ladder.)"""
    need_sm90()
    cp = runtime.cupy
    NH, qkv, dout, out, lse = v3_backward_case(rng, hd)
    one = v3_backward_bits(qkv, dout, out, lse, NH, streams=False)
    assert v3_backward_bits(qkv, dout, out, lse, NH, streams=True) == one
    assert v3_backward_bits(qkv, dout, out, lse, NH, streams=True) == one
    with cp.cuda.Stream(non_blocking=True):
        assert v3_backward_bits(qkv, dout, out, lse, NH, streams=True) == one
    for streams in (False, True):
        with settings.using(attention_v3_streams=streams):
            assert v3_backward_bits(qkv, dout, out, lse, NH) == one


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[3] == 64] + [(3, 4, 1000, 64)],
                         ids=lambda s: "B{}-NH{}-T{}-hd{}".format(*s))
def test_gpu_backward_v3_onepass(rng, shape):
    """The one-pass backward (attention/flash_v3_bwd1.cu) against the float64 reference: dq, dk, dv
    within bf16 tolerance at T from 1 to 1024 (tails of every kind), NaN-poisoned output."""
    need_sm90()
    B, NH, T, hd = shape
    for wgs in attn.ONEPASS_WGS:
        check_v3_backward(rng, B, NH, T, hd,
                          lambda do, qkv, o, l, dqkv: attn.backward_v3_onepass(do, qkv, o, l, NH, dqkv, wgs=wgs))


@pytest.mark.cuda
def test_gpu_backward_v3_onepass_deterministic_and_default(rng):
    """Same bits run after run, also with every SM busy (dQ's parts are added into the scratch by
    bulk reductions in the L2, whose order only the kernel's waits fix); settings.attention_v3_onepass
    "on" routes attention_backward's v3 path there (same bits as calling it directly), and "off" to
    the two-pass backward (close to it)."""
    need_sm90()
    NH, qkv, dout, out, lse = v3_backward_case(rng, 64, B=24, NH=12, T=1024)
    big = v3_backward_bits(qkv, dout, out, lse, NH, backward=attn.backward_v3_onepass)
    for _ in range(3):
        assert v3_backward_bits(qkv, dout, out, lse, NH, backward=attn.backward_v3_onepass) == big
    NH, qkv, dout, out, lse = v3_backward_case(rng, 64, B=3, NH=5, T=333)
    for wgs in attn.ONEPASS_WGS[1:]:
        bits = v3_backward_bits(qkv, dout, out, lse, NH, backward=attn.backward_v3_onepass, wgs=wgs)
        assert v3_backward_bits(qkv, dout, out, lse, NH, backward=attn.backward_v3_onepass, wgs=wgs) == bits
    one = v3_backward_bits(qkv, dout, out, lse, NH, backward=attn.backward_v3_onepass)
    assert v3_backward_bits(qkv, dout, out, lse, NH, backward=attn.backward_v3_onepass) == one
    with settings.using(attention_v3_onepass="on"):
        via = to_cpu(gpucore.attention_backward(dout, qkv, out, lse, NH, version=3)).tobytes()
    assert via == one
    with settings.using(attention_v3_onepass="off"):
        two = to_cpu(gpucore.attention_backward(dout, qkv, out, lse, NH, version=3)).astype(np.float32)
    got = np.frombuffer(one, dtype=BF16).astype(np.float32).reshape(two.shape)
    assert rel_err(got, two) < 1e-2


@pytest.mark.cuda
def test_gpu_backward_v3_split_is_each_part_bit_for_bit(rng):
    """backward_v3_split: batch elements [0, b1) bit for bit the one-pass kernel's, [b1, B) the
    two-pass kernels', run beside each other, also from a non-default stream; and the dispatch
    takes it where onepass_batches says so (B=16 NH=25 on 132+ SMs: 15 + 1)."""
    need_sm90()
    cp = runtime.cupy
    NH, qkv, dout, out, lse = v3_backward_case(rng, 64, B=5, NH=4, T=333)
    one = np.frombuffer(v3_backward_bits(qkv[:3], dout[:3], out[:3], lse[:3], NH, backward=attn.backward_v3_onepass),
                        dtype=np.uint16)
    two = np.frombuffer(v3_backward_bits(qkv[3:], dout[3:], out[3:], lse[3:], NH), dtype=np.uint16)
    want = np.concatenate([one, two]).tobytes()
    assert v3_backward_bits(qkv, dout, out, lse, NH, backward=attn.backward_v3_split, b1=3) == want
    with cp.cuda.Stream(non_blocking=True):
        assert v3_backward_bits(qkv, dout, out, lse, NH, backward=attn.backward_v3_split, b1=3) == want
    sms = runtime.sm_count()
    B, NH = 16, 25
    b1 = attn.onepass_batches(B, NH, 64, sms)
    if 0 < b1 < B:
        NH, qkv, dout, out, lse = v3_backward_case(rng, 64, B=B, NH=NH, T=256)
        split = v3_backward_bits(qkv, dout, out, lse, NH, backward=attn.backward_v3_split, b1=b1)
        assert to_cpu(gpucore.attention_backward(dout, qkv, out, lse, NH, version=3)).tobytes() == split


@pytest.mark.cuda
def test_gpu_default_backward_is_v3_on_sm90(rng):
    need_sm90()
    cp = runtime.cupy
    NH, qkv, dout, out, lse = v3_backward_case(rng, 64, B=1, NH=2, T=70)
    with settings.using(attention_v3_backward=True):
        d_default = gpucore.attention_backward(dout, qkv, out, lse, NH)
    d3 = gpucore.attention_backward(dout, qkv, out, lse, NH, version=3)
    assert to_cpu(d_default).tobytes() == to_cpu(d3).tobytes()
    with settings.using(attention_v3_backward=False):   # the setting reverts the default to v2
        d_off = gpucore.attention_backward(dout, qkv, out, lse, NH)
    d2 = gpucore.attention_backward(dout, qkv, out, lse, NH, version=2)
    assert to_cpu(d_off).tobytes() == to_cpu(d2).tobytes()
    q32 = qkv.astype(np.float32)
    o32, l32 = gpucore.attention_forward(q32, NH, version=1)
    with pytest.raises(TypeError, match="version 3 backward takes bfloat16"):
        gpucore.attention_backward(dout.astype(np.float32), q32, o32, l32, NH, version=3)
    q32h = cp.asarray(make_qkv(rng, 1, 8, 2, 32, BF16))
    o32h, l32h = gpucore.attention_forward(q32h, 2)
    with pytest.raises(ValueError, match="head dims"):
        gpucore.attention_backward(cp.zeros_like(o32h), q32h, o32h, l32h, 2, version=3)


# ------------------------------------------------------- version 3 forward -----
# kernels_cu/attention/flash_v3_fwd.cu (wgmma, sm_90a, pipelined). Its out/lse feed v2's backward
# (measured correct on an H200), so test_gpu_v3_forward_v2_backward checks the layouts end to end.
# The messages name the worst (b, head, 16-row block): every block bad -> a fragment layout or a
# descriptor (S = Q K^T: smem layout / K-major descriptor; O += P V: register-A packing / the
# MN-major V descriptor); rows 64..127 of each tile only -> warpgroup 1's Q descriptor offset;
# diagonal blocks only -> the causal mask; the last block only -> T tails (zero-fill / stores).

def test_v3_forward_table_matches_kernel_instantiations():
    """The pipelined forward's default configs are instantiated (all instantiations: tests/ladder)."""
    kernels = v3_fwd_instantiations()
    assert set(kernels) == set(attn.V3_FWD_CONFIG)
    assert all(cfg in kernels[hd] for hd, cfg in attn.V3_FWD_CONFIG.items())
    assert set(attn.V3_FWD_CONFIG) <= set(attn.V2_FWD_CONFIG)   # v2 is the fallback for the same hd
    check_v3_fwd_config_limits(DEFAULT_V3_FWD)


def test_v3_forward_version_argument_on_numpy(rng):
    qkv = make_qkv(rng, 1, 5, 2, 4)
    ref_out, ref_lse = attn.attention_forward_reference(qkv, 2)
    out, lse = gpucore.attention_forward(qkv, 2, version=3)   # NumPy: the reference, any version
    assert rel_err(out, ref_out) < 1e-6 and np.allclose(lse, ref_lse, atol=1e-6)
    with pytest.raises(ValueError, match="version"):
        gpucore.attention_forward(qkv, 2, version=4)


@pytest.mark.skipif(runtime.cupy is None, reason="needs CuPy + NVRTC")
def test_v3_forward_kernels_compile_for_sm90a_without_spills():
    src = runtime.KERNEL_DIR / "attention" / "flash_v3_fwd.cu"
    rows = kernel_rows("90a", "attention/flash_v3_fwd.cu")
    assert rows and not [r for r in rows if not r["ok"]], rows
    # ptxas C7520 etc.: wgmma serialised (e.g. a branch while one is in flight) -- the pipelined
    # kernels would still be correct but lose their overlap
    log = runtime.compile_cubin(src, "90a", verbose_ptxas=True).log
    assert "serialized" not in log, [ln for ln in log.splitlines() if "serialized" in ln]
    assert v3_fwd_names(DEFAULT_V3_FWD) <= {r["kernel"] for r in rows}
    f8 = {n.replace("attention_forward_kernel", "attention_forward_f8_kernel") for n in v3_fwd_names({64: [attn.V3_FWD_CONFIG[64]]})}
    assert f8 <= {r["kernel"] for r in rows}     # the F8 epilogue's kernel: the production config at hd 64


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-NH{}-T{}-hd{}".format(*s))
def test_gpu_forward_v3(rng, shape):
    """Default config per hd over T in {1, 17, 64, 100, 129, 257, 1024}, via the public API."""
    need_sm90()
    test_gpu_forward(rng, (3, BF16, shape))


@pytest.mark.cuda
@pytest.mark.parametrize("hd", [64, 128])
def test_gpu_forward_v3_sharp_softmax(rng, hd):
    """Large scores (sigma 4): the running max changes often, exercising the O rescale."""
    need_sm90()
    check_v3_forward(rng, 1, 2, 300, hd, sigma=4.0)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(2, 3, 17, 64), (1, 2, 129, 64), (2, 2, 257, 64), (1, 2, 100, 128),
                                   (1, 1, 1024, 64)], ids=lambda s: "B{}-NH{}-T{}-hd{}".format(*s))
def test_gpu_v3_forward_v2_backward(rng, shape):
    """v3's out/lse drive v2's backward to the reference gradients (the layouts agree)."""
    need_sm90()
    cp = runtime.cupy
    B, NH, T, hd = shape
    C = NH * hd
    qkv = make_qkv(rng, B, T, NH, hd, BF16, sigma=1.5)
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
        assert err < 1e-2, f"d{name} rel err {err:.3e}\n{locate(d, ref, B, T, NH, hd, S=3)}"


@pytest.mark.cuda
@pytest.mark.parametrize("hd", [64, 128])
def test_gpu_deterministic_v3_forward(rng, hd):
    need_sm90()
    cp = runtime.cupy
    NH = 3
    qkv = cp.asarray(make_qkv(rng, 2, 300, NH, hd, BF16))
    runs = [[to_cpu(a).tobytes() for a in gpucore.attention_forward(qkv, NH, version=3)] for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.cuda
def test_gpu_default_forward_is_v3_on_sm90(rng):
    need_sm90()
    cp = runtime.cupy
    NH = 2
    qkv = cp.asarray(make_qkv(rng, 1, 70, NH, 64, BF16))
    with settings.using(attention_v3_forward=True):
        o_def, l_def = gpucore.attention_forward(qkv, NH)
    o3, l3 = gpucore.attention_forward(qkv, NH, version=3)
    assert to_cpu(o_def).tobytes() == to_cpu(o3).tobytes()
    assert to_cpu(l_def).tobytes() == to_cpu(l3).tobytes()
    with settings.using(attention_v3_forward=False):    # the setting reverts the default to v2
        o_off, l_off = gpucore.attention_forward(qkv, NH)
    o2, l2 = gpucore.attention_forward(qkv, NH, version=2)
    assert to_cpu(o_off).tobytes() == to_cpu(o2).tobytes()
    assert to_cpu(l_off).tobytes() == to_cpu(l2).tobytes()
    with pytest.raises(TypeError, match="version 3 forward takes bfloat16"):
        gpucore.attention_forward(qkv.astype(np.float32), NH, version=3)
    with pytest.raises(ValueError, match="head dims"):
        gpucore.attention_forward(cp.asarray(make_qkv(rng, 1, 8, 2, 32, BF16)), 2, version=3)
    o32, _ = gpucore.attention_forward(cp.asarray(make_qkv(rng, 1, 8, 2, 32, BF16)), 2)   # default falls back
    assert not np.isnan(to_cpu(o32).astype(np.float32)).any()


def test_attention_backward_dbias_numpy_and_bad_input(rng):
    """NumPy: dbias += the column sums of the dqkv written (float64), dqkv unchanged by asking."""
    B, T, NH, hd = 2, 9, 2, 8
    qkv = make_qkv(rng, B, T, NH, hd, np.float32)
    dout = rng.standard_normal((B, T, NH * hd)).astype(np.float32)
    out, lse = gpucore.attention_forward(qkv, NH)
    plain = gpucore.attention_backward(dout, qkv, out, lse, NH)
    db = np.full(3 * NH * hd, 0.5, np.float32)
    got = gpucore.attention_backward(dout, qkv, out, lse, NH, dbias=db)
    assert np.array_equal(got, plain)
    assert np.allclose(db, 0.5 + plain.reshape(-1, 3 * NH * hd).astype(np.float64).sum(axis=0), rtol=1e-6)
    with pytest.raises(ValueError, match="dbias"):
        gpucore.attention_backward(dout, qkv, out, lse, NH, dbias=np.zeros(7, np.float32))
    with pytest.raises(TypeError, match="dbias"):
        gpucore.attention_backward(dout, qkv, out, lse, NH, dbias=np.zeros(3 * NH * hd, np.float16))


def _onepass_shape(split: bool):
    """(B, NH, T) where the one-pass backward takes the whole batch on this GPU (NH 4, T = 1000: not
    a tile multiple), or with split, d48's B=16 NH=25, where it takes only part of it."""
    sms = runtime.sm_count()
    if split:
        assert attn.onepass_batches(16, 25, 64, sms) < 16
        return 16, 25, 256
    return next(b for b in range(-(-sms // 4), 8 * sms) if attn.onepass_batches(b, 4, 64, sms) == b), 4, 1000


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["whole batch one-pass", "split"])
def test_gpu_attention_backward_dbias_from_the_onepass_kernel(rng, case):
    """Where the one-pass kernel takes the whole batch (its _sums variant; T = 1000, not a tile
    multiple): dqkv bit for bit the plain kernel's, dbias += its column sums within float32 rounding
    of float64's (bf16 dbias within its rounding), the same bits twice. Where it does not (B=16
    NH=25, the d48 split) the one-pass part's sums come from the _sums variant and the two-pass
    part's from the column sum's stage 1 over its rows: float32 dbias bit for bit one stage 2 over
    those partials, in that order."""
    need_sm90()
    cp = runtime.cupy
    sms = runtime.sm_count()
    B, NH, T = _onepass_shape(case == "split")
    NH, qkv, dout, out, lse = v3_backward_case(rng, 64, B=B, NH=NH, T=T)
    C = NH * 64
    ref = to_cpu(gpucore.attention_backward(dout, qkv, out, lse, NH))
    want = ref.reshape(-1, 3 * C).astype(np.float64).sum(axis=0)
    runs = []
    for dt in (np.float32, np.float32, BF16):
        db = cp.full(3 * C, 0.5, dt)
        got = to_cpu(gpucore.attention_backward(dout, qkv, out, lse, NH, dbias=db))
        assert got.tobytes() == ref.tobytes(), "dqkv changed when its bias sums were asked for"
        sums = to_cpu(db).astype(np.float64) - 0.5
        assert rel_err(sums, want) < (1e-5 if dt == np.float32 else 1e-2), dt
        runs.append(to_cpu(db).tobytes())
    assert runs[0] == runs[1]
    if case == "split":
        from gpucore.ops.colsum import colsum_chunks, colsum_partials, stage2_order_sum
        b1 = attn.onepass_batches(B, NH, 64, sms)
        part = cp.empty((b1 + colsum_chunks((B - b1) * T), 3 * C), np.float32)
        attn.backward_v3_onepass(dout[:b1], qkv[:b1], out[:b1], lse[:b1], NH, cp.empty_like(qkv[:b1]),
                                 sums=part[:b1])
        colsum_partials(part[b1:], cp.asarray(ref[b1:]).reshape(-1, 3 * C))
        emu = (np.float32(0.5) + stage2_order_sum(to_cpu(part))).astype(np.float32)
        assert emu.tobytes() == runs[0], "split dbias: not stage 2 over the one-pass sums, then the chunks"


# --------------------------------- dqkv's amax (--dtype fp8: its cast knows its scale first) ----

# qkv's thirds scaled so that dQ, then dK, then dV holds the largest |value| (S = QK^T unchanged in
# the first two): a kernel that left one part out of the amax fails one of the three
AMAX_THIRDS = {"dq": (1 / 8, 8, 1), "dk": (8, 1 / 8, 1), "dv": (1, 1, 1 / 16)}


def _amax_case(rng, xp, B, NH, T, which):
    C = NH * 64
    f = np.repeat(np.array(AMAX_THIRDS[which], np.float32), C)
    qkv = xp.asarray((make_qkv(rng, B, T, NH, 64) * f).astype(BF16))
    dout = xp.asarray(rng.standard_normal((B, T, C)).astype(BF16))
    out, lse = gpucore.attention_forward(qkv, NH)
    return qkv, dout, out, lse


def _largest_third(dqkv, C):
    m = [float(np.abs(to_cpu(dqkv).astype(np.float32)[..., k * C:(k + 1) * C]).max()) for k in range(3)]
    return ["dq", "dk", "dv"][int(np.argmax(m))]


def test_attention_backward_amax_numpy_and_bad_input(rng):
    """NumPy: amax = max(amax, max |dqkv|) of the bf16 dqkv written; dqkv unchanged by asking."""
    B, T, NH = 1, 40, 2
    for which in AMAX_THIRDS:
        qkv, dout, out, lse = _amax_case(rng, np, B, NH, T, which)
        plain = gpucore.attention_backward(dout, qkv, out, lse, NH)
        assert _largest_third(plain, NH * 64) == which
        am = np.full(1, 1e-3, np.float32)
        got = gpucore.attention_backward(dout, qkv, out, lse, NH, amax=am)
        assert got.tobytes() == plain.tobytes()
        assert am[0] == np.abs(plain.astype(np.float32)).max()
    with pytest.raises(ValueError, match="amax"):
        gpucore.attention_backward(dout, qkv, out, lse, NH, amax=np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="amax"):
        q32 = qkv.astype(np.float32)
        gpucore.attention_backward(dout.astype(np.float32), q32, out.astype(np.float32), lse, NH,
                                   amax=np.zeros(1, np.float32))


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["whole batch one-pass", "split", "two-pass"])
def test_gpu_attention_backward_amax_is_fp8_amax_of_dqkv(rng, case):
    """The amax the backward takes as it writes dqkv -- the one-pass kernel's _sums variant over the
    whole batch (T = 1000, not a tile multiple), the d48 split (one-pass part in the kernel, the
    two-pass part by fp8_amax on the side stream), the v2 fallback (fp8_amax after) -- is bit for
    bit fp8_amax over the dqkv written, with dQ, dK or dV holding the largest value, with and
    without dbias; dqkv is unchanged by asking."""
    need_sm90()
    cp = runtime.cupy
    version = 2 if case == "two-pass" else None
    B, NH, T = _onepass_shape(case == "split")
    C = NH * 64
    for which in AMAX_THIRDS:
        qkv, dout, out, lse = _amax_case(rng, cp, B, NH, T, which)
        ref = gpucore.attention_backward(dout, qkv, out, lse, NH, version=version)
        assert _largest_third(ref, C) == which
        want = cp.zeros(1, np.float32)
        fp8_amax(ref, want)
        for dbias in (None, cp.zeros(3 * C, np.float32)):
            am = cp.zeros(1, np.float32)
            got = gpucore.attention_backward(dout, qkv, out, lse, NH, version=version, dbias=dbias, amax=am)
            assert to_cpu(got).tobytes() == to_cpu(ref).tobytes(), "dqkv changed when its amax was asked for"
            assert to_cpu(am)[0] == to_cpu(want)[0], (which, dbias is None, to_cpu(am), to_cpu(want))


# ------------------------------------------- FP8 output (--dtype fp8's attproj input) ----

def _fp8_out_case(rng, B, T, NH, xp):
    from gpucore.ops.fp8 import fp8_quantize
    C = NH * 64
    qkv = xp.asarray(make_qkv(rng, B, T, NH, 64, BF16, sigma=1.5))
    out, lse = gpucore.attention_forward(qkv, NH)
    want8, want8t, want_am = xp.zeros((B * T, C), np.uint8), xp.zeros((C, B * T), np.uint8), xp.zeros(1, np.float32)
    scale = xp.asarray([200.0], np.float32)
    fp8_quantize(out.reshape(B * T, C), "e4m3", scale, out=want8, out_t=want8t, amax=want_am)
    return qkv, out, lse, scale, (to_cpu(want8), to_cpu(want8t), to_cpu(want_am))


def test_attention_forward_fp8_output_numpy(rng):
    """out8 / out8_t / amax8: fp8_quantize of the output (the NumPy path runs that cast), out and
    lse unchanged; bad arguments refused with one line."""
    B, T, NH, C = 2, 8, 2, 128
    qkv, out, lse, scale, (w8, w8t, wam) = _fp8_out_case(rng, B, T, NH, np)
    o8, o8t, am = np.zeros((B * T, C), np.uint8), np.zeros((C, B * T), np.uint8), np.zeros(1, np.float32)
    out2, lse2 = gpucore.attention_forward(qkv, NH, out8=o8, out8_t=o8t, scale8=scale, amax8=am)
    assert out2.tobytes() == out.tobytes() and lse2.tobytes() == lse.tobytes()
    assert np.array_equal(o8, w8) and np.array_equal(o8t, w8t) and am[0] == wam[0] and w8.any()
    with pytest.raises(ValueError, match="scale8: needed"):
        gpucore.attention_forward(qkv, NH, out8=o8)
    with pytest.raises(ValueError, match="only with out8"):
        gpucore.attention_forward(qkv, NH, scale8=scale)
    with pytest.raises(TypeError, match="needs bfloat16"):
        gpucore.attention_forward(qkv.astype(np.float32), NH, out8=o8, scale8=scale)
    with pytest.raises(ValueError, match="out8_t: expected shape"):
        gpucore.attention_forward(qkv, NH, out8_t=o8, scale8=scale)


@pytest.mark.cuda
@pytest.mark.parametrize("B,T,NH", [(2, 64, 2), (2, 1024, 12), (2, 1000, 4), (8, 1002, 3), (1, 256, 25)])
def test_gpu_attention_forward_fp8_output_bitwise(rng, B, T, NH):
    """GPU: the forward's E4M3 bytes (both layouts) and amax are fp8_quantize's of its output, bit for
    bit -- written by the F8 kernel where fused_fp8_output (T % 4 == 0: T = 1000 has a partial last
    tile), by the cast after it elsewhere (T = 1002) -- out and lse as without them, and either
    layout alone."""
    need_sm90()
    cp = runtime.cupy
    C = NH * 64
    qkv, out, lse, scale, (w8, w8t, wam) = _fp8_out_case(rng, B, T, NH, cp)
    o8, o8t, am = cp.full((B * T, C), 0xAB, np.uint8), cp.full((C, B * T), 0xAB, np.uint8), cp.zeros(1, np.float32)
    out2, lse2 = gpucore.attention_forward(qkv, NH, out8=o8, out8_t=o8t, scale8=scale, amax8=am)
    assert to_cpu(out2).tobytes() == to_cpu(out).tobytes() and to_cpu(lse2).tobytes() == to_cpu(lse).tobytes()
    bad = np.argwhere(to_cpu(o8) != w8)
    assert len(bad) == 0, f"out8: {len(bad)} bytes differ, first at {tuple(bad[0])}"
    bad = np.argwhere(to_cpu(o8t) != w8t)
    assert len(bad) == 0, f"out8_t: {len(bad)} bytes differ, first at {tuple(bad[0])}"
    assert to_cpu(am)[0] == wam[0] > 0
    only = cp.zeros((C, B * T), np.uint8)
    gpucore.attention_forward(qkv, NH, out8_t=only, scale8=scale)
    assert np.array_equal(to_cpu(only), w8t)
    only = cp.zeros((B * T, C), np.uint8)
    gpucore.attention_forward(qkv, NH, out8=only, scale8=scale)
    assert np.array_equal(to_cpu(only), w8)
