"""The fused classifier: softmax + cross-entropy + its gradient in one pass (kernels_cu/classifier.cu).

GPT-2's last layer produces logits (B, T, Vp) over a vocabulary padded from
V = 50257 to Vp = 50304 columns. `fused_classifier` computes the per-token
losses and overwrites the logits with

    dlogits = grad_scale * (softmax(logits[..., :V]) - onehot(targets))

(zero in the padded columns [V, Vp), zero rows for the ignore index -1), so the
probabilities never exist as a separate (B, T, Vp) array. `cross_entropy`
gives the losses alone and leaves the logits untouched.

Targets must lie in [0, V) or be -1. An out-of-range target raises ValueError
*before* anything is written: on the GPU one tiny kernel computes (min, max,
count of non-ignored) of the targets and the host reads those three ints back
(one synchronisation per call; the count is also what the default
grad_scale = 1 / number of non-ignored targets needs). `check_targets=False`
skips that check and its synchronisation on the GPU -- for the training loop,
whose data loader validated the token ids already; the kernels then stay in
bounds and write a NaN loss for a bad target. With grad_scale=None the count
is needed, so the check runs anyway.

The reference computes in float64 and rounds once; the kernels accumulate in
float32 (exp via ex2.approx / __expf, log via logf).

Kernel versions of the fused classifier (classifier.cu): v1 online pass + L2
re-read (any Vp, any alignment), v2 row in registers (one block per SM), v3
row in shared memory via cp.async with lean per-element code (Vp a multiple of
16 bytes' worth of elements, 16-byte aligned, the row within the device's
shared memory per block: bf16 up to ~116k columns, fp32 up to ~58k on an
H100/H200). `version=None` picks v3 where it applies, else v1. cross_entropy
runs v3's kernel without its write pass where v3 applies.

FP8 (`dlogits8=`, `dlogits8_scale=`; bf16 logits): the LM head's FP8 backward
(settings.fp8_lm_head) also wants dlogits as E5M2 bytes, scaled by a fixed power
of two (`dlogits_fp8_scale(grad_scale)`: |dlogits| <= grad_scale, so no amax is
needed). v3's FP8 kernel writes them beside the bf16 dlogits in the same pass, bit
for bit fp8_quantize of the bf16 values; elsewhere (NumPy, v1/v2) the cast runs after.
With `write_dlogits=False` it writes only those bytes (the FP8 LM head that takes dwte from them
too, settings.fp8_lm_head_dwte): a third of the kernel's writes. Thinned (`sparse_tau=`, the
--dtype fp8 default) those bytes come from f16 values instead: e5m2(thin(f16(dlogits * scale))).
The FP8 kernel runs on persistent blocks that stream their next row in while they finish one
(v3_fp8_grid).
"""
from __future__ import annotations

import numbers

import numpy as np

from .. import dtypes, runtime
from .. import profiler
from ._common import check_array, output

INT32 = np.dtype(np.int32)
CLS_BLOCK = 1024          # threads per row (one block per row), as CLS_BLOCK in classifier.cu
V2_CACHE = 7              # packs per thread held in registers by v2, = CLS_CACHE in classifier.cu
V3_BLOCK = 512            # v3 threads per row, = CLS3_BLOCK in classifier.cu
V3_K = (1, 4, 13, 25)     # v3 packs per thread instantiated in classifier.cu
V3_WALK_K = 13            # the largest K whose blocks walk several rows, = V3_WALK_K in classifier.cu
V3_STATIC_SMEM = 1024     # margin for v3's static shared memory (136 B) below the per-block limit
FORWARD_BLOCK_SHORT = 256  # cross_entropy on short rows (< 8192 columns)
VERSIONS = (1, 2, 3)


# ----------------------------------------------------------- references ----

def classifier_reference(logits: np.ndarray, targets: np.ndarray, vocab_size: int | None = None,
                         grad_scale: float | None = None):
    """float64 (losses (...,), dlogits (..., Vp)) -- the math of the fused kernel, with no checks."""
    Vp = logits.shape[-1]
    V = Vp if vocab_size is None else int(vocab_size)
    x = np.asarray(logits, dtype=np.float64).reshape(-1, Vp)
    t = np.asarray(targets).reshape(-1).astype(np.int64)
    xv = x[:, :V]
    m = xv.max(axis=-1, keepdims=True)
    e = np.exp(xv - m)
    s = e.sum(axis=-1, keepdims=True)
    rows = np.arange(x.shape[0])
    valid = t != -1
    tt = np.where(valid, t, 0)
    losses = np.where(valid, m[:, 0] + np.log(s[:, 0]) - xv[rows, tt], 0.0)
    if grad_scale is None:
        grad_scale = 1.0 / max(int(valid.sum()), 1)
    d = np.zeros_like(x)
    d[:, :V] = e / s
    d[rows[valid], tt[valid]] -= 1.0
    d *= grad_scale
    d[~valid] = 0.0
    return losses.reshape(targets.shape), d.reshape(logits.shape)


def cross_entropy_reference(logits: np.ndarray, targets: np.ndarray, vocab_size: int | None = None) -> np.ndarray:
    """float64 per-token losses lse(logits[..., :V]) - logits[target]; 0 where target == -1."""
    return classifier_reference(logits, targets, vocab_size, grad_scale=1.0)[0]


# ----------------------------------------------------------- checks --------

def _check_args(logits, targets, vocab_size, losses):
    check_array("logits", logits, min_ndim=2)
    check_array("targets", targets, dtypes_=(INT32,), shape=logits.shape[:-1])
    Vp = logits.shape[-1]
    if vocab_size is None:
        V = Vp
    else:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
            raise TypeError(f"vocab_size: expected an int, got {type(vocab_size).__name__}")
        V = int(vocab_size)
    if not 1 <= V <= Vp:
        raise ValueError(f"vocab_size: must be in [1, {Vp}] (logits' last axis is {Vp}), got {V}")
    xp = runtime.array_module(logits, targets, losses)
    losses = output("losses", losses, xp, targets.shape, np.float32)
    return xp, V, Vp, losses


def _target_stats(targets, xp):
    """(min, max, number of targets != -1); on the GPU one small kernel and one 12-byte read-back."""
    if targets.size == 0:
        return 0, 0, 0
    if xp is np:
        return int(targets.min()), int(targets.max()), int(np.count_nonzero(targets != -1))
    stats = xp.empty(3, dtype=np.int32)
    kernel = runtime.get_kernel("classifier", "classifier_check_targets_kernel")
    runtime.launch(kernel, 1, 1024, (stats, targets, np.int32(targets.size)))
    mn, mx, cnt = (int(v) for v in stats.get())
    return mn, mx, cnt


def _check_targets(targets, xp, V):
    mn, mx, cnt = _target_stats(targets, xp)
    if targets.size and (mn < -1 or mx >= V):
        raise ValueError(f"targets: every target must be in [0, {V}) or -1 (ignored); "
                         f"got values from {mn} to {mx}")
    return cnt


def _smem_per_block() -> int:
    """The device's largest shared memory per block (opt-in), in bytes."""
    return runtime.device_attribute("MaxSharedMemoryPerBlockOptin")


def _v3_k(n_packs: int):
    """Smallest instantiated packs-per-thread K covering the row, or None."""
    return next((k for k in V3_K if n_packs <= V3_BLOCK * k), None)


def pick_version(version, logits, Vp):
    """The fused classifier's kernel version for these (N, Vp) logits on the current device.

    version None: v3 where it applies (Vp a multiple of the 16-byte pack, 16-byte aligned
    logits, a row that fits the device's shared memory per block), else v1; an explicit version
    is checked (ValueError naming what it needs; v1 takes every case)."""
    P = 16 // logits.dtype.itemsize
    whole = Vp % P == 0 and logits.data.ptr % 16 == 0
    v2_ok = whole and Vp // P <= CLS_BLOCK * V2_CACHE
    v3_ok = whole and _v3_k(Vp // P) is not None and Vp // P * 16 <= _smem_per_block() - V3_STATIC_SMEM
    if version is None:
        version = 3 if v3_ok else 1
    if version not in VERSIONS:
        raise ValueError(f"version: the fused classifier has kernel versions 1, 2 and 3, got {version!r}")
    if version == 2 and not v2_ok:
        raise ValueError(f"version: v2 needs Vp a multiple of {P}, Vp <= {CLS_BLOCK * V2_CACHE * P} and "
                         f"16-byte aligned logits (got Vp={Vp}); v1 covers every case")
    if version == 3 and not v3_ok:
        raise ValueError(f"version: v3 needs Vp a multiple of {P}, 16-byte aligned logits and a row that fits "
                         f"the device's shared memory per block (got Vp={Vp}); v1 covers every case")
    return version


_CARVEOUT_SET: set = set()


def _set_carveout(kernel):
    """All of the SM's unified L1/shared memory as shared for a v3 kernel (two 98 KiB bf16 rows per SM)."""
    if id(kernel) not in _CARVEOUT_SET:
        kernel.preferred_shared_memory_carveout = 100
        _CARVEOUT_SET.add(id(kernel))


def v3_fp8_grid(kernel, N: int, n_packs: int) -> int:
    """The v3 FP8 kernel's persistent grid: the blocks that run at once (two a bf16 row's SM), at
    most one a row; each walks rows blockIdx.x, + grid, ... and streams its next row in while it
    finishes one. With K > V3_WALK_K packs a thread it does not walk (its refills spilled): N.
    The bf16/fp32 kernels always run one block a row (walking measured slower for them)."""
    if _v3_k(n_packs) > V3_WALK_K:
        return N
    return min(N, runtime.sm_count() * runtime.resident_blocks(kernel, V3_BLOCK, n_packs * 16))


def _seed_arg(sparse_seed):
    """The v3 kernels' sparse seed pointer: the (1,) array, or null when there is none (not read
    while sparse_tau is 0)."""
    return np.uint64(0) if sparse_seed is None else sparse_seed


def _launch_v3(kernel, grid: int, n_packs: int, args):
    _set_carveout(kernel)
    runtime.launch(kernel, grid, V3_BLOCK, args, shared_mem=n_packs * 16)


def launch_fused(logits, targets, losses, V: int, grad_scale: float, version=None, sparse_tau=0.0, sparse_seed=None,
                 sparse_row0=0):
    """The fused kernel alone, on checked CuPy arrays (no target check): for the benchmark.
    sparse_tau (v3, bf16 logits): the dlogits thinned (fused_classifier)."""
    Vp = logits.shape[-1]
    N = targets.size
    if N == 0:
        return losses
    version = pick_version(version, logits, Vp)
    suf = dtypes.kernel_suffix(logits.dtype)
    args = (losses, logits, targets, np.float32(grad_scale), np.int32(N), np.int32(V), np.int32(Vp))
    if version == 3:
        n_packs = Vp // (16 // logits.dtype.itemsize)
        kernel = runtime.get_kernel("classifier", f"classifier_backward_kernel_v3_k{_v3_k(n_packs)}_{suf}")
        _launch_v3(kernel, N, n_packs, args + (np.float32(sparse_tau), _seed_arg(sparse_seed), np.int32(sparse_row0)))
        return losses
    if sparse_tau:
        raise ValueError("sparse_tau: runs in the v3 kernel only")
    runtime.launch(runtime.get_kernel("classifier", f"classifier_backward_kernel_v{version}_{suf}"), N, CLS_BLOCK,
                   args)
    return losses


# ----------------------------------------------------------- public API ----

def dlogits_fp8_scale(grad_scale: float) -> float:
    """The E5M2 scale of dlogits: the largest power of two with grad_scale * scale <= 57344
    (E5M2's largest finite value), as |dlogits| <= grad_scale."""
    if not grad_scale > 0:
        raise ValueError(f"grad_scale: the FP8 dlogits need grad_scale > 0, got {grad_scale}")
    return float(2.0 ** np.floor(np.log2(57344.0 / grad_scale)))


def sparse_tau_of(probability: float, grad_scale: float, scale: float = 1.0) -> float:
    """fused_classifier's sparse_tau for a thinning threshold given as a probability (settings
    fp8_lm_head_sparse, bf16_lm_head_sparse): the power of two nearest probability * grad_scale *
    scale (the dlogit of that probability; FP8: times dlogits8_scale), 0 when off."""
    if probability <= 0:
        return 0.0
    return float(2.0 ** np.round(np.log2(probability * grad_scale * scale)))


def fmix32(h) -> np.ndarray:
    """murmur3's 32-bit finalizer on uint32 values (wrapping), as the classifier kernels hash the
    sparse dlogits' draws (kernels_cu/classifier.cu)."""
    h = np.array(h, dtype=np.uint32, copy=True)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def _f16_toward_zero(x: np.ndarray) -> np.ndarray:
    """float32 x >= 0 truncated to float16 (round toward zero, subnormals kept), as float32."""
    h = x.astype(np.float16)                                # nearest even
    over = h.astype(np.float32) > x                         # rounded up: one step back toward zero
    h = np.where(over, (h.view(np.uint16) - np.uint16(1)).view(np.float16), h)
    return h.astype(np.float32)


def sparse_dlogits_reference(v, tau: float, seed: int, row0: int = 0, fmt: str = "bf16") -> np.ndarray:
    """The classifier's stochastic sparsification (sparse_tau), on v (N, Vp): the bf16 dlogits (FP8:
    the f16 values of the dlogits scaled by dlogits8_scale, fmt="f16"), as float32. |v| >= tau, inf
    and NaN stay; each smaller value becomes sign(v) * tau where |v| > t, else sign(v) * 0, with t
    the truncation to fmt of U * tau and U = (h & 0x7fffff) / 2^23, one draw a pack of 8 columns:
        h = fmix32(fmix32(seed ^ PHI) + row0 + r) + pack * PHI   (uint32, PHI = 0x9e3779b9)
    (a Weyl sequence along each row from a hash of the seed and the row). For |v| < tau on fmt's
    grid, P(|v| > t) = |v| / tau: E[out] = v."""
    if fmt not in ("bf16", "f16"):
        raise ValueError(f"fmt: expected 'bf16' or 'f16', got {fmt!r}")
    v = np.asarray(v, dtype=np.float32)
    N, Vp = v.shape
    n_packs = Vp // 8
    tau32 = np.float32(tau)
    with np.errstate(over="ignore"):
        phi = np.uint32(0x9E3779B9)
        base = fmix32(np.uint32(seed) ^ phi)
        rowkey = fmix32(base + np.uint32(row0) + np.arange(N, dtype=np.uint32))
        h = rowkey[:, None] + np.arange(n_packs, dtype=np.uint32)[None, :] * phi
    u = ((h & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)).view(np.float32)
    t = u * tau32 - tau32                                   # exact: tau is a power of two
    if fmt == "bf16":
        t = (t.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    else:
        t = _f16_toward_zero(t)
    t = np.repeat(t, 8, axis=1)
    a = np.abs(v)
    with np.errstate(invalid="ignore"):
        keep = ~(a <= t)                                    # NaN: kept
        out = np.where(keep, np.where(np.isnan(a), a, np.maximum(a, tau32)), np.float32(0.0))
    return np.copysign(out, v).astype(np.float32)


def sparse_fp8_values(dlogits, scale: float) -> np.ndarray:
    """What the FP8 kernel thins (sparse_tau with dlogits8): f16(dlogits * scale), as float32 --
    rounded once from the float64 dlogits (the kernel's fp32 softmax is within ~1e-6 of them)."""
    return (np.asarray(dlogits, np.float64) * float(scale)).astype(np.float16).astype(np.float32)


def _check_sparse(sparse_tau, sparse_seed, sparse_row0, logits, dlogits8, dlogits8_scale, write_dlogits, xp):
    """sparse_tau: 0 (off) or a power of two on the written dlogits; the rest only when it is on."""
    if isinstance(sparse_tau, bool) or not isinstance(sparse_tau, numbers.Real) or not sparse_tau >= 0:
        raise ValueError(f"sparse_tau: expected a float >= 0, got {sparse_tau!r}")
    if sparse_seed is not None or sparse_tau:    # given (the model always passes its own), or needed
        check_array("sparse_seed", sparse_seed, dtypes_=(np.dtype(np.uint32),), shape=(1,))
        if runtime.array_module(sparse_seed) is not xp:
            raise TypeError("sparse_seed: must be on the logits' device")
    if sparse_tau == 0:
        return False
    if np.frexp(float(sparse_tau))[0] != 0.5:
        raise ValueError(f"sparse_tau: expected a power of two, got {sparse_tau!r}")
    if logits.dtype != dtypes.bfloat16:
        raise TypeError(f"sparse_tau: thins bf16 dlogits, got {dtypes.name(logits.dtype)} logits")
    if dlogits8 is not None:
        if write_dlogits:
            raise ValueError("sparse_tau with dlogits8: thins the E5M2 dlogits only: needs write_dlogits=False")
        if not 2.0 ** -14 <= sparse_tau <= 57344.0:
            raise ValueError(f"sparse_tau: with dlogits8, a power of two in [2^-14, 57344] (exact in E5M2), "
                             f"got {sparse_tau!r}")
        if np.frexp(float(dlogits8_scale))[0] != 0.5:
            raise ValueError(f"sparse_tau: needs a power-of-two dlogits8_scale, got {dlogits8_scale!r}")
    elif not 2.0 ** -126 <= sparse_tau <= 2.0 ** 127:
        raise ValueError(f"sparse_tau: a normal bf16 power of two, got {sparse_tau!r}")
    if isinstance(sparse_row0, bool) or not isinstance(sparse_row0, numbers.Integral) or sparse_row0 < 0:
        raise ValueError(f"sparse_row0: expected an int >= 0, got {sparse_row0!r}")
    return True


@profiler.profiled("classifier (fused)", nbytes=profiler.io_bytes)
def fused_classifier(logits, targets, vocab_size=None, grad_scale=None, losses=None, version=None, *,
                     check_targets=True, dlogits8=None, dlogits8_scale=None, write_dlogits=True,
                     sparse_tau=0.0, sparse_seed=None, sparse_row0=0):
    """Per-token losses (float32, targets' shape); logits are overwritten with dlogits.

    logits (N, Vp) or (B, T, Vp), float32 or bfloat16; targets int32 of logits.shape[:-1],
    each in [0, vocab_size) or -1 (ignored: loss 0, zero gradient row). vocab_size defaults
    to Vp; columns [vocab_size, Vp) are padding and get gradient 0. grad_scale defaults to
    1 / (number of non-ignored targets), the gradient of the mean loss.
    check_targets=False (GPU): skip the range check and its host synchronisation when the
    ids are known to be valid; ignored when grad_scale is None (the count needs the check).
    dlogits8 (N, Vp) uint8, optional (bf16 logits): also dlogits' E5M2 bytes, scaled by
    dlogits8_scale (a host float; dlogits_fp8_scale(grad_scale) never saturates).
    write_dlogits=False (with dlogits8): only the E5M2 bytes are wanted; the logits are then left
    as they were where the fused FP8 kernel runs (v3, and NumPy), and hold dlogits elsewhere --
    their contents are not part of the result.
    sparse_tau > 0 (bf16 logits; a power of two): the written dlogits below sparse_tau are thinned
    without bias -- each becomes +-sparse_tau or 0 with the probabilities that keep its expectation
    (sparse_dlogits_reference), drawn from a hash of sparse_seed ((1,) uint32 on the logits' device,
    read by the kernel: a new value each step), the row (sparse_row0 + r) and the column. Either the
    bf16 dlogits (no dlogits8) or, with dlogits8 and write_dlogits=False (a power-of-two
    dlogits8_scale), the E5M2 ones, thinned on the scaled values rounded to f16 (sparse_fp8_values:
    E5M2 is f16's top byte; the kernel converts each f16 pair in one instruction). On the GPU
    it runs in the v3 kernels (rows with non-finite values are left dense, where it changes nothing
    but NaN payloads). Why: the LM head's GEMMs draw less power on zeros (tools/notes/fp8.md).
    """
    xp, V, Vp, losses = _check_args(logits, targets, vocab_size, losses)
    if dlogits8 is not None:
        _check_fp8_out(logits, dlogits8, dlogits8_scale, xp)
    elif not write_dlogits:
        raise ValueError("write_dlogits=False: needs dlogits8 (the only output left)")
    sparse = _check_sparse(sparse_tau, sparse_seed, sparse_row0, logits, dlogits8, dlogits8_scale, write_dlogits,
                           xp)
    if xp is not np:
        version = pick_version(version, logits, Vp)     # once; a bad version fails before the sync below
        if sparse and version != 3:
            raise ValueError("sparse_tau: runs in the v3 kernels only (bf16 rows that fit their shared memory)")
    if grad_scale is not None and (isinstance(grad_scale, bool) or not isinstance(grad_scale, numbers.Real)):
        raise TypeError(f"grad_scale: expected a float, got {type(grad_scale).__name__}")
    if check_targets or grad_scale is None or xp is np:
        count = _check_targets(targets, xp, V)
    if grad_scale is None:
        grad_scale = 1.0 / max(count, 1)
    if xp is np:
        ref_losses, exact = classifier_reference(logits, targets, V, grad_scale)
        losses[...] = ref_losses
        dlogits = exact.astype(logits.dtype)
        if sparse and dlogits8 is None:   # the bf16 dlogits thinned
            dlogits = sparse_dlogits_reference(dlogits.reshape(-1, Vp).astype(np.float32), sparse_tau,
                                               int(sparse_seed[0]), sparse_row0).astype(logits.dtype).reshape(
                                                   logits.shape)
        if write_dlogits:
            logits[...] = dlogits
    elif dlogits8 is not None and version == 3:
        return launch_fused_fp8(logits, targets, losses, V, float(grad_scale), dlogits8, float(dlogits8_scale),
                                 write_dlogits, sparse_tau if sparse else 0.0, sparse_seed, sparse_row0)
    else:
        launch_fused(logits, targets, losses, V, float(grad_scale), version, sparse_tau if sparse else 0.0,
                     sparse_seed, sparse_row0)
        dlogits = logits
    if dlogits8 is not None and sparse:   # NumPy only (checked above): the scaled f16 values thinned, cast
        from .fp8 import fp8_quantize_reference
        thin = sparse_dlogits_reference(sparse_fp8_values(exact.reshape(-1, Vp), dlogits8_scale), sparse_tau,
                                        int(sparse_seed[0]), sparse_row0, fmt="f16")
        dlogits8.reshape(-1, Vp)[...] = fp8_quantize_reference(thin, "e5m2", 1.0)
    elif dlogits8 is not None:            # the general path: the bf16 dlogits, then their cast
        from .fp8 import fp8_quantize
        fp8_quantize(dlogits.reshape(-1, Vp), "e5m2", xp.full(1, dlogits8_scale, np.float32),
                     out=dlogits8.reshape(-1, Vp))
    return losses


def _check_fp8_out(logits, dlogits8, scale, xp):
    if logits.dtype != dtypes.bfloat16:
        raise TypeError(f"dlogits8: needs bfloat16 logits, got {dtypes.name(logits.dtype)}")
    check_array("dlogits8", dlogits8, dtypes_=(np.dtype(np.uint8),), shape=logits.shape)
    if runtime.array_module(dlogits8) is not xp:
        raise TypeError("dlogits8: must be on the logits' device")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not scale > 0:
        raise ValueError(f"dlogits8_scale: expected a float > 0, got {scale!r}")


def launch_fused_fp8(logits, targets, losses, V, grad_scale, dlogits8, scale, write_dlogits=True,
                     sparse_tau=0.0, sparse_seed=None, sparse_row0=0):
    """v3's FP8 kernel alone, on checked CuPy arrays (bf16 logits whose rows v3 takes, no target
    check): what fused_classifier runs for dlogits8, and what the benchmark times."""
    Vp = logits.shape[-1]
    N = targets.size
    if N == 0:
        return losses
    n_packs = Vp // 8
    kernel = runtime.get_kernel("classifier", f"classifier_backward_fp8_kernel_v3_k{_v3_k(n_packs)}_bf16")
    _launch_v3(kernel, v3_fp8_grid(kernel, N, n_packs), n_packs,
               (losses, logits, dlogits8, targets, np.float32(grad_scale), np.float32(scale), np.int32(N),
                np.int32(V), np.int32(Vp), np.int32(bool(write_dlogits)), np.float32(sparse_tau),
                _seed_arg(sparse_seed), np.int32(sparse_row0)))
    return losses


def cross_entropy(logits, targets, vocab_size=None, losses=None, *, check_targets=True):
    """Per-token losses lse(logits[..., :V]) - logits[..., target] (float32; 0 where target == -1).

    The logits are only read. Same arguments and checks as fused_classifier.
    """
    xp, V, Vp, losses = _check_args(logits, targets, vocab_size, losses)
    if check_targets or xp is np:
        _check_targets(targets, xp, V)
    if xp is np:
        losses[...] = cross_entropy_reference(logits, targets, V)
        return losses
    N = targets.size
    if N == 0:
        return losses
    if pick_version(None, logits, Vp) == 3:          # v3's kernel without its write pass
        n_packs = Vp // (16 // logits.dtype.itemsize)
        kernel = runtime.get_kernel(
            "classifier", f"classifier_forward_kernel_v3_k{_v3_k(n_packs)}_{dtypes.kernel_suffix(logits.dtype)}")
        _launch_v3(kernel, N, n_packs, (losses, logits, targets, np.int32(N), np.int32(V), np.int32(Vp)))
        return losses
    block = CLS_BLOCK if Vp >= 8192 else FORWARD_BLOCK_SHORT
    kernel = runtime.get_kernel("classifier", f"classifier_forward_kernel_{dtypes.kernel_suffix(logits.dtype)}")
    runtime.launch(kernel, N, block, (losses, logits, targets, np.int32(N), np.int32(V), np.int32(Vp)))
    return losses
