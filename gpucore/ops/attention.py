"""Causal multi-head attention over GPT-2's fused qkv activation, forward and backward.

    attention_forward(qkv (B, T, 3C), num_heads) -> out (B, T, C), lse (B, NH, T) fp32
    attention_backward(dout, qkv, out, lse, num_heads) -> dqkv (B, T, 3C)   [=]
    attention(q, k, v, causal=True) with (B, NH, T, hd) arrays -> (B, NH, T, hd)

Layout: q = qkv[..., :C], k = qkv[..., C:2C], v = qkv[..., 2C:]; head h is
columns h*hd:(h+1)*hd of each; scale 1/sqrt(hd). lse_i = log sum_{j<=i}
exp(scale q_i.k_j) is what the flash backward needs to recompute the softmax.

The production path (version=None), picked per call by `pick_version`:
  3  bf16, head dim 64 or 128, 16-byte aligned arrays, an sm_90 GPU, and the setting
     attention_v3_forward / attention_v3_backward on (default):
       forward   kernels_cu/attention/flash_v3_fwd.cu: FlashAttention-3-style on Hopper wgmma,
                 pipelined (S of KV tile j+1 in flight during tile j's softmax), config
                 V3_FWD_CONFIG[hd] (compiled for sm_90a). With out8 / out8_t (--dtype fp8: the
                 attention projection's E4M3 input) its F8 kernel (hd 64) writes those bytes too.
       backward  kernels_cu/attention/flash_v3_bwd.cu: v2's deterministic two passes on wgmma --
                 D = rowsum(dout * out) by v2's preprocess (attention/flash_bwd.cu), then the dK/dV
                 pass (V3_DKDV_CONFIG[hd]; at hd 64 the register-A kernel, V3_RA) and the dQ pass
                 (V3_DQ_CONFIG[hd]) on a side stream beside it (setting attention_v3_streams).
                 Or, at hd 64 where its blocks fill the SMs' waves (settings.attention_v3_onepass,
                 onepass_batches), kernels_cu/attention/flash_v3_bwd1.cu: ONE pass, a block per
                 (batch, head) summing dQ over the KV tiles in order (backward_v3_onepass); where
                 only the heads of the first B' batch elements fill them, those take it and the
                 rest the two passes, beside it on a side stream (backward_v3_split).
     Both walk the heads in groups of settings.attention_head_group (block order, compiled in
     with -DV3_HEAD_GROUP).
  2  elsewhere, same conditions but any GPU (or v3 switched off): FlashAttention-2 on mma.sync,
     kernels_cu/attention/flash_fwd.cu (V2_FWD_CONFIG[hd]) and flash_bwd.cu (preprocess,
     dK/dV pass V2_DKDV_CONFIG[hd], dQ pass V2_DQ_CONFIG[hd]). Online softmax, only lse saved;
     reads qkv and writes out/dqkv in place; scratch O(B*NH*T) (D, backward only).
  1  the general fallback: float32, any other head dim, misaligned views. llm.c's classic
     attention (kernels_cu/attention/classic.cu): permute qkv to (3, B*NH, T, hd), cuBLAS
     batched Q K^T into a float32 (B, NH, T, T) score matrix, causal softmax kernel, cuBLAS
     batched P V, unpermute; the backward recomputes the scores and stores dP as well:
     O(B*NH*T^2) scratch.
version=1/2/3 asks for one version; asking for 2 or 3 where it does not apply raises
(TypeError for the dtype, ValueError otherwise) instead of falling back. out/lse of v2 and v3
have the same layout, so either backward runs on either forward's results.

`forward_v2` / `backward_v2` / `forward_v3` / `backward_v3` launch one version with an explicit
tile config (default: the tables below), for the kernel ladder and `gpucore bench attention
--opt sweep=1`. The ladder -- the non-pipelined v3 forward (kernels_cu/ladder/attention/
flash_v3_fwd_serial.cu), every non-default config and the fused-D dQ pass -- lives in
gpucore/ladder/attention.py; this module never imports it. Instantiations in the production
.cu files that only the ladder launches:
  attention/flash_fwd.cu     FLASH_FWD (64,4,2,64) (64,4,1,64) (64,8,1,128) (128,4,1,64) (128,8,1,32)
  attention/flash_bwd.cu     FLASH_BWD_DKDV and FLASH_BWD_DQ (64,8,64) (64,4,32) (128,8,32)
  attention/flash_v3_fwd.cu  FLASH_FWD_V3P (64,2,64,4) (64,2,128,3)
  attention/flash_v3_bwd.cu  FLASH_V3_DKDV (64,2,64) (64,1,64), FLASH_V3_DKDV_RA (64,1,64),
                             FLASH_V3_DQ (64,2,64) (64,1,64) (128,1,64), FLASH_V3_DQ_RA (64,2,64)
                             (64,1,64), every FLASH_V3_DQF (fused D)

NumPy inputs run the float64 reference (the result rounded to the input dtype).
The reference backward recomputes everything from qkv; `out` and `lse` are only
checked. Every version is deterministic: same input, same bits.
"""
from __future__ import annotations

import math

import numpy as np

from .. import dtypes, runtime, settings
from .. import profiler
from ._common import check_array, check_same_dtype, output
from .colsum import colsum, colsum_chunks, colsum_partials, colsum_reference, reduce_partials
from .fp8 import check_cast_args, fp8_amax, fp8_quantize
from .matmul import batched_matmul

F32, BF16 = dtypes.float32, dtypes.bfloat16
VERSIONS = (1, 2, 3)
PREPROCESS_BLOCK = 256
V1_SOFTMAX_BLOCK = 256     # 8 warps = 8 rows per block
V1_PERMUTE_BLOCK = 256

# Default tile configs per head dim (the measured best; tools/notes/attention.md). The kernels
# must be instantiated in the .cu files (tests/test_attention.py checks); the other
# instantiations are gpucore/ladder/attention.py's tables.
# v2 forward: (warps per block, m16 tiles per warp, keys per KV tile); Q tile = 16 * tiles * warps rows
V2_FWD_CONFIG = {64: (8, 1, 64), 128: (8, 1, 64)}
# v2 backward dK/dV pass: (warps, Q-tile rows); KV tile = 16 * warps keys
V2_DKDV_CONFIG = {64: (4, 64), 128: (4, 32)}
# v2 backward dQ pass: (warps, keys per KV tile); Q tile = 16 * warps rows
V2_DQ_CONFIG = {64: (4, 64), 128: (4, 32)}

V3_ARCH = "90a"            # v3 kernels compile for sm_90a and run on sm_90 devices only
# v3 forward (pipelined): (consumer warpgroups, keys per KV tile, K/V ring stages);
# Q tile = 64 * warpgroups rows. H200, B=64 NH=12 T=1024 hd=64: 303-311 TFLOP/s.
V3_FWD_CONFIG = {64: (2, 64, 3), 128: (2, 64, 3)}
# v3 backward configs: (warpgroups, tile[, variant]). dK/dV pass: tile = Q-tile rows, KV tile =
# 64 * warpgroups keys; dQ pass: tile = keys per KV tile, Q tile = 64 * warpgroups rows.
# Variant V3_RA ("register A", kernel names ..._ra_bf16, BM/BN 64 at hd 64 only): the pass holds
# its warpgroup's fixed operand (K and V in dK/dV, Q and dout in dQ) as wgmma register
# fragments, so its two N = 64 products read only B from shared memory.
# H100 hd 64 (2026-11-22): dkdv (2,64,RA) 203.9 TFLOP/s vs (2,64) 201.3; H200: dq (2,128) best.
V3_RA = 2
V3_VARIANT_SUFFIX = {0: "", V3_RA: "_ra"}
V3_DKDV_CONFIG = {64: (2, 64, V3_RA), 128: (2, 64)}
V3_DQ_CONFIG = {64: (2, 128), 128: (2, 64)}


def v2_fwd_smem(hd, warps, mt, bn):
    """Dynamic shared memory (bytes) of a v2 forward block."""
    return (16 * mt * warps + 4 * bn) * (hd + 8) * 2


def v2_dkdv_smem(hd, warps, bm):
    return (32 * warps + 4 * bm) * (hd + 8) * 2 + 16 * bm


def v2_dq_smem(hd, warps, bn):
    return (32 * warps + 4 * bn) * (hd + 8) * 2


def v3_fwd_smem(hd, wgs, bn, stages):
    """Dynamic shared memory of a v3 forward block: Q tile + `stages` K/V tiles (the serial
    ladder kernel double-buffers: stages=2), + 1024 for the 128-byte-swizzle alignment."""
    return 1024 + (64 * wgs + 2 * stages * bn) * hd * 2


def v3_stages(hd):
    """Q/dO (dK/dV pass) and K/V (dQ pass) ring stages: 3 at hd 64, where the dK / dQ wgmma
    group of one tile runs on into the next (the kernels static_assert the same rule), else 2."""
    return 3 if hd == 64 else 2


def v3_dkdv_smem(hd, wgs, bm):
    st = v3_stages(hd)
    return 1024 + (2 * 64 * wgs + 2 * st * bm) * hd * 2 + 8 * st * bm


def v3_dq_smem(hd, wgs, bn):
    return 1024 + (2 * 64 * wgs + 2 * v3_stages(hd) * bn) * hd * 2


def v3_variant(cfg):
    """The variant element of a v3 backward config (0: plain kernel)."""
    return cfg[2] if len(cfg) > 2 else 0


def v3_compile_options():
    """NVRTC options of every v3 kernel: the block order's head group (settings.attention_head_group)."""
    return (f"-DV3_HEAD_GROUP={int(settings.current().attention_head_group)}",)


# ----------------------------------------------------------------- checks ----

def _check_qkv(qkv, num_heads):
    """(B, T, C, NH, hd) of a valid qkv (B, T, 3C) and num_heads."""
    check_array("qkv", qkv, ndim=3)
    return _dims(qkv, num_heads)


def _dims(qkv, num_heads):
    """Shape checks only (the references also take float64)."""
    if qkv.ndim != 3:
        raise ValueError(f"qkv: expected 3 dimensions, got shape {tuple(qkv.shape)}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads: expected a positive int, got {num_heads!r}")
    B, T, C3 = qkv.shape
    if C3 % 3:
        raise ValueError(f"qkv: last dimension must be 3*C (q, k, v), got {C3}")
    C = C3 // 3
    if C == 0 or C % num_heads:
        raise ValueError(f"num_heads: {num_heads} does not divide C = {C}")
    return B, T, C, int(num_heads), C // num_heads


def _check_version(version):
    if version is not None and version not in VERSIONS:
        raise ValueError(f"version: must be one of {VERSIONS} or None, got {version!r}")


def _misaligned(arrays):
    """The name of the first (name, GPU array) pair not 16-byte aligned, or None."""
    return next((name for name, a in arrays if a.data.ptr % 16), None)


def _reason(version, what, dtype, hd, arch, misaligned) -> str | None:
    """None if `version` (2 or 3) of attention_`what` ("forward"/"backward") runs here, else why not."""
    name = "version 2" if version == 2 else f"version 3 {what}"
    head_dims = V2_FWD_CONFIG if version == 2 else V3_FWD_CONFIG if what == "forward" else V3_DKDV_CONFIG
    if dtype != BF16:
        return f"{name} takes bfloat16, got {dtypes.name(dtype)}" + (" (float32 runs version 1)" if version == 2 else "")
    if hd not in head_dims:
        return f"{name} supports head dims {sorted(head_dims)}, got {hd}"
    if misaligned is not None:
        return f"{misaligned}: {name} needs 16-byte aligned arrays"
    if version == 3 and arch != V3_ARCH[:-1]:
        return f"{name} needs an sm_{V3_ARCH[:-1]} GPU (wgmma), this one is sm_{arch}"
    return None


def pick_version(what, version, dtype, hd, arch, misaligned=None) -> int:
    """The version a GPU call of attention_`what` ("forward" or "backward") runs. Pure: no GPU needed.

    version: the caller's (None = the production path of the module docstring, read from
    settings.current(): attention_v3_forward / attention_v3_backward); dtype and hd: the
    inputs'; arch: the device's compute capability digits ("90"); misaligned: the name of
    the first array not 16-byte aligned (None: all are). Asking for 2 or 3 where it does not
    apply raises TypeError (dtype) or ValueError (anything else).
    """
    if what not in ("forward", "backward"):
        raise ValueError(f"what: 'forward' or 'backward', got {what!r}")
    _check_version(version)
    s = settings.current()
    if version == 3 or (version is None and (s.attention_v3_forward if what == "forward"
                                             else s.attention_v3_backward)):
        reason = _reason(3, what, dtype, hd, arch, misaligned)
        if reason is None:
            return 3
        if version == 3:
            raise (TypeError if "takes bfloat16" in reason else ValueError)(reason)
    reason = _reason(2, what, dtype, hd, arch, misaligned)
    if version is None:
        return 1 if reason else 2
    if version == 2 and reason:
        raise (TypeError if "takes bfloat16" in reason else ValueError)(reason)
    return version


# -------------------------------------------------------------- reference ----

def _heads(x, B, T, S, NH, hd):
    """(B, T, S*C) -> S arrays (B, NH, T, hd) in float64."""
    x = np.asarray(x, dtype=np.float64).reshape(B, T, S, NH, hd).transpose(2, 0, 3, 1, 4)
    return [x[s] for s in range(S)]


def _merge(parts, B, T, C):
    """S arrays (B, NH, T, hd) -> (B, T, S*C)."""
    return np.stack(parts, axis=2).transpose(0, 3, 2, 1, 4).reshape(B, T, len(parts) * C)


def _probs(q, k, causal=True):
    """softmax(scale q k^T) (B, NH, T, T) and lse (B, NH, T), float64."""
    T = q.shape[-2]
    s = (q @ k.swapaxes(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    return e / l, (m + np.log(l))[..., 0]


def attention_forward_reference(qkv, num_heads, causal=True):
    """(out (B, T, C) float64, lse (B, NH, T) float64) of the causal attention over qkv."""
    B, T, C, NH, hd = _dims(qkv, num_heads)
    q, k, v = _heads(qkv, B, T, 3, NH, hd)
    p, lse = _probs(q, k, causal)
    return _merge([p @ v], B, T, C), lse


def attention_backward_reference(dout, qkv, num_heads, causal=True):
    """dqkv (B, T, 3C) float64: the gradient of sum(attention_forward(qkv) * dout)."""
    B, T, C, NH, hd = _dims(qkv, num_heads)
    q, k, v = _heads(qkv, B, T, 3, NH, hd)
    (dy,) = _heads(dout, B, T, 1, NH, hd)
    p, _ = _probs(q, k, causal)
    dv = p.swapaxes(-1, -2) @ dy
    dp = dy @ v.swapaxes(-1, -2)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    scale = 1.0 / math.sqrt(hd)
    dq = scale * (ds @ k)
    dk = scale * (ds.swapaxes(-1, -2) @ q)
    return _merge([dq, dk, dv], B, T, C)


# -------------------------------------------------------------- version 1 ----

def _permute_launch(name, out, x, S, B, T, NH, hd, stride, offset):
    n = S * B * NH * T * hd
    if n == 0:
        return
    k = runtime.get_kernel("attention/classic", f"attention_{name}_kernel_v1_{dtypes.kernel_suffix(x.dtype)}")
    grid = min(-(-n // V1_PERMUTE_BLOCK), runtime.sm_count() * 32)
    runtime.launch(k, grid, V1_PERMUTE_BLOCK, (out, x, np.int32(S), np.int32(B), np.int32(T), np.int32(NH),
                                               np.int32(hd), np.int32(stride), np.int32(offset)))


def _permute(out, x, S, B, T, NH, hd, stride, offset=0):
    """out (S, B*NH, T, hd) <- x (B, T, stride) at columns offset + s*C + h*hd."""
    _permute_launch("permute", out, x, S, B, T, NH, hd, stride, offset)


def _unpermute(out, x, S, B, T, NH, hd, stride, offset=0):
    """out (B, T, stride) at columns offset + s*C + h*hd <- x (S, B*NH, T, hd)."""
    _permute_launch("unpermute", out, x, S, B, T, NH, hd, stride, offset)


def _softmax_launch(name, args, rows):
    k = runtime.get_kernel("attention/classic", name)
    runtime.launch(k, -(-rows // (V1_SOFTMAX_BLOCK // 32)), V1_SOFTMAX_BLOCK, args)


def _scores(qkvp, dtype, T, hd, causal, lse):
    """att (B*NH, T, T) of qkv's dtype from permuted q, k; also returns the float32 score buffer."""
    cp = runtime.cupy
    BNH = qkvp.shape[1]
    preatt = cp.empty((BNH, T, T), dtype=F32)
    batched_matmul(qkvp[0], qkvp[1], out=preatt, transpose_b=True, alpha=1.0 / math.sqrt(hd))
    att = preatt if dtype == F32 else cp.empty((BNH, T, T), dtype=dtype)   # fp32: in place
    _softmax_launch(f"attention_softmax_forward_kernel_v1_{dtypes.kernel_suffix(dtype)}",
                    (att, lse, preatt, np.int32(BNH * T), np.int32(T), np.int32(causal)), BNH * T)
    return att, preatt


def _forward_v1(qkv, NH, out, lse, causal=True):
    cp = runtime.cupy
    B, T, C3 = qkv.shape
    C = C3 // 3
    hd = C // NH
    qkvp = cp.empty((3, B * NH, T, hd), dtype=qkv.dtype)
    _permute(qkvp, qkv, 3, B, T, NH, hd, C3)
    att, _ = _scores(qkvp, qkv.dtype, T, hd, causal, lse)
    y = cp.empty((1, B * NH, T, hd), dtype=qkv.dtype)
    batched_matmul(att, qkvp[2], out=y[0])
    _unpermute(out, y, 1, B, T, NH, hd, C)


def _backward_v1(dout, qkv, NH, dqkv, causal=True):
    cp = runtime.cupy
    B, T, C3 = qkv.shape
    C = C3 // 3
    hd = C // NH
    scale = 1.0 / math.sqrt(hd)
    qkvp = cp.empty((3, B * NH, T, hd), dtype=qkv.dtype)
    _permute(qkvp, qkv, 3, B, T, NH, hd, C3)
    dy = cp.empty((1, B * NH, T, hd), dtype=qkv.dtype)
    _permute(dy, dout, 1, B, T, NH, hd, C)
    # Recompute the probabilities with the forward's kernel (same bits); its lse goes to scratch.
    att, preatt = _scores(qkvp, qkv.dtype, T, hd, causal, cp.empty((B * NH * T,), dtype=F32))
    datt = preatt if qkv.dtype != F32 else cp.empty_like(preatt)   # bf16: the score buffer is free again
    batched_matmul(dy[0], qkvp[2], out=datt, transpose_b=True)     # dP = dO V^T
    dqkvp = cp.empty((3, B * NH, T, hd), dtype=qkv.dtype)
    batched_matmul(att, dy[0], out=dqkvp[2], transpose_a=True)     # dV = P^T dO
    # dS = P (dP - rowsum(P dP)), written over P (same element, same thread)
    _softmax_launch(f"attention_softmax_backward_kernel_v1_{dtypes.kernel_suffix(qkv.dtype)}",
                    (att, att, datt, np.int32(B * NH * T), np.int32(T), np.int32(causal)), B * NH * T)
    batched_matmul(att, qkvp[1], out=dqkvp[0], alpha=scale)                     # dQ = scale dS K
    batched_matmul(att, qkvp[0], out=dqkvp[1], transpose_a=True, alpha=scale)   # dK = scale dS^T Q
    _unpermute(dqkv, dqkvp, 3, B, T, NH, hd, C3)


# -------------------------------------------------------------- version 2 ----
# The launchers below take arrays attention_forward / attention_backward have checked
# (bf16 GPU arrays, hd 64 or 128, 16-byte aligned; v3: an sm_90 device) and launch on the
# current stream; the ladder and the benchmarks call them with explicit configs.

def forward_v2(qkv, NH, out, lse, config=None):
    """v2 flash forward (attention/flash_fwd.cu) with `config` (warps, m16 tiles per warp, BN),
    default V2_FWD_CONFIG[hd]; grid (B*NH, Q tiles of 16 * tiles * warps rows)."""
    B, T, C3 = qkv.shape
    hd = C3 // 3 // NH
    warps, mt, bn = config or V2_FWD_CONFIG[hd]
    k = runtime.get_kernel("attention/flash_fwd", f"attention_forward_kernel_v2_hd{hd}_w{warps}_mt{mt}_n{bn}_bf16")
    runtime.launch(k, (B * NH, -(-T // (16 * mt * warps))), 32 * warps,
                   (out, lse, qkv, np.int32(T), np.int32(NH), np.float32(1.0 / math.sqrt(hd))),
                   shared_mem=v2_fwd_smem(hd, warps, mt, bn))


def _preprocess(dout, out, NH):
    """D = rowsum(dout * out) (B, NH, T) float32 (attention/flash_bwd.cu; v2 and v3 backward)."""
    cp = runtime.cupy
    B, T, C = out.shape
    hd = C // NH
    D = cp.empty((B, NH, T), dtype=F32)
    rows = B * T * NH
    k = runtime.get_kernel("attention/flash_bwd", f"attention_backward_preprocess_kernel_v2_hd{hd}_bf16")
    runtime.launch(k, -(-rows * (hd // 8) // PREPROCESS_BLOCK), PREPROCESS_BLOCK,
                   (D, dout, out, np.int32(rows), np.int32(T), np.int32(NH)))
    return D


def backward_v2(dout, qkv, out, lse, NH, dqkv, dkdv_config=None, dq_config=None):
    """v2 flash backward (attention/flash_bwd.cu): preprocess, dK/dV pass with `dkdv_config`
    (warps, BM), dQ pass with `dq_config` (warps, BN); defaults V2_DKDV_CONFIG / V2_DQ_CONFIG."""
    B, T, C3 = qkv.shape
    hd = C3 // 3 // NH
    kv_warps, bm = dkdv_config or V2_DKDV_CONFIG[hd]
    q_warps, bn = dq_config or V2_DQ_CONFIG[hd]
    D = _preprocess(dout, out, NH)
    args = (dqkv, qkv, dout, lse, D, np.int32(T), np.int32(NH), np.float32(1.0 / math.sqrt(hd)))
    k1 = runtime.get_kernel("attention/flash_bwd", f"attention_backward_dkdv_kernel_v2_hd{hd}_w{kv_warps}_m{bm}_bf16")
    runtime.launch(k1, (B * NH, -(-T // (16 * kv_warps))), 32 * kv_warps, args,
                   shared_mem=v2_dkdv_smem(hd, kv_warps, bm))
    k2 = runtime.get_kernel("attention/flash_bwd", f"attention_backward_dq_kernel_v2_hd{hd}_w{q_warps}_n{bn}_bf16")
    runtime.launch(k2, (B * NH, -(-T // (16 * q_warps))), 32 * q_warps, args,
                   shared_mem=v2_dq_smem(hd, q_warps, bn))


# -------------------------------------------------------------- version 3 ----

def forward_v3(qkv, NH, out, lse, config=None, f8=None):
    """v3 pipelined wgmma forward (attention/flash_v3_fwd.cu) with `config` (warpgroups, BN,
    K/V stages), default V3_FWD_CONFIG[hd]; grid (B*NH, Q tiles of 64 * warpgroups rows).
    Writes out and lse exactly as v2 does. f8 (out8, out8_t, amax8, scale8), optional (the
    default config at hd 64 only: fused_fp8_output): the F8 kernel also writes out's E4M3 bytes."""
    B, T, C3 = qkv.shape
    hd = C3 // 3 // NH
    config = config or V3_FWD_CONFIG[hd]
    if len(config) != 3:
        raise ValueError(f"config: (warpgroups, BN, stages) of attention/flash_v3_fwd.cu, got {config!r} "
                         "(the non-pipelined kernels are gpucore.ladder.attention.forward_v3_serial)")
    wgs, bn, stages = config
    kind = "forward_f8" if f8 is not None else "forward"
    k = runtime.get_kernel("attention/flash_v3_fwd", f"attention_{kind}_kernel_v3_hd{hd}_g{wgs}_n{bn}_s{stages}_bf16",
                           options=v3_compile_options(), arch=V3_ARCH)
    args = (out, lse, qkv, np.int32(T), np.int32(NH), np.float32(1.0 / math.sqrt(hd)))
    if f8 is not None:
        args += tuple(np.uint64(0) if a is None else a for a in f8)
    runtime.launch(k, (B * NH, -(-T // (64 * wgs))), 128 * wgs, args, shared_mem=v3_fwd_smem(hd, wgs, bn, stages))


def fused_fp8_output(hd: int, T: int) -> bool:
    """Can the v3 forward write its output's E4M3 bytes itself (attention_forward_f8_kernel: the
    production config at hd 64, whole 4-row blocks of tokens)?"""
    return hd == 64 and T % 4 == 0


def _v3_bwd_kernel(pass_, hd, config):
    """The attention/flash_v3_bwd.cu kernel of `pass_` ("dkdv" or "dq") for a config
    (warpgroups, tile[, V3_RA])."""
    variant = v3_variant(config)
    if variant not in V3_VARIANT_SUFFIX:
        raise ValueError(f"{pass_} config {config!r}: variant {variant} is not a kernel of the production backward "
                         "(the fused-D dQ pass is gpucore.ladder.attention.backward_v3)")
    tile = "m" if pass_ == "dkdv" else "n"
    name = f"attention_backward_{pass_}_kernel_v3_hd{hd}_g{config[0]}_{tile}{config[1]}{V3_VARIANT_SUFFIX[variant]}_bf16"
    return runtime.get_kernel("attention/flash_v3_bwd", name, options=v3_compile_options(), arch=V3_ARCH)


def backward_v3_dkdv(dout, qkv, lse, D, NH, dqkv, config=None):
    """The v3 dK/dV pass alone (attention/flash_v3_bwd.cu), given D = rowsum(dout * out):
    writes the dk and dv columns of dqkv. `config` (warpgroups, BM[, V3_RA]), default
    V3_DKDV_CONFIG[hd]."""
    B, T, C3 = qkv.shape
    hd = C3 // 3 // NH
    config = config or V3_DKDV_CONFIG[hd]
    wgs, bm = config[:2]
    runtime.launch(_v3_bwd_kernel("dkdv", hd, config), (B * NH, -(-T // (64 * wgs))), 128 * wgs,
                   (dqkv, qkv, dout, lse, D, np.int32(T), np.int32(NH), np.float32(1.0 / math.sqrt(hd))),
                   shared_mem=v3_dkdv_smem(hd, wgs, bm))


def backward_v3(dout, qkv, out, lse, NH, dqkv, dkdv_config=None, dq_config=None, streams=None, D=None):
    """v3 wgmma backward: v2's preprocess (D; or given), then the dK/dV pass (`dkdv_config`, default
    V3_DKDV_CONFIG[hd]) and the dQ pass (`dq_config` (warpgroups, BN[, V3_RA]), default
    V3_DQ_CONFIG[hd]).

    streams (None: settings.current().attention_v3_streams): the dQ pass runs on a side stream
    concurrently with the dK/dV pass on the caller's (both only read qkv/dout/lse/D and write
    disjoint column blocks of dqkv: the same bits either way), so each pass fills the idle SMs
    of the other's causal tail; the caller's stream waits for both. False: one stream,
    preprocess -> dK/dV -> dQ.
    """
    cp = runtime.cupy
    B, T, C3 = qkv.shape
    hd = C3 // 3 // NH
    dq_config = dq_config or V3_DQ_CONFIG[hd]
    q_wgs, bn = dq_config[:2]
    k2 = _v3_bwd_kernel("dq", hd, dq_config)
    streams = settings.current().attention_v3_streams if streams is None else streams
    D = _preprocess(dout, out, NH) if D is None else D
    args = (dqkv, qkv, dout, lse, D, np.int32(T), np.int32(NH), np.float32(1.0 / math.sqrt(hd)))
    q_grid, q_smem = (B * NH, -(-T // (64 * q_wgs))), v3_dq_smem(hd, q_wgs, bn)
    if not streams:
        backward_v3_dkdv(dout, qkv, lse, D, NH, dqkv, config=dkdv_config)
        runtime.launch(k2, q_grid, 128 * q_wgs, args, shared_mem=q_smem)
        return
    main = cp.cuda.get_current_stream()
    side, forked, joined = runtime.side_stream("attention dq")
    forked.record(main)          # inputs, D (preprocess) and dqkv's allocation are ready
    side.wait_event(forked)
    # dQ first in launch order on its own stream: its heaviest tiles start while the dK/dV
    # pass' blocks queue behind; each pass fills the other's causal tail.
    runtime.launch(k2, q_grid, 128 * q_wgs, args, shared_mem=q_smem, stream=side)
    backward_v3_dkdv(dout, qkv, lse, D, NH, dqkv, config=dkdv_config)
    joined.record(side)
    main.wait_event(joined)      # whatever the caller queues next (and D's release) sees dQ done


ONEPASS_HD = (64,)          # head dims of attention/flash_v3_bwd1.cu (the one-pass backward)
ONEPASS_WGS = (2,)          # its warpgroups per block (first = default): KV tiles of 64 * wgs keys
# settings.attention_v3_onepass "auto" gives the one-pass backward the heads of as many leading
# batch elements as keep its waves this full (one block per (batch, head), one per SM: a short last
# wave idles SMs for a head's whole time), and the other heads to the two-pass backward, run beside
# it on a side stream, whose small blocks fill that last wave. H200, T=1024 hd 64: per head the
# one-pass kernel costs ~0.78x the two-pass one at full waves, so it loses below ~78% fill (d48
# B=16 all one-pass, 400 heads over 132 SMs, 76%: x0.979 whole step; tools/notes/attention.md).
ONEPASS_MIN_WAVE_FILL = 0.9


def wave_fill(blocks, sms) -> float:
    """blocks / (the waves of `sms` blocks they take x sms)."""
    return blocks / (-(-blocks // sms) * sms) if blocks else 0.0


def onepass_batches(B, NH, hd, sms, mode=None) -> int:
    """How many leading batch elements' heads the v3 backward of a (B, NH, hd) call gives the
    one-pass kernel on a GPU of `sms` multiprocessors (the rest go to the two-pass kernels):
    mode (None: settings.attention_v3_onepass) "on": all B, "off": none, "auto": the most whose
    B' * NH blocks fill their waves to ONEPASS_MIN_WAVE_FILL (0 where none do)."""
    mode = settings.current().attention_v3_onepass if mode is None else mode
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"attention_v3_onepass: expected auto, on or off, got {mode!r}")
    if mode == "off" or hd not in ONEPASS_HD:
        return 0
    if mode == "on":
        return B
    return next((b for b in range(B, 0, -1) if wave_fill(b * NH, sms) >= ONEPASS_MIN_WAVE_FILL), 0)


# the _sums variant's running sums (per warp dK, dV; per warpgroup dQ) and a max |dqkv| word per thread
ONEPASS_SUMS_BYTES = 8 * 128 * 4 + 2 * 64 * 4 + 128 * max(ONEPASS_WGS) * 4


def v3_onepass_smem(hd, wgs):
    """Dynamic shared memory of a one-pass backward block: two K/V buffers (64 wgs x hd each; the
    next KV tile's copied in a tile ahead), 4 stages of Q and dO (64 x hd; copied two tiles ahead),
    two dS^T tiles (64 wgs x 64), all bf16; 3 staged dQ^T partial-sum tiles (hd x 64 f32); 4 x 64
    lse and D; + 1024 for the swizzle alignment."""
    return 1024 + (4 * wgs + 2 * 4 + 2 * wgs) * 64 * hd * 2 + 3 * hd * 64 * 4 + 2 * 4 * 64 * 4


def backward_v3_onepass(dout, qkv, out, lse, NH, dqkv, wgs=None, D=None, sums=None, amax=None):
    """v3 one-pass backward (attention/flash_v3_bwd1.cu, hd 64): v2's preprocess (D; or given),
    then one block per (batch, head) computing dK, dV and dQ together, dQ summed over the KV tiles
    in order in an f32 scratch (B*NH, ceil(T/64), hd, 64): 5 tile products per tile pair instead of
    the two-pass backward's 7, deterministic. wgs: warpgroups per block (ONEPASS_WGS).
    sums (B, 3C) float32, optional: row b = the column sums of dqkv[b] as written (the qkv bias
    gradient's stage 1, by the kernel's _sums variant: no pass over dqkv of its own).
    amax (1,) float32, optional (needs sums): amax = max(amax, max |dqkv|), taken by the same variant."""
    cp = runtime.cupy
    if amax is not None and sums is None:
        raise ValueError("amax: taken by the _sums variant; pass sums too")
    B, T, C3 = qkv.shape
    hd = C3 // 3 // NH
    if hd not in ONEPASS_HD:
        raise ValueError(f"qkv: the one-pass backward needs head dim in {ONEPASS_HD}, got {hd}")
    wgs = wgs or ONEPASS_WGS[0]
    if wgs not in ONEPASS_WGS:
        raise ValueError(f"wgs: {wgs} warpgroups per block; the kernels have {ONEPASS_WGS}")
    D = _preprocess(dout, out, NH) if D is None else D
    dqacc = cp.empty((B * NH, -(-T // 64), hd, 64), dtype=F32)      # per head, a tile per 64 queries
    name = f"attention_backward_onepass_kernel_v3_hd{hd}_g{wgs}_bf16" + ("_sums" if sums is not None else "")
    k = runtime.get_kernel("attention/flash_v3_bwd1", name, options=v3_compile_options(), arch=V3_ARCH)
    args = (dqkv, dqacc, qkv, dout, lse, D, np.int32(T), np.int32(NH), np.float32(1.0 / math.sqrt(hd)))
    smem = v3_onepass_smem(hd, wgs) + (ONEPASS_SUMS_BYTES if sums is not None else 0)
    runtime.launch(k, B * NH, 128 * wgs, args + ((sums, amax) if sums is not None else ()), shared_mem=smem)


def backward_v3_split(dout, qkv, out, lse, NH, dqkv, b1, dbias=None, amax=None):
    """The one-pass backward for batch elements [0, b1) on the caller's stream and the two-pass
    backward for [b1, B) beside it on a side stream (onepass_batches says why); D for all heads by
    one preprocess first, so that nothing is allocated on the side stream. Each head's bits are
    those of the kernel that took it, whatever runs beside it; the caller's stream waits for both.
    dbias (3C,), optional: += dqkv's column sums. The one-pass part's come from its _sums variant
    (a partial row per batch element), the two-pass part's from the column sum's stage 1 over its
    rows only, run on the side stream behind its backward; one stage 2 adds them all, in partial
    order (b1 rows, then the chunks). d48 B=16 splits 15 + 1: a pass over 1/16 of dqkv, not all of
    it (the whole pass was 43 us a layer, 2.1 ms a d48 step, H200). amax (1,), optional: max |dqkv|
    folded in, the one-pass part's by its _sums variant, the two-pass part's by fp8_amax over its
    rows on the side stream."""
    cp = runtime.cupy
    B, T, C3 = qkv.shape
    D = _preprocess(dout, out, NH)
    partials = None
    if dbias is not None or amax is not None:
        partials = cp.empty((b1 + colsum_chunks((B - b1) * T), C3), dtype=F32)
    main = cp.cuda.get_current_stream()
    side, forked, joined = runtime.side_stream("attention two-pass part")
    forked.record(main)          # inputs, D and dqkv's allocation are ready
    side.wait_event(forked)
    # the one-pass blocks (a whole head each) first in launch order: the two-pass part's small
    # blocks take the SMs its last wave leaves
    backward_v3_onepass(dout[:b1], qkv[:b1], out[:b1], lse[:b1], NH, dqkv[:b1], D=D[:b1],
                        sums=None if partials is None else partials[:b1], amax=amax)
    with side:
        backward_v3(dout[b1:], qkv[b1:], out[b1:], lse[b1:], NH, dqkv[b1:], D=D[b1:])
        if dbias is not None:
            colsum_partials(partials[b1:], dqkv[b1:].reshape(-1, C3))
        if amax is not None:     # atomicMax of bits: the same result beside the one-pass kernel's
            fp8_amax(dqkv[b1:], amax)
    joined.record(side)
    main.wait_event(joined)      # whatever the caller queues next (and D's release) sees both done
    if dbias is not None:
        reduce_partials(dbias, partials)


def _sms() -> int:
    """Multiprocessors of the current GPU; 132 (an H100 / H200) where there is none (plans made on
    the CPU)."""
    try:
        return runtime.sm_count()
    except Exception:  # noqa: BLE001 - no CUDA device here
        return 132


def scratch_bytes(B, T, NH, hd, dtype, version, backward=False) -> int:
    """Bytes of temporary device memory one call allocates (outputs excluded)."""
    dtype = dtypes.normalize(dtype)
    it = dtype.itemsize
    n_tt = B * NH * T * T
    if version in (2, 3):
        b1 = onepass_batches(B, NH, hd, _sms()) if version == 3 and backward else 0
        return (4 * B * NH * T + 4 * b1 * NH * hd * -(-T // 64) * 64) if backward else 0
    qkvp = 3 * B * T * NH * hd * it
    att = n_tt * 4 + (0 if dtype == F32 else n_tt * it)
    if not backward:
        return qkvp + att + B * T * NH * hd * it
    datt = n_tt * 4 if dtype == F32 else 0
    return 2 * qkvp + att + datt + B * T * NH * hd * it


# ---------------------------------------------------------------- public -----

@profiler.profiled("attention forward", flops=profiler.attention_forward_flops)
def attention_forward(qkv, num_heads, out=None, lse=None, version=None, *, out8=None, out8_t=None, scale8=None,
                      amax8=None):
    """Causal self-attention of qkv (B, T, 3C) with num_heads heads.

    Returns (out (B, T, C) of qkv's dtype, lse (B, NH, T) float32). `version`:
    None (the production path: 3 where it applies and settings.attention_v3_forward,
    else 2, else 1), 1 (classic, stores (B, NH, T, T)), 2 (flash, bf16, hd 64/128) or
    3 (flash on Hopper wgmma: bf16, sm_90, hd 64/128; same out/lse layout as 2).
    out8 (B*T, C) and/or out8_t (C, B*T) uint8, with scale8 (1,) float32 [and amax8 (1,) float32]
    (bf16 only): also out's E4M3 bytes -- the attention projection's FP8 input, the bits of
    fp8_quantize(out.reshape(B*T, C), "e4m3", scale8, out=out8, out_t=out8_t, amax=amax8). The v3
    kernel writes them itself where fused_fp8_output(hd, T) (no re-read of out); elsewhere that
    cast runs after the forward.
    """
    B, T, C, NH, hd = _check_qkv(qkv, num_heads)
    _check_version(version)
    xp = runtime.array_module(qkv, out, lse, out8, out8_t, scale8, amax8)
    out = output("out", out, xp, (B, T, C), qkv.dtype)
    lse = output("lse", lse, xp, (B, NH, T), F32)
    fp8 = out8 is not None or out8_t is not None
    if fp8:
        if qkv.dtype != dtypes.bfloat16:
            raise TypeError(f"out8, out8_t: FP8 output needs bfloat16 attention, got {dtypes.name(qkv.dtype)}")
        if scale8 is None:
            raise ValueError("scale8: needed with out8 / out8_t")
        for name, a, shape in (("out8", out8, (B * T, C)), ("out8_t", out8_t, (C, B * T))):
            if a is not None:
                check_array(name, a, dtype=np.uint8, shape=shape)
        check_cast_args(out.reshape(B * T, C), "e4m3", scale8, out8, out8_t, amax8, None, xp, xname="out")
    elif scale8 is not None or amax8 is not None:
        raise ValueError("scale8, amax8: only with out8 / out8_t")
    if xp is np:
        r_out, r_lse = attention_forward_reference(qkv, NH)
        out[...] = r_out.astype(out.dtype)
        lse[...] = r_lse.astype(F32)
    else:
        version = pick_version("forward", version, qkv.dtype, hd, runtime.device_arch(),
                               _misaligned((("qkv", qkv), ("out", out))))
        if B * T == 0:
            return out, lse
        fused = fp8 and version == 3 and fused_fp8_output(hd, T)
        if version == 3:
            forward_v3(qkv, NH, out, lse, f8=(out8, out8_t, amax8, scale8) if fused else None)
        elif version == 2:
            forward_v2(qkv, NH, out, lse)
        else:
            _forward_v1(qkv, NH, out, lse)
        if fused:
            return out, lse
    if fp8:
        fp8_quantize(out.reshape(B * T, C), "e4m3", scale8, out=out8, out_t=out8_t, amax=amax8)
    return out, lse


@profiler.profiled("attention backward", flops=profiler.attention_backward_flops)
def attention_backward(dout, qkv, out, lse, num_heads, dqkv=None, version=None, dbias=None, amax=None):
    """dqkv (B, T, 3C) = gradient of the causal attention w.r.t. qkv, given dout (B, T, C).

    out and lse are attention_forward's results for this qkv. dqkv is an
    activation gradient: overwritten [=] (allocated when None). `version`: None
    (3 where it applies and settings.attention_v3_backward, else 2, else 1), 1, 2,
    or 3 (the v2 algorithm on Hopper wgmma: bf16, sm_90, hd 64/128).
    dbias (3C,), optional, qkv's dtype or float32: dbias += dqkv's column sums (the qkv linear's
    bias gradient; float32 in a fixed order). Where the one-pass kernel takes the whole batch it
    sums them as it writes dqkv; elsewhere a column-sum pass over dqkv follows.
    amax (1,) float32 on dqkv's device, optional: amax = max(amax, max |dqkv|) (bf16 dqkv; the bits of
    fp8_amax(dqkv, amax)) -- dqkv's FP8 cast then knows its scale before it runs. The one-pass
    kernel takes it as it writes dqkv; elsewhere fp8_amax reads dqkv once more.
    """
    B, T, C, NH, hd = _check_qkv(qkv, num_heads)
    _check_version(version)
    check_array("dout", dout, shape=(B, T, C))
    check_array("out", out, shape=(B, T, C))
    check_array("lse", lse, dtype=F32, shape=(B, NH, T))
    check_same_dtype(qkv=qkv, dout=dout, out=out)
    xp = runtime.array_module(dout, qkv, out, lse, dqkv, dbias, amax)
    dqkv = output("dqkv", dqkv, xp, (B, T, 3 * C), qkv.dtype)
    if amax is not None:
        check_array("amax", amax, dtype=F32, shape=(1,))
        if qkv.dtype != BF16:
            raise TypeError(f"amax: taken of bfloat16 dqkv, got {dtypes.name(qkv.dtype)}")
    if dbias is not None:
        check_array("dbias", dbias, shape=(3 * C,))
        if dbias.dtype not in (qkv.dtype, np.dtype(F32)):
            raise TypeError(f"dbias: must be {dtypes.name(qkv.dtype)} or float32, got {dtypes.name(dbias.dtype)}")
    if xp is np:
        dqkv[...] = attention_backward_reference(dout, qkv, NH).astype(dqkv.dtype)
        if dbias is not None:
            colsum_reference(dbias, dqkv.reshape(-1, 3 * C))
        if amax is not None:
            fp8_amax(dqkv, amax)
        return dqkv
    version = pick_version("backward", version, qkv.dtype, hd, runtime.device_arch(),
                           _misaligned((("qkv", qkv), ("dout", dout), ("out", out), ("dqkv", dqkv))))
    if B * T == 0:
        return dqkv
    b1 = onepass_batches(B, NH, hd, runtime.sm_count()) if version == 3 else 0
    if version == 3 and b1 == B:
        sums = xp.empty((B, 3 * C), F32) if dbias is not None or amax is not None else None
        backward_v3_onepass(dout, qkv, out, lse, NH, dqkv, sums=sums, amax=amax)
        if dbias is not None:
            reduce_partials(dbias, sums)
        return dqkv
    if version == 3 and b1 > 0:
        backward_v3_split(dout, qkv, out, lse, NH, dqkv, b1, dbias=dbias, amax=amax)
        return dqkv
    if version == 3:
        backward_v3(dout, qkv, out, lse, NH, dqkv)
    elif version == 2:
        backward_v2(dout, qkv, out, lse, NH, dqkv)
    else:
        _backward_v1(dout, qkv, NH, dqkv)
    if dbias is not None:
        colsum(dbias, dqkv.reshape(B * T, 3 * C))
    if amax is not None:
        fp8_amax(dqkv, amax)
    return dqkv


def attention(q, k, v, causal=True):
    """numpy-like scaled dot-product attention: softmax(q k^T / sqrt(hd)) v, per (batch, head).

    q, k, v: (B, NH, T, hd), one dtype; returns (B, NH, T, hd). causal=True masks
    keys after the query. On the GPU the arrays are packed into one qkv and run
    through attention_forward (flash when it applies; causal=False runs version 1).
    """
    check_array("q", q, ndim=4)
    check_array("k", k, shape=q.shape)
    check_array("v", v, shape=q.shape)
    check_same_dtype(q=q, k=k, v=v)
    B, NH, T, hd = q.shape
    if hd == 0:
        raise ValueError("q: head dim must be at least 1")
    xp = runtime.array_module(q, k, v)
    if xp is np:
        qq, kk, vv = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
        p, _ = _probs(qq, kk, causal)
        return (p @ vv).astype(q.dtype)
    C = NH * hd
    qkv = xp.empty((B, T, 3 * C), dtype=q.dtype)
    for i, a in enumerate((q, k, v)):
        _unpermute(qkv, a, 1, B, T, NH, hd, 3 * C, i * C)
    out = xp.empty((B, T, C), dtype=q.dtype)
    lse = xp.empty((B, NH, T), dtype=F32)
    if causal:
        attention_forward(qkv, NH, out=out, lse=lse)
    elif B * T:
        _forward_v1(qkv, NH, out, lse, causal=False)
    y = xp.empty(q.shape, dtype=q.dtype)
    _permute(y, out, 1, B, T, NH, hd, C)
    return y
