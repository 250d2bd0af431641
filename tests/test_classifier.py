"""gpucore.fused_classifier / cross_entropy: reference vs finite differences, GPU vs reference, bad input."""
import ml_dtypes
import numpy as np
import pytest

import gpucore
from gpucore import runtime
from gpucore.ops.classifier import classifier_reference, cross_entropy_reference
from conftest import rel_err, to_cpu
from gradcheck import assert_grad_close, numerical_grad

DTYPES = [np.float32, gpucore.bfloat16]


def _targets(rng, shape, V, ignore_every=0):
    t = rng.integers(0, V, size=shape).astype(np.int32)
    if ignore_every:
        t.reshape(-1)[::ignore_every] = -1
    return t


# ------------------------------------------------------------------ CPU ----

def test_v3_constants_are_the_kernels():
    """The launcher's v3 block size, instantiated K and walking limit are classifier.cu's."""
    import re
    from pathlib import Path
    from gpucore.ops import classifier as cls
    src = (Path(runtime.KERNEL_DIR) / "classifier.cu").read_text()
    assert int(re.search(r"#define CLS3_BLOCK (\d+)", src).group(1)) == cls.V3_BLOCK
    assert int(re.search(r"#define V3_WALK_K (\d+)", src).group(1)) == cls.V3_WALK_K
    assert tuple(sorted({int(k) for k in re.findall(r"CLASSIFIER_V3\(bf16, bf16, (\d+)\)", src)})) == cls.V3_K
    assert cls.V3_WALK_K in cls.V3_K


def test_reference_loss_values(rng):
    logits = rng.standard_normal((5, 11))
    t = _targets(rng, (5,), 9)
    t[2] = -1
    losses = cross_entropy_reference(logits, t, vocab_size=9)
    for r in range(5):
        if t[r] == -1:
            assert losses[r] == 0
        else:
            row = logits[r, :9]
            expected = np.log(np.exp(row).sum()) - row[t[r]]
            assert losses[r] == pytest.approx(expected, rel=1e-12)


def test_reference_backward_matches_finite_differences(rng):
    V, Vp = 7, 10
    logits = rng.standard_normal((2, 3, Vp)) * 2
    t = _targets(rng, (2, 3), V)
    t[1, 1] = -1
    scale = 0.37
    _, d = classifier_reference(logits, t, V, grad_scale=scale)
    f = lambda x: cross_entropy_reference(x, t, V)            # noqa: E731
    numeric = numerical_grad(f, logits, np.full(t.shape, scale))
    assert_grad_close(d, numeric, rtol=1e-6, name="dlogits")
    assert np.all(d[..., V:] == 0)                            # padded columns
    assert np.all(d[1, 1] == 0)                               # ignored row


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_numpy_path(rng, dtype):
    V, Vp = 20, 24
    logits = rng.standard_normal((3, 4, Vp)).astype(dtype)
    t = _targets(rng, (3, 4), V, ignore_every=5)
    ref_losses, ref_d = classifier_reference(logits, t, V)     # default scale 1/non-ignored
    ce = gpucore.cross_entropy(logits, t, vocab_size=V)
    assert ce.dtype == np.float32 and ce.shape == t.shape
    assert rel_err(ce, ref_losses) < 1e-6
    work = logits.copy()
    losses = gpucore.fused_classifier(work, t, vocab_size=V)
    assert rel_err(losses, ref_losses) < 1e-6
    assert rel_err(work, ref_d) < (1e-6 if dtype == np.float32 else 1e-2)
    assert np.all(work[..., V:].astype(np.float32) == 0)
    n_valid = int((t != -1).sum())
    # the default grad_scale makes dlogits the gradient of the mean loss: each valid row sums to 0
    np.testing.assert_allclose(work.astype(np.float64).sum(-1), 0, atol=1e-2 / n_valid)
    assert ref_d.reshape(-1, Vp)[np.flatnonzero(t.reshape(-1) != -1)[0]].min() < -0.5 / n_valid


def test_classifier_bad_input(rng):
    logits = rng.standard_normal((4, 10)).astype(np.float32)
    t = np.array([0, 3, -1, 9], np.int32)
    with pytest.raises(TypeError, match="logits: dtype"):
        gpucore.fused_classifier(logits.astype(np.float64), t)
    with pytest.raises(TypeError, match="targets: dtype"):
        gpucore.fused_classifier(logits, t.astype(np.int64))
    with pytest.raises(ValueError, match="targets: expected shape"):
        gpucore.cross_entropy(logits, t[:3].copy())
    with pytest.raises(ValueError, match="logits: expected at least 2 dimensions"):
        gpucore.cross_entropy(logits[0].copy(), t)
    with pytest.raises(ValueError, match="vocab_size: must be in"):
        gpucore.cross_entropy(logits, t, vocab_size=11)
    with pytest.raises(TypeError, match="vocab_size: expected an int"):
        gpucore.cross_entropy(logits, t, vocab_size=9.0)
    with pytest.raises(TypeError, match="grad_scale: expected a float"):
        gpucore.fused_classifier(logits, t, grad_scale="1")
    with pytest.raises(ValueError, match="losses: expected shape"):
        gpucore.cross_entropy(logits, t, losses=np.zeros(3, np.float32))
    before = logits.copy()
    with pytest.raises(ValueError, match=r"targets: every target must be in \[0, 9\)"):
        gpucore.fused_classifier(logits, t, vocab_size=9)     # 9 >= V
    with pytest.raises(ValueError, match="targets: every target"):
        gpucore.cross_entropy(logits, np.array([0, -2, 1, 1], np.int32))
    np.testing.assert_array_equal(logits, before)             # nothing written on error


# ------------------------------------------------------------------ GPU ----

# (rows shape, V, Vp): GPT-2's padded vocabulary, unpadded, odd sizes, tiny.
GPU_CASES = [((4, 16), 50257, 50304), ((7,), 50304, 50304), ((300,), 1000, 1024),
             ((33,), 1001, 1001), ((5,), 5, 8), ((2, 3), 3, 3), ((64,), 50257, 50257)]


def _gpu_versions(dtype, Vp):
    """None (the default), v1 always, v2 and v3 where their layout conditions hold (v3: rows of up
    to 512 * 25 packs that fit an H100/H200's 227 KiB of shared memory per block)."""
    P = 16 // np.dtype(dtype).itemsize
    whole = Vp % P == 0
    return ([None, 1] + ([2] if whole and Vp // P <= 1024 * 7 else [])
            + ([3] if whole and Vp // P <= 512 * 25 and Vp // P * 16 <= 227 * 1024 - 1024 else []))


CASES = [(shape, V, Vp, d, ver) for shape, V, Vp in GPU_CASES for d in DTYPES for ver in _gpu_versions(d, Vp)]


@pytest.mark.cuda
@pytest.mark.parametrize("shape,V,Vp,dtype,version", CASES)
def test_gpu_fused_matches_reference_and_is_deterministic(rng, shape, V, Vp, dtype, version):
    cp = runtime.cupy
    logits = (rng.standard_normal((*shape, Vp)) * 3).astype(dtype)
    t = _targets(rng, shape, V, ignore_every=3)
    ref_losses, ref_d = classifier_reference(logits, t, V)
    tg = cp.asarray(t)
    work = cp.asarray(logits)
    losses = cp.full(shape, np.nan, dtype=np.float32)
    gpucore.fused_classifier(work, tg, vocab_size=V, losses=losses, version=version)
    got_l, got_d = to_cpu(losses), to_cpu(work)
    assert not np.isnan(got_l).any() and not np.isnan(got_d.astype(np.float32)).any()
    assert rel_err(got_l, ref_losses) < 1e-5, "losses"
    assert rel_err(got_d, ref_d) < (1e-5 if dtype == np.float32 else 1e-2), "dlogits"
    assert np.all(got_d[..., V:].astype(np.float32) == 0), "padded columns must get zero gradient"
    assert np.all(got_d[t == -1].astype(np.float32) == 0), "ignored rows must get zero gradient"
    assert np.all(got_l[t == -1] == 0)
    # determinism: the same logits again give the same bits
    work2 = cp.asarray(logits)
    losses2 = gpucore.fused_classifier(work2, tg, vocab_size=V, version=version)
    assert to_cpu(work2).tobytes() == got_d.tobytes(), "dlogits not bitwise deterministic"
    assert to_cpu(losses2).tobytes() == got_l.tobytes(), "losses not bitwise deterministic"


@pytest.mark.cuda
@pytest.mark.parametrize("shape,V,Vp", GPU_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_cross_entropy_matches_reference(rng, shape, V, Vp, dtype):
    cp = runtime.cupy
    logits = (rng.standard_normal((*shape, Vp)) * 3).astype(dtype)
    t = _targets(rng, shape, V, ignore_every=4)
    lg = cp.asarray(logits)
    losses = gpucore.cross_entropy(lg, cp.asarray(t), vocab_size=V)
    assert rel_err(to_cpu(losses), cross_entropy_reference(logits, t, V)) < 1e-5
    assert to_cpu(lg).tobytes() == logits.tobytes(), "cross_entropy must not modify the logits"


@pytest.mark.cuda
def test_gpu_grad_scale_and_large_logits(rng):
    cp = runtime.cupy
    logits = (rng.standard_normal((8, 4096)) * 20 + 500).astype(np.float32)
    t = _targets(rng, (8,), 4000)
    ref_losses, ref_d = classifier_reference(logits, t, 4000, grad_scale=2.5)
    work = cp.asarray(logits)
    losses = gpucore.fused_classifier(work, cp.asarray(t), vocab_size=4000, grad_scale=2.5)
    assert rel_err(to_cpu(losses), ref_losses) < 1e-5
    assert rel_err(to_cpu(work), ref_d) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("version", [None, 3])
def test_gpu_bf16_rows_of_huge_logits(rng, version):
    """bf16 logits near the format's largest value: v3's one-FFMA exponent (x log2e - max log2e)
    would overflow at max log2e, so such rows take the two-op form; the max's own term stays 1."""
    cp = runtime.cupy
    V = Vp = 1024
    logits = (rng.standard_normal((4, Vp)) * 3).astype(np.float32)
    logits[0, 17] = 3.0e38                            # a huge max among ordinary logits
    logits[1, :] = -3.0e38                            # every logit hugely negative ...
    logits[1, 500] = -2.9e38                          # ... one less so
    logits[2, [100, 900]] = 2.5e38                    # a tie at a huge max: two terms of 1
    logits = logits.astype(gpucore.bfloat16)
    t = np.array([17, 3, 900, 5], np.int32)
    ref_l, ref_d = classifier_reference(logits, t, V, grad_scale=0.5)
    work = cp.asarray(logits)
    losses = to_cpu(gpucore.fused_classifier(work, cp.asarray(t), vocab_size=V, grad_scale=0.5, version=version))
    got = to_cpu(work).astype(np.float32)
    np.testing.assert_allclose(losses, ref_l, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got, ref_d, rtol=1e-2, atol=1e-6)
    assert got[2, 100] == 0.25 and got[2, 900] == -0.25
    ce = to_cpu(gpucore.cross_entropy(cp.asarray(logits), cp.asarray(t), vocab_size=V))
    np.testing.assert_allclose(ce, ref_l, rtol=1e-5, atol=1e-4)


@pytest.mark.cuda
def test_gpu_unaligned_logits_use_the_scalar_path(rng):
    cp = runtime.cupy
    V = 1000
    flat = rng.standard_normal(1 + 6 * V).astype(np.float32)
    work = cp.asarray(flat)[1:].reshape(6, V)
    assert work.data.ptr % 16 != 0
    t = _targets(rng, (6,), V)
    ref_losses, ref_d = classifier_reference(flat[1:].reshape(6, V), t)
    losses = gpucore.fused_classifier(work, cp.asarray(t))
    assert rel_err(to_cpu(losses), ref_losses) < 1e-5
    assert rel_err(to_cpu(work), ref_d) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("bad", [50257, 50303, 70000, -2])
def test_gpu_out_of_range_target_raises_before_launch(rng, bad):
    cp = runtime.cupy
    logits = cp.asarray(rng.standard_normal((5, 50304)).astype(gpucore.bfloat16))
    before = to_cpu(logits).tobytes()
    t = _targets(rng, (5,), 50257)
    t[3] = bad
    with pytest.raises(ValueError, match="targets: every target"):
        gpucore.fused_classifier(logits, cp.asarray(t), vocab_size=50257)
    with pytest.raises(ValueError, match="targets: every target"):
        gpucore.cross_entropy(logits, cp.asarray(t), vocab_size=50257)
    assert to_cpu(logits).tobytes() == before


@pytest.mark.cuda
def test_gpu_target_check_counts_many_targets(rng):
    cp = runtime.cupy
    from gpucore.ops.classifier import _target_stats
    t = rng.integers(-1, 50257, size=65536 + 3).astype(np.int32)
    assert _target_stats(cp.asarray(t), cp) == (int(t.min()), int(t.max()), int((t != -1).sum()))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("version", [1, 3])
def test_gpu_targets_at_pack_edges_and_nonfinite_rows(rng, dtype, version):
    """Targets in the first/last column and in the pack that straddles V; rows with NaN, +inf and
    all -inf logits give NaN losses and NaN dlogits (bf16: the NaN bits v1 writes), other rows
    are untouched by them."""
    cp = runtime.cupy
    V, Vp = 50257, 50304
    logits = (rng.standard_normal((9, Vp)) * 3).astype(np.float32)
    t = np.array([0, V - 1, V - 2, (V // 8) * 8, 12345, 7, 8, 9, 10], np.int32)
    logits[6, 100] = np.nan
    logits[7, 200] = np.inf
    logits[8, :] = -np.inf
    logits = logits.astype(dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        ref_losses, ref_d = classifier_reference(logits, t, V, grad_scale=0.25)
    work = cp.asarray(logits)
    losses = to_cpu(gpucore.fused_classifier(work, cp.asarray(t), vocab_size=V, grad_scale=0.25, version=version))
    got = to_cpu(work)
    assert rel_err(losses[:6], ref_losses[:6]) < 1e-5
    assert rel_err(got[:6], ref_d[:6]) < (1e-5 if dtype == np.float32 else 1e-2)
    assert np.all(got[:6, V:].astype(np.float32) == 0)
    assert np.isnan(losses[6:]).all(), "rows with NaN / inf / all -inf logits must give a NaN loss"
    assert np.isnan(got[6:, :V].astype(np.float32)).all()
    if version == 3 and dtype != np.float32:
        ref1 = cp.asarray(logits)
        gpucore.fused_classifier(ref1, cp.asarray(t), vocab_size=V, grad_scale=0.25, version=1)
        assert to_cpu(ref1)[6:, :V].tobytes() == got[6:, :V].tobytes(), "NaN bits differ from v1's"


@pytest.mark.cuda
@pytest.mark.parametrize("version", [None, 1, 3])
def test_gpu_check_targets_false_skips_the_check(rng, version):
    cp = runtime.cupy
    V, Vp = 1000, 1024
    logits = rng.standard_normal((6, Vp)).astype(gpucore.bfloat16)
    t = _targets(rng, (6,), V)
    ref_losses, ref_d = classifier_reference(logits, t, V, grad_scale=0.5)
    work = cp.asarray(logits)
    losses = gpucore.fused_classifier(work, cp.asarray(t), vocab_size=V, grad_scale=0.5, version=version,
                                      check_targets=False)
    assert rel_err(to_cpu(losses), ref_losses) < 1e-5 and rel_err(to_cpu(work), ref_d) < 1e-2
    # a bad target is not caught: its row's loss is NaN, the kernels stay in bounds, other rows are right
    bad = t.copy()
    bad[2] = V + 5
    work = cp.asarray(logits)
    losses = to_cpu(gpucore.fused_classifier(work, cp.asarray(bad), vocab_size=V, grad_scale=0.5,
                                             version=version, check_targets=False))
    assert np.isnan(losses[2]) and rel_err(np.delete(losses, 2), np.delete(ref_losses, 2)) < 1e-5
    assert np.all(to_cpu(work)[2, V:].astype(np.float32) == 0)
    # the default grad_scale needs the count of targets: the check runs anyway
    with pytest.raises(ValueError, match="targets: every target"):
        gpucore.fused_classifier(cp.asarray(logits), cp.asarray(bad), vocab_size=V, check_targets=False)
    ce = gpucore.cross_entropy(cp.asarray(logits), cp.asarray(t), vocab_size=V, check_targets=False)
    assert rel_err(to_cpu(ce), ref_losses) < 1e-5


@pytest.mark.cuda
def test_gpu_v3_rejects_what_it_cannot_hold(rng):
    cp = runtime.cupy
    logits = cp.asarray(rng.standard_normal((2, 1001)).astype(np.float32))
    with pytest.raises(ValueError, match="version: v3 needs"):
        gpucore.fused_classifier(logits, cp.zeros(2, np.int32), version=3)
    big = cp.zeros((1, 512 * 25 * 4 + 4), np.float32)          # more packs than v3 instantiates
    with pytest.raises(ValueError, match="version: v3 needs"):
        gpucore.fused_classifier(big, cp.zeros(1, np.int32), version=3)


# ------------------------------------------------- FP8 dlogits (LM head) ----

from gpucore.ops.classifier import dlogits_fp8_scale     # noqa: E402
from gpucore.ops.fp8 import fp8_quantize, fp8_quantize_reference   # noqa: E402


def test_dlogits_fp8_scale_is_the_largest_power_of_two_that_never_saturates():
    for gs in (1.0, 1 / 65536, 1 / 3, 2.5e-7):
        s = dlogits_fp8_scale(gs)
        assert np.log2(s) == int(np.log2(s))
        assert gs * s <= 57344.0 < 2 * gs * s
    with pytest.raises(ValueError, match="grad_scale > 0"):
        dlogits_fp8_scale(0.0)


def test_fp8_dlogits_numpy_are_the_cast_of_the_bf16_dlogits(rng):
    logits = (rng.standard_normal((32, 64)) * 3).astype(gpucore.bfloat16)
    t = _targets(rng, (32,), 60, ignore_every=5)
    gs = 1.0 / 27
    s = dlogits_fp8_scale(gs)
    d8 = np.zeros((32, 64), np.uint8)
    work = logits.copy()
    gpucore.fused_classifier(work, t, vocab_size=60, grad_scale=gs, dlogits8=d8, dlogits8_scale=s)
    want, _ = fp8_quantize(work, "e5m2", np.full(1, s, np.float32), out=np.zeros((32, 64), np.uint8))
    assert d8.tobytes() == want.tobytes()
    assert np.all(d8[:, 60:] == 0) and np.all(d8[t == -1] == 0) and d8.any()


def test_fp8_dlogits_only_numpy_leaves_the_logits(rng):
    """write_dlogits=False: the same E5M2 bytes, the logits untouched; it needs dlogits8."""
    logits = (rng.standard_normal((32, 64)) * 3).astype(gpucore.bfloat16)
    t = _targets(rng, (32,), 60, ignore_every=5)
    gs = 1.0 / 27
    s = dlogits_fp8_scale(gs)
    both, only = logits.copy(), logits.copy()
    d8, d8_only = np.zeros((32, 64), np.uint8), np.zeros((32, 64), np.uint8)
    lb = gpucore.fused_classifier(both, t, vocab_size=60, grad_scale=gs, dlogits8=d8, dlogits8_scale=s)
    lo = gpucore.fused_classifier(only, t, vocab_size=60, grad_scale=gs, dlogits8=d8_only, dlogits8_scale=s,
                                  write_dlogits=False)
    assert d8_only.tobytes() == d8.tobytes() and lo.tobytes() == lb.tobytes()
    assert only.tobytes() == logits.tobytes() and both.tobytes() != logits.tobytes()
    with pytest.raises(ValueError, match="write_dlogits=False: needs dlogits8"):
        gpucore.fused_classifier(logits.copy(), t, vocab_size=60, grad_scale=gs, write_dlogits=False)


def test_fp8_dlogits_bad_input(rng):
    logits = rng.standard_normal((16, 64)).astype(np.float32)
    t = _targets(rng, (16,), 64)
    with pytest.raises(TypeError, match="dlogits8: needs bfloat16 logits"):
        gpucore.fused_classifier(logits, t, grad_scale=0.1, dlogits8=np.zeros((16, 64), np.uint8), dlogits8_scale=1.0)
    lb = logits.astype(gpucore.bfloat16)
    with pytest.raises(ValueError, match="dlogits8"):
        gpucore.fused_classifier(lb, t, grad_scale=0.1, dlogits8=np.zeros((16, 32), np.uint8), dlogits8_scale=1.0)
    with pytest.raises(ValueError, match="dlogits8_scale"):
        gpucore.fused_classifier(lb, t, grad_scale=0.1, dlogits8=np.zeros((16, 64), np.uint8), dlogits8_scale=0.0)


@pytest.mark.cuda
@pytest.mark.parametrize("N,V,Vp", [(64, 50257, 50304), (48, 1000, 1024), (16, 64, 64)])
@pytest.mark.parametrize("scale_mul", [1.0, 0.75])
def test_gpu_fp8_dlogits_are_bitwise_the_bf16_kernel_then_the_cast(rng, N, V, Vp, scale_mul):
    """v3's FP8 kernel: the same losses and bf16 dlogits as the plain kernel, and E5M2 bytes equal
    to fp8_quantize of those dlogits (ignored rows, padding, the target column included). With the
    power-of-two scale the model passes, the E5M2-only kernel folds it into the softmax's scale
    before the bf16 rounding; scale_mul 0.75 (not a power of two) takes the multiply after it."""
    from gpucore.ops.fp8 import fp8_supported
    ok, why = fp8_supported()
    if not ok:
        pytest.fail(why)
    cp = runtime.cupy
    logits = (rng.standard_normal((N, Vp)) * 3).astype(gpucore.bfloat16)
    t = cp.asarray(_targets(rng, (N,), V, ignore_every=7))
    gs = 1.0 / (N * 4)
    s = dlogits_fp8_scale(gs) * scale_mul
    plain, fused = cp.asarray(logits), cp.asarray(logits)
    l_plain = gpucore.fused_classifier(plain, t, vocab_size=V, grad_scale=gs, version=3)
    d8 = cp.full((N, Vp), 0x7f, np.uint8)           # poison: every byte must be written
    l_fused = gpucore.fused_classifier(fused, t, vocab_size=V, grad_scale=gs, dlogits8=d8, dlogits8_scale=s)
    assert to_cpu(l_fused).tobytes() == to_cpu(l_plain).tobytes()
    assert to_cpu(fused).tobytes() == to_cpu(plain).tobytes()
    want, _ = fp8_quantize(plain, "e5m2", cp.full(1, s, np.float32), out=cp.empty((N, Vp), np.uint8))
    assert to_cpu(d8).tobytes() == to_cpu(want).tobytes()
    assert to_cpu(d8).any()
    # write_dlogits=False (the FP8 dwte head): the same bytes and losses, the logits left as they were
    only, d8_only = cp.asarray(logits), cp.full((N, Vp), 0x7f, np.uint8)
    l_only = gpucore.fused_classifier(only, t, vocab_size=V, grad_scale=gs, dlogits8=d8_only, dlogits8_scale=s,
                                      write_dlogits=False)
    assert to_cpu(d8_only).tobytes() == to_cpu(want).tobytes()
    assert to_cpu(l_only).tobytes() == to_cpu(l_plain).tobytes()
    assert to_cpu(only).tobytes() == logits.tobytes()


@pytest.mark.cuda
@pytest.mark.parametrize("V,Vp", [(50257, 50304), (1000, 1024), (3000, 3008)])
@pytest.mark.parametrize("write_dlogits", [False, True])
def test_gpu_fp8_persistent_blocks_match_one_row_a_block(rng, V, Vp, write_dlogits):
    """v3's FP8 kernel walks several rows a block (N > its grid) and copies the next row in while it
    finishes one: losses, E5M2 bytes and bf16 dlogits are bit for bit what slices of <= 64 rows give
    (one row a block there). Ignored rows (-1) sit first, last, in runs and alone."""
    from gpucore.ops import classifier as cls
    from gpucore.ops.fp8 import fp8_supported
    ok, why = fp8_supported()
    if not ok:
        pytest.fail(why)
    cp = runtime.cupy
    kernel = runtime.get_kernel("classifier", f"classifier_backward_fp8_kernel_v3_k{cls._v3_k(Vp // 8)}_bf16")
    grid = cls.v3_fp8_grid(kernel, 10**9, Vp // 8)
    N = 2 * grid + 37                                 # two full walks and a partial third
    assert 64 < grid < N
    logits = (rng.standard_normal((N, Vp)) * 3).astype(gpucore.bfloat16)
    t = _targets(rng, (N,), V, ignore_every=11)
    t[[0, 1, 2, grid, grid + 1, N - 1]] = -1
    tg = cp.asarray(t)
    gs = 1.0 / N
    s8 = dlogits_fp8_scale(gs)

    def run(sl):
        n = sl.stop - sl.start
        d8 = cp.full((n, Vp), 0x7f, np.uint8)
        losses = cp.full(n, np.nan, np.float32)
        work = cp.asarray(logits[sl])
        cls.launch_fused_fp8(work, tg[sl], losses, V, gs, d8, s8, write_dlogits=write_dlogits)
        return to_cpu(losses), to_cpu(d8), to_cpu(work)

    whole = run(slice(0, N))
    sliced = [np.concatenate(p) for p in zip(*[run(slice(a, min(a + 64, N))) for a in range(0, N, 64)])]
    for name, a, b in zip(("losses", "dlogits8", "logits/dlogits"), whole, sliced):
        assert a.tobytes() == b.tobytes(), f"{name}: the persistent walk differs from one row a block"
    losses, d8, work = whole
    assert not np.isnan(losses).any() and np.all(losses[t == -1] == 0) and np.all(d8[t == -1] == 0)
    assert (work.tobytes() == logits.tobytes()) != write_dlogits
    ref_losses, _ = classifier_reference(logits[:8], t[:8], V, grad_scale=gs)
    assert rel_err(losses[:8], ref_losses) < 1e-5


# ------------------------------------------- sparse E5M2 dlogits (sparse_tau) ----

def test_fmix32_known_answers():
    """murmur3's finalizer, as the kernel hashes: known values, and the wrapping NumPy form equals
    the same arithmetic on Python ints."""
    from gpucore.ops.classifier import fmix32
    assert fmix32([0, 1]).tolist() == [0, 0x514E28B7]

    def scalar(h):
        M = 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & M
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & M
        return h ^ (h >> 16)
    vals = np.random.default_rng(3).integers(0, 2**32, 200, dtype=np.uint64).astype(np.uint32)
    assert fmix32(vals).tolist() == [scalar(int(v)) for v in vals]


def _bf16_values(x):
    return np.asarray(x, np.float32).astype(gpucore.bfloat16).astype(np.float32)


def test_sparse_dlogits_rule():
    """|v| >= tau, inf and NaN stay; a smaller value becomes sign(v) tau or sign(v) 0, a row of 8
    columns sharing one draw; the draws follow the seed, the row (row0 + r) and the pack."""
    from gpucore.ops.classifier import sparse_dlogits_reference
    tau = 4.0
    r = np.random.default_rng(5)
    v = _bf16_values(r.standard_normal((64, 128)) * np.exp2(r.integers(-12, 4, (64, 128))))
    v[0, :8] = [np.nan, np.inf, -np.inf, 0.0, -0.0, tau, -tau, 57344.0]
    out = sparse_dlogits_reference(v, tau, seed=7, row0=0)
    big = np.abs(v) >= tau
    assert np.array_equal(out[big], v[big]) and np.isnan(out[0, 0])
    small = ~big & ~np.isnan(v)
    assert set(np.unique(np.abs(out[small]))) <= {0.0, tau}
    assert np.array_equal(np.signbit(out[small]), np.signbit(v[small]))
    assert 0 < np.count_nonzero(out[small]) < small.sum()
    # one draw a pack: within a pack, a kept value is never smaller than a dropped one
    packs = np.where(small, np.abs(v), np.nan).reshape(64, 16, 8)
    kept = (np.abs(out) == tau).reshape(64, 16, 8) & small.reshape(64, 16, 8)
    lo_kept = np.where(kept, packs, np.inf).min(axis=2)
    hi_dropped = np.where(~kept & small.reshape(64, 16, 8), packs, -np.inf).max(axis=2)
    assert np.all(lo_kept > hi_dropped)
    assert not np.array_equal(out, sparse_dlogits_reference(v, tau, seed=8))
    # rows are keyed by row0 + r: rows 10.. of a call from 0 are rows 0.. of a call from 10
    assert np.array_equal(sparse_dlogits_reference(v, tau, 7, row0=0)[10:],
                          sparse_dlogits_reference(v[10:], tau, 7, row0=10))


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_sparse_dlogits_keep_their_expectation(fmt):
    """Over 8192 rows of the same small values the mean of the thinned values is the value (within
    5 standard errors of the draws), and a value's chance to be kept is |v| / tau -- on either
    format's grid (f16: the FP8 kernel's, down to its subnormals)."""
    from gpucore.ops.classifier import sparse_dlogits_reference
    tau, N = 2.0 ** -3, 8192
    vals = [tau * 0.9, tau * 0.5, tau * 0.1, tau * 0.013, -tau * 0.3, tau * 2 ** -10, 0.0, tau * 0.77]
    if fmt == "f16":
        tau, vals = 2.0 ** -10, np.float32(vals) * np.float32(2.0 ** -7)   # the small ones f16 subnormals
        vals = np.float32(vals).astype(np.float16).astype(np.float32)
        assert np.count_nonzero((vals != 0) & (np.abs(vals) < 2.0 ** -14)) >= 2
    else:
        vals = _bf16_values(vals)
    v = np.tile(np.tile(vals, 4), (N, 1))                       # 32 columns: 4 packs a row
    out = sparse_dlogits_reference(v, tau, seed=123, fmt=fmt).astype(np.float64)
    mean = out.mean(axis=0)
    se = np.sqrt(np.abs(v[0]) * (tau - np.abs(v[0])) / N)
    assert np.all(np.abs(mean - v[0]) <= 5 * se + 1e-12)
    frac = (out != 0).mean(axis=0)
    assert np.all(np.abs(frac - np.abs(v[0]) / tau) <= 5 * np.sqrt(0.25 / N))


def test_sparse_f16_threshold_is_truncated():
    """fmt="f16": t is U * tau truncated toward zero onto f16's grid (subnormals too): the largest f16
    value <= U * tau. Checked through the rule on single values just around t."""
    from gpucore.ops.classifier import _f16_toward_zero, sparse_dlogits_reference
    x = np.float32([0.0, 1.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 2.0 ** -24, 3.5 * 2.0 ** -24, 65504.0,
                    2.0 ** -14 - 2.0 ** -30])
    want = np.float32([0.0, 1.0, 1.0, 1.0 + 2.0 ** -10, 2.0 ** -24, 3 * 2.0 ** -24, 65504.0, 2.0 ** -14 - 2.0 ** -24])
    assert np.array_equal(_f16_toward_zero(x), want)
    r = np.random.default_rng(0)
    y = (r.random(4000) * np.exp2(r.integers(-26, 5, 4000))).astype(np.float32)
    t = _f16_toward_zero(y)
    nxt = np.nextafter(t.astype(np.float16), np.float16(np.inf)).astype(np.float32)
    assert np.all(t <= y) and np.all(nxt > y) and np.array_equal(t, t.astype(np.float16).astype(np.float32))
    # through the rule: with tau a power of two, a value v on f16's grid is kept exactly when v > t
    tau = 2.0 ** -8
    v = np.full((1, 8), np.float32(tau * 0.37)).astype(np.float16).astype(np.float32)
    kept = [bool(sparse_dlogits_reference(v, tau, seed, fmt="f16")[0, 0]) for seed in range(400)]
    assert 0.25 < np.mean(kept) < 0.5
    with pytest.raises(ValueError, match="fmt"):
        sparse_dlogits_reference(v, tau, 0, fmt="e5m2")


def _sparse_case(rng, N=32, V=60, Vp=64):
    logits = (rng.standard_normal((N, Vp)) * 3).astype(gpucore.bfloat16)
    t = _targets(rng, (N,), V, ignore_every=5)
    return logits, t, 1.0 / 27


def test_fp8_sparse_dlogits_numpy_are_the_rule_on_the_scaled_dlogits(rng):
    """fused_classifier(sparse_tau=): the E5M2 bytes are the rule applied to the f16 values of the
    dlogits times the scale, then cast (one rounding from f16: E5M2 is f16's top byte); losses and
    the untouched logits as without it. Against the dense bf16 route the bytes differ only where the
    two roundings part: few, each by one E5M2 step or one thinning draw."""
    from gpucore.ops.classifier import classifier_reference, sparse_dlogits_reference
    from gpucore.ops.fp8 import fp8_dequantize
    logits, t, gs = _sparse_case(rng, N=256)
    s = dlogits_fp8_scale(gs)
    tau = 2.0 ** 10                        # ~1.2% of the largest |dlogit| (gs * s ~ 2^15)
    seed = np.array([41], np.uint32)
    work, d8 = logits.copy(), np.zeros((256, 64), np.uint8)
    lo = gpucore.fused_classifier(work, t, vocab_size=60, grad_scale=gs, dlogits8=d8, dlogits8_scale=s,
                                  write_dlogits=False, sparse_tau=tau, sparse_seed=seed, sparse_row0=3)
    dense = logits.copy()
    ld = gpucore.fused_classifier(dense, t, vocab_size=60, grad_scale=gs)
    f16 = (classifier_reference(logits, t, 60, gs)[1] * s).astype(np.float16).astype(np.float32)
    thin = sparse_dlogits_reference(f16, tau, 41, row0=3, fmt="f16")
    assert set(np.unique(np.abs(thin[np.abs(f16) < tau]))) <= {0.0, tau}
    want, _ = fp8_quantize(thin.astype(gpucore.bfloat16), "e5m2", np.ones(1, np.float32),   # exact: tau, 0
                           out=np.zeros((256, 64), np.uint8))                             # and |v| >= tau
    big = np.abs(f16) >= tau                                                              # cast from f16
    want[big] = np.clip(f16[big], -57344, 57344).astype(ml_dtypes.float8_e5m2).view(np.uint8)
    assert d8.tobytes() == want.tobytes() and lo.tobytes() == ld.tobytes()
    bf16_route = sparse_dlogits_reference(dense.astype(np.float32) * np.float32(s), tau, 41, row0=3)
    old, _ = fp8_quantize(bf16_route.astype(gpucore.bfloat16), "e5m2", np.ones(1, np.float32),
                          out=np.zeros((256, 64), np.uint8))
    diff = d8 != old
    assert diff.mean() < 0.01
    a, b = fp8_dequantize(d8[diff], "e5m2"), fp8_dequantize(old[diff], "e5m2")
    step = np.exp2(np.floor(np.log2(np.maximum(np.abs(a), np.abs(b)))) - 2)   # E5M2: 2 mantissa bits
    assert np.all((np.abs(a - b) <= step) | (np.minimum(np.abs(a), np.abs(b)) == 0))
    assert work.tobytes() == logits.tobytes()
    assert np.all(d8[:, 60:] == 0) and np.all(d8[t == -1] == 0)
    small = np.abs(dense.astype(np.float32) * s) < tau
    assert (d8[small] & 0x7F == 0).mean() > 0.5          # most small values thinned to zero


def test_fp8_sparse_dlogits_bad_input(rng):
    logits, t, gs = _sparse_case(rng)
    s = dlogits_fp8_scale(gs)
    d8 = np.zeros((32, 64), np.uint8)
    seed = np.zeros(1, np.uint32)
    kw = dict(vocab_size=60, grad_scale=gs, dlogits8=d8, dlogits8_scale=s, write_dlogits=False, sparse_seed=seed)
    with pytest.raises(ValueError, match="power of two"):
        gpucore.fused_classifier(logits.copy(), t, sparse_tau=3.0, **kw)
    with pytest.raises(ValueError, match="sparse_tau: expected a float >= 0"):
        gpucore.fused_classifier(logits.copy(), t, sparse_tau=-1.0, **kw)
    with pytest.raises(ValueError, match="write_dlogits=False"):
        gpucore.fused_classifier(logits.copy(), t, sparse_tau=4.0, **{**kw, "write_dlogits": True})
    with pytest.raises(ValueError, match="power-of-two dlogits8_scale"):
        gpucore.fused_classifier(logits.copy(), t, sparse_tau=4.0, **{**kw, "dlogits8_scale": s * 0.75})
    with pytest.raises(TypeError, match="sparse_seed"):
        gpucore.fused_classifier(logits.copy(), t, sparse_tau=4.0, **{**kw, "sparse_seed": None})
    with pytest.raises(TypeError, match="sparse_seed: dtype"):
        gpucore.fused_classifier(logits.copy(), t, sparse_tau=4.0, **{**kw, "sparse_seed": np.zeros(1, np.int32)})
    with pytest.raises(ValueError, match="sparse_row0"):
        gpucore.fused_classifier(logits.copy(), t, sparse_tau=4.0, sparse_row0=-1, **kw)


@pytest.mark.cuda
@pytest.mark.parametrize("V,Vp", [(50257, 50304), (1000, 1024)])
def test_gpu_fp8_sparse_dlogits_are_the_rule(rng, V, Vp):
    """v3's FP8 kernel with sparse_tau: its bytes are the NumPy rule (the f16 values of the scaled
    dlogits, thinned, cast to E5M2) -- over persistent walks (N > the grid), ignored rows and
    padding, from a row offset; the seed is read from device memory (a new seed, new bytes); the
    losses are the dense kernel's. The kernel's fp32 softmax is within EPS (relative) of the float64
    one, so each byte must be the rule's on f16(x (1 - EPS)) or on f16(x (1 + EPS)): the same byte
    nearly everywhere (asserted), one of two where x sits on an f16 rounding boundary."""
    from gpucore.ops import classifier as cls
    from gpucore.ops.fp8 import fp8_supported
    ok, why = fp8_supported()
    if not ok:
        pytest.fail(why)
    cp = runtime.cupy
    kernel = runtime.get_kernel("classifier", f"classifier_backward_fp8_kernel_v3_k{cls._v3_k(Vp // 8)}_bf16")
    N = cls.v3_fp8_grid(kernel, 10**9, Vp // 8) + 29
    logits = (rng.standard_normal((N, Vp)) * 3).astype(gpucore.bfloat16)
    t = _targets(rng, (N,), V, ignore_every=9)
    # the columns the kernel's after-the-loop fix-up writes by hand (h16_fixup): the target in the
    # pack that holds the padding, in a row's first and last full packs, and in the last rows, which
    # the walking blocks refill from nothing
    last = 8 * ((V - 1) // 8)              # the first column of the row's last pack
    t[[1, 2, 3, 4, N - 1, N - 2]] = [V - 1, 0, last - 1, last, V - 1, 7]
    tg = cp.asarray(t)
    gs = 1.0 / N
    s = dlogits_fp8_scale(gs)
    tau = 2.0 ** np.round(np.log2(2.0 ** -13 * gs * s)) if V > 10000 else 2.0 ** np.round(np.log2(1e-2 * gs * s))
    plain = cp.asarray(logits)
    l_plain = gpucore.fused_classifier(plain, tg, vocab_size=V, grad_scale=gs, version=3)
    x = classifier_reference(logits, t, V, gs)[1] * s                   # float64, scaled
    EPS = 2e-5                 # the kernel's ex2.approx, exponent FMAs, row sum: a few 1e-6 (asserted slack)
    mag = np.abs(x)
    rows = np.flatnonzero(t != -1)
    mag[rows, t[rows]] += gs * s          # the target's p - 1: its error scales with both terms
    bounds = [(x + sign * EPS * mag).astype(np.float16).astype(np.float32) for sign in (-1, 1)]
    seed = cp.asarray([2024], np.uint32)
    outs = []
    for sv in (2024, 2025):
        seed[...] = sv
        d8 = cp.full((N, Vp), 0x7f, np.uint8)
        losses = gpucore.fused_classifier(cp.asarray(logits), tg, vocab_size=V, grad_scale=gs, dlogits8=d8,
                                          dlogits8_scale=s, write_dlogits=False, sparse_tau=float(tau),
                                          sparse_seed=seed, sparse_row0=1000)
        lo, hi = (fp8_quantize_reference(cls.sparse_dlogits_reference(b, tau, sv, row0=1000, fmt="f16"),
                                         "e5m2", 1.0) for b in bounds)
        got = to_cpu(d8)
        bad = (got != lo) & (got != hi)
        assert not bad.any(), f"seed {sv}: {bad.sum()} bytes are neither rounding's, first at {np.argwhere(bad)[0]}"
        assert (lo != hi).mean() < 1e-4                                  # the band decides few bytes
        assert np.array_equal(got[t == -1], np.zeros_like(got[t == -1])) and not got[:, V:].any()
        assert to_cpu(losses).tobytes() == to_cpu(l_plain).tobytes()
        outs.append(got)
    assert outs[0].tobytes() != outs[1].tobytes()
    zero = (outs[0] & 0x7F) == 0
    assert zero[t != -1].mean() > (0.5 if V > 10000 else 0.2)     # thinned: mostly zeros at the real vocabulary


def test_bf16_sparse_dlogits_numpy_are_the_rule_on_the_dlogits(rng):
    """Without dlogits8, sparse_tau thins the bf16 dlogits written over the logits (the bf16 LM
    head's, settings.bf16_lm_head_sparse); float32 logits are refused."""
    from gpucore.ops.classifier import sparse_dlogits_reference
    logits, t, gs = _sparse_case(rng)
    tau = 2.0 ** -10
    seed = np.array([9], np.uint32)
    thin = logits.copy()
    lt = gpucore.fused_classifier(thin, t, vocab_size=60, grad_scale=gs, sparse_tau=tau, sparse_seed=seed)
    dense = logits.copy()
    ld = gpucore.fused_classifier(dense, t, vocab_size=60, grad_scale=gs)
    want = sparse_dlogits_reference(dense.astype(np.float32), tau, 9).astype(gpucore.bfloat16)
    assert thin.tobytes() == want.tobytes() and lt.tobytes() == ld.tobytes()
    small = np.abs(dense.astype(np.float32)) < tau
    assert (thin.astype(np.float32)[small] == 0).mean() > 0.5
    with pytest.raises(TypeError, match="sparse_tau: thins bf16 dlogits"):
        gpucore.fused_classifier(logits.astype(np.float32), t, vocab_size=60, grad_scale=gs, sparse_tau=tau,
                                 sparse_seed=seed)


@pytest.mark.cuda
@pytest.mark.parametrize("V,Vp", [(50257, 50304), (1000, 1024)])
def test_gpu_bf16_sparse_dlogits_are_the_rule(rng, V, Vp):
    """v3's bf16 kernel with sparse_tau: its dlogits are the NumPy rule applied to the dense kernel's,
    bit for bit (ignored rows, padding, a row offset); the losses are the dense kernel's."""
    from gpucore.ops import classifier as cls
    cp = runtime.cupy
    N = 300
    logits = (rng.standard_normal((N, Vp)) * 3).astype(gpucore.bfloat16)
    t = _targets(rng, (N,), V, ignore_every=9)
    tg = cp.asarray(t)
    gs = 1.0 / N
    tau = 2.0 ** np.round(np.log2((2.0 ** -13 if V > 10000 else 1e-2) * gs))
    dense = cp.asarray(logits)
    l_dense = gpucore.fused_classifier(dense, tg, vocab_size=V, grad_scale=gs, version=3)
    seed = cp.asarray([77], np.uint32)
    thin = cp.asarray(logits)
    l_thin = gpucore.fused_classifier(thin, tg, vocab_size=V, grad_scale=gs, sparse_tau=float(tau),
                                      sparse_seed=seed, sparse_row0=4096)
    want = cls.sparse_dlogits_reference(to_cpu(dense).astype(np.float32), tau, 77, row0=4096)
    got = to_cpu(thin)
    assert got.tobytes() == want.astype(gpucore.bfloat16).tobytes()
    assert to_cpu(l_thin).tobytes() == to_cpu(l_dense).tobytes()
    zero = got.astype(np.float32) == 0
    assert zero[t != -1].mean() > (0.5 if V > 10000 else 0.2)
