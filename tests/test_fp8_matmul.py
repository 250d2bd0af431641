"""fp8_matmul(a_t_out=): the FP8 GEMM that also writes its A operand transposed -- the LM head's dx GEMM,
which reads every byte of dlogits8, handing the dwte GEMM its token-contiguous copy
(kernels_cu/fp8_matmul.cu on Hopper; elsewhere cuBLASLt, then fp8_transpose).

CPU: the NumPy path (the reference product, a8.T) and bad input. GPU (pytest -m cuda): the transposed
bytes equal a8.T exactly; out against the float64 reference of the same bytes, no further from it
than cuBLASLt's GEMM with the same accumulation (exact: promoted, or fast) measured beside it, on
edge tiles (M, N, K not multiples of 128 / 192), the d12 head's shape and a long K whose sums
grow (where fast accumulation drops small addends); the fallback path; the model's gradients with
the setting on and off.
"""
import ml_dtypes
import numpy as np
import pytest

from gpucore import runtime
from gpucore.dtypes import bfloat16
from gpucore.ops.fp8 import fp8_matmul, fp8_matmul_reference
from conftest import to_cpu

F32 = np.float32
FMT = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def _bytes(rng, shape, mean, spread, fmt):
    return rng.normal(mean, spread, shape).astype(np.float32).astype(FMT[fmt]).view(np.uint8)


def test_fp8_matmul_a_t_out_numpy(rng):
    a8, b8 = _bytes(rng, (32, 48), 0, 1e-3, "e5m2"), _bytes(rng, (16, 48), 0, 1.0, "e4m3")
    sa, sb = np.array([64.0], F32), np.array([0.25], F32)
    a_t = np.zeros((48, 32), np.uint8)
    got = fp8_matmul(a8, b8, "e5m2", "e4m3", sa, sb, a_t_out=a_t)
    want = fp8_matmul_reference(a8, b8, "e5m2", "e4m3", 64.0, 0.25).astype(bfloat16)
    assert got.tobytes() == want.tobytes()
    assert a_t.tobytes() == np.ascontiguousarray(a8.T).tobytes()


def test_fp8_matmul_a_t_out_bad_input(rng):
    a8, b8 = _bytes(rng, (32, 48), 0, 1.0, "e4m3"), _bytes(rng, (16, 48), 0, 1.0, "e4m3")
    s = np.array([1.0], F32)
    out = np.zeros((32, 16), bfloat16)
    with pytest.raises(ValueError, match="a_t_out"):
        fp8_matmul(a8, b8, "e4m3", "e4m3", s, s, a_t_out=np.zeros((32, 48), np.uint8))     # not (K, M)
    with pytest.raises(TypeError, match="a_t_out"):
        fp8_matmul(a8, b8, "e4m3", "e4m3", s, s, a_t_out=np.zeros((48, 32), np.float32))
    for kw in (dict(accumulate=True, out=out), dict(bias=np.zeros(16, bfloat16)),
               dict(gelu_out=np.zeros((32, 16), bfloat16)), dict(residual=np.zeros((32, 16), bfloat16))):
        with pytest.raises(ValueError, match="a_t_out: only with the plain product"):
            fp8_matmul(a8, b8, "e4m3", "e4m3", s, s, a_t_out=np.zeros((48, 32), np.uint8), **kw)
    big = np.zeros(48 * 32 + 32 * 48, np.uint8)
    with pytest.raises(ValueError, match="a_t_out: must not overlap a8"):
        fp8_matmul(big[: 32 * 48].reshape(32, 48), b8, "e4m3", "e4m3", s, s,
                   a_t_out=big[16: 16 + 48 * 32].reshape(48, 32))


def _need_hopper():
    from test_fp8 import _need_fp8
    _need_fp8()
    if runtime.device_arch() != "90":
        pytest.skip("the transposing FP8 GEMM is Hopper's (sm_90a); elsewhere the fallback runs (tested below)")


def _errors(got, lt, ref):
    """Max error of ours and of cuBLASLt against the reference, relative to |ref| + its rms."""
    scale = np.abs(ref) + np.sqrt(np.mean(ref ** 2))
    return float(np.max(np.abs(got - ref) / scale)), float(np.max(np.abs(lt - ref) / scale))


def _run(rng, M, N, K, a_fmt, fast, a_mean=0.0, sample=None):
    cp = runtime.cupy
    a8 = _bytes(rng, (M, K), a_mean, 1e-3 if a_fmt == "e5m2" else 2.0, a_fmt)
    b8 = _bytes(rng, (N, K), 0.25 if a_mean else 0.0, 0.5, "e4m3")
    sa, sb = np.array([64.0 if a_fmt == "e5m2" else 0.125], F32), np.array([0.0625], F32)
    da8, db8, dsa, dsb = (cp.asarray(v) for v in (a8, b8, sa, sb))
    a_t = cp.full((K, M), 0x5A, np.uint8)
    ours = fp8_matmul(da8, db8, a_fmt, "e4m3", dsa, dsb, fast_accum=fast, a_t_out=a_t)
    lt = fp8_matmul(da8, db8, a_fmt, "e4m3", dsa, dsb, fast_accum=fast)
    rows = slice(None) if sample is None else sample
    ref = fp8_matmul_reference(a8[rows], b8, a_fmt, "e4m3", float(sa[0]), float(sb[0]))
    return a8, to_cpu(a_t), to_cpu(ours)[rows].astype(np.float64), to_cpu(lt)[rows].astype(np.float64), ref


@pytest.mark.cuda
@pytest.mark.parametrize("M,N,K,a_fmt", [
    (128, 192, 128, "e5m2"), (272, 208, 160, "e5m2"), (400, 384, 768, "e4m3"), (1040, 1600, 4096, "e5m2")])
@pytest.mark.parametrize("fast", [False, True])
def test_gpu_fp8_matmul_a_t_out_against_reference_and_cublaslt(rng, M, N, K, a_fmt, fast):
    _need_hopper()
    a8, a_t, ours, lt, ref = _run(rng, M, N, K, a_fmt, fast)
    assert a_t.tobytes() == np.ascontiguousarray(a8.T).tobytes()
    e_ours, e_lt = _errors(ours, lt, ref)
    assert np.isfinite(ours).all() and e_ours <= 2 * e_lt + 4e-3, (e_ours, e_lt)


@pytest.mark.cuda
def test_gpu_fp8_matmul_a_t_out_head_shape(rng):
    """The d12 LM head's shape: dlogits8 (rows x 50304) @ wte8T (768 x 50304)^T, exact accumulation,
    2048 rows (a quarter chunk: 16 row blocks x 4 column tiles), checked on 64 sampled rows."""
    _need_hopper()
    sample = np.sort(rng.choice(2048, 64, replace=False))
    a8, a_t, ours, lt, ref = _run(rng, 2048, 768, 50304, "e5m2", False, sample=sample)
    assert a_t.tobytes() == np.ascontiguousarray(a8.T).tobytes()
    e_ours, e_lt = _errors(ours, lt, ref)
    assert e_ours <= 2 * e_lt + 4e-3, (e_ours, e_lt)


@pytest.mark.cuda
def test_gpu_fp8_matmul_a_t_out_exact_keeps_small_addends(rng):
    """K = 50304 with a mean in both operands: the sums grow along K, so fast accumulation (the
    wgmma's own ~14-bit sum) drops the late addends; the promoted sums stay at cuBLASLt's exact
    accumulation's distance from the float64 reference."""
    _need_hopper()
    _, _, ours, lt, ref = _run(rng, 256, 192, 50304, "e5m2", False, a_mean=1e-3)
    e_ours, e_lt = _errors(ours, lt, ref)
    assert e_ours <= 2 * e_lt + 4e-3, (e_ours, e_lt)
    _, _, fast, _, ref_f = _run(np.random.default_rng(1), 256, 192, 50304, "e5m2", True, a_mean=1e-3)
    e_fast, _ = _errors(fast, fast, ref_f)
    assert e_ours < e_fast          # what the promotion is for


@pytest.mark.cuda
def test_gpu_fp8_matmul_a_t_out_fallback(rng, monkeypatch):
    """Not Hopper: cuBLASLt's GEMM, then fp8_transpose -- the same transposed bytes and cuBLASLt's out."""
    from test_fp8 import _need_fp8
    _need_fp8()
    cp = runtime.cupy
    a8, b8 = _bytes(rng, (272, 160), 0, 1e-3, "e5m2"), _bytes(rng, (208, 160), 0, 0.5, "e4m3")
    da8, db8 = cp.asarray(a8), cp.asarray(b8)
    s1, s2 = cp.asarray(np.array([64.0], F32)), cp.asarray(np.array([0.0625], F32))
    lt = fp8_matmul(da8, db8, "e5m2", "e4m3", s1, s2)
    import gpucore.ops.fp8 as fp8_ops
    monkeypatch.setattr(fp8_ops, "_transposing_gemm_runs", lambda b_fmt: False)
    a_t = cp.zeros((160, 272), np.uint8)
    got = fp8_matmul(da8, db8, "e5m2", "e4m3", s1, s2, a_t_out=a_t)
    assert to_cpu(a_t).tobytes() == np.ascontiguousarray(a8.T).tobytes()
    assert to_cpu(got).tobytes() == to_cpu(lt).tobytes()


@pytest.mark.parametrize("device", ["numpy", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_model_fp8_lm_head_dx_transposes(device):
    """settings.fp8_lm_head_dx_transposes: the head's dx GEMM writes dlogits8's transpose for the dwte
    GEMM. The loss is untouched; in NumPy every gradient is bit for bit the same (the same reference
    product and bytes), on the GPU within the two exact accumulations' rounding, and deterministic."""
    from gpucore import settings
    from gpucore.model import GPT2Config
    from test_fp8 import _model_grads, _need_fp8, _tokens
    from conftest import rel_err
    if device == "cuda":
        _need_fp8()
    xp = runtime.cupy if device == "cuda" else np
    cfg = GPT2Config.from_preset("micro" if device == "numpy" else "tiny")
    x, y = _tokens(cfg, 2 if device == "numpy" else 4, 16 if device == "numpy" else 64)
    with settings.using(fp8_lm_head=True, fp8_lm_head_dwte=True):
        with settings.using(fp8_lm_head_dx_transposes=False):
            l0, g0, _ = _model_grads(cfg, xp, x, y, "adaptive")
        with settings.using(fp8_lm_head_dx_transposes=True):
            l1, g1, m = _model_grads(cfg, xp, x, y, "adaptive")
            l2, g2, _ = _model_grads(cfg, xp, x, y, "adaptive")
    assert m.fp8.dx_transposes
    assert l1 == l0 == l2 and g1.tobytes() == g2.tobytes() and np.isfinite(g1).all()
    if device == "numpy" or runtime.device_arch() != "90":
        assert g1.tobytes() == g0.tobytes()
    else:
        assert rel_err(g1, g0) < 1e-2
