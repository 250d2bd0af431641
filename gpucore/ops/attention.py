"""Causal multi-head attention over GPT-2's fused qkv activation, forward and backward.

    attention_forward(qkv (B, T, 3C), num_heads) -> out (B, T, C), lse (B, NH, T) fp32
    attention_backward(dout, qkv, out, lse, num_heads) -> dqkv (B, T, 3C)   [=]
    attention(q, k, v, causal=True) with (B, NH, T, hd) arrays -> (B, NH, T, hd)

Layout: q = qkv[..., :C], k = qkv[..., C:2C], v = qkv[..., 2C:]; head h is
columns h*hd:(h+1)*hd of each; scale 1/sqrt(hd). lse_i = log sum_{j<=i}
exp(scale q_i.k_j) is what the flash backward needs to recompute the softmax.

Versions (GPU):
  1  the classic way (llm.c's attention_forward, kernels_cu/attention.cu): permute
     qkv to (3, B*NH, T, hd), cuBLAS batched Q K^T into a float32 (B, NH, T, T)
     score matrix, causal softmax (kernel), cuBLAS batched P V, unpermute. The
     backward recomputes the scores and stores dP as well: O(B*NH*T^2) scratch.
     Any head dim, float32 or bfloat16.
  2  flash attention (FlashAttention-2, kernels_cu/flash_attention*.cu): bf16
     tensor cores, online softmax, only lse saved; the backward recomputes P
     tile by tile in two deterministic passes (dK/dV per KV tile, dQ per Q tile).
     Reads qkv and writes out/dqkv in place, scratch O(B*NH*T) (D = rowsum(dout*out)).
     bfloat16 only, head dim 64 or 128, 16-byte aligned arrays.
  3  backward only (kernels_cu/flash_attention_v3_bwd.cu): version 2's deterministic
     two passes with the tile products on Hopper's wgmma (sm_90a), from 128-byte
     swizzled shared memory; D from v2's preprocess. bf16, head dim 64 or 128, sm_90.
     The default backward on sm_90 while V3_BWD_DEFAULT is True.
The default (version=None) is 2 where it applies, else 1 (float32 inputs, other
head dims, misaligned views); asking for version=2 where it does not apply
raises instead of falling back.

NumPy inputs run the float64 reference (the result rounded to the input dtype).
The reference backward recomputes everything from qkv; `out` and `lse` are only
checked. Both versions are deterministic: same input, same bits.
"""
from __future__ import annotations

import math

import numpy as np

from .. import dtypes, runtime
from ._common import check_array, check_same_dtype, output
from .matmul import batched_matmul

F32, BF16 = dtypes.float32, dtypes.bfloat16
VERSIONS = (1, 2, 3)

# Flash kernel configurations; must match the FLASH_FWD / FLASH_BWD_DKDV / FLASH_BWD_DQ
# instantiations (tests/test_attention.py checks). The first entry per head dim is the
# default; the others are there for `gpucore bench attention --opt sweep=1`.
# forward: head dim -> [(warps per block, m16 tiles per warp, keys per KV tile)];
#   Q tile = 16 * tiles * warps rows
FWD_CONFIGS = {64: [(8, 1, 64), (4, 2, 64), (4, 1, 64), (8, 1, 128)],
               128: [(8, 1, 64), (4, 1, 64), (8, 1, 32)]}
# backward dK/dV pass: head dim -> [(warps, Q-tile rows)]; KV tile = 16 * warps keys
DKDV_CONFIGS = {64: [(4, 64), (8, 64), (4, 32)], 128: [(4, 32), (8, 32)]}
# backward dQ pass: head dim -> [(warps, keys per KV tile)]; Q tile = 16 * warps rows
DQ_CONFIGS = {64: [(4, 64), (8, 64), (4, 32)], 128: [(4, 32), (8, 32)]}
PREPROCESS_BLOCK = 256
V1_SOFTMAX_BLOCK = 256     # 8 warps = 8 rows per block
V1_PERMUTE_BLOCK = 256

# Version 3 forward (kernels_cu/flash_attention_v3.cu): FlashAttention-3-style on Hopper wgmma,
# compiled for sm_90a, runs on sm_90 only; writes out and lse exactly as v2 does, so either
# backward runs on them. Must match the FLASH_FWD_V3 instantiations (tests check); the first
# entry per head dim is the default. head dim -> [(consumer warpgroups, keys per KV tile)];
# Q tile = 64 * warpgroups rows. A third element (K/V stages, >= 3) selects the pipelined
# kernel of kernels_cu/flash_attention_v3p.cu (FLASH_FWD_V3P: S_{j+1} = Q K^T in flight during
# softmax, FA3's intra-warpgroup overlap); 2-tuples are flash_attention_v3.cu's kernels.
# First entry = default. Measured on an H200 (B=64 NH=12 T=1024 hd=64 causal, 2026-11-22):
# (2,64,3) 256.5 TFLOP/s, (2,64,4) 248.5, (2,64) 238.5, (2,128) 204.7, (1,128) 195.8, (2,128,3) 194.8.
# (Warp-specialised / ping-pong variants, flash_attention_v3pp.cu, ran 142-173 TFLOP/s and were
# removed; code in commit 6df0503, see tools/notes/attention.md.)
V3_FWD_CONFIGS = {64: [(2, 64, 3), (2, 64), (2, 64, 4), (2, 128, 3), (2, 128), (1, 128)],
                  128: [(2, 64, 3), (2, 64), (2, 128)]}
V3_FWD_ARCH = "90a"
# The default forward (version=None) is 3 where it applies (bf16, sm_90, head dim in
# V3_FWD_CONFIGS, 16-byte aligned), else 2, else 1. False reverts the default to v2.
V3_FWD_DEFAULT = True


def _v3_fwd_smem(hd, wgs, bn, stages=2):
    return 1024 + (64 * wgs + 2 * stages * bn) * hd * 2


def _fwd_smem(hd, warps, mt, bn):
    return (16 * mt * warps + 4 * bn) * (hd + 8) * 2


def _dkdv_smem(hd, warps, bm):
    return (32 * warps + 4 * bm) * (hd + 8) * 2 + 16 * bm


def _dq_smem(hd, warps, bn):
    return (32 * warps + 4 * bn) * (hd + 8) * 2


# Version 3 backward (kernels_cu/flash_attention_v3_bwd.cu): v2's deterministic two passes on
# Hopper wgmma, compiled for sm_90a, runs on sm_90 only. Must match the FLASH_V3_DKDV /
# FLASH_V3_DQ instantiations (tests check); first entry per head dim = default.
# dK/dV pass: head dim -> [(warpgroups, Q-tile rows)]; KV tile = 64 * warpgroups keys
# A third element names a kernel variant: V3_FD (1) = fused D (dQ pass only, below), V3_RA (2) =
# "register A": the pass holds its warpgroup's fixed operand (K and V in dK/dV, Q and dout in dQ)
# as wgmma register fragments, so the two N = 64 products read only B from shared memory
# (FLASH_V3_*_RA, kernel names ..._ra_bf16; BM/BN 64 at hd 64 only).
V3_FD, V3_RA = 1, 2
# hd 64 on an H100 (whole backward with dq (2,128), V3_HEAD_GROUP 16, 2026-11-22): dkdv (2,64,RA)
# 1.264 ms = 203.9 TFLOP/s, (2,64) 1.280 ms = 201.3 (before the block order: 191.1 vs 186.9).
V3_DKDV_CONFIGS = {64: [(2, 64, V3_RA), (2, 64), (1, 64), (1, 64, V3_RA)], 128: [(2, 64)]}
# dQ pass: head dim -> [(warpgroups, keys per KV tile)]; Q tile = 64 * warpgroups rows
# hd 64 on an H200 (whole backward, 2026-11-22): dq (2,128) 1.345 ms, (2,64) 1.391, (1,64) 1.440.
# A third element 1 = fused D (FLASH_V3_DQF): the dQ pass computes D = rowsum(dout * out) of its
# own rows and writes it; no preprocess kernel, the dK/dV pass runs after the dQ pass.
V3_DQ_CONFIGS = {64: [(2, 128), (2, 128, V3_FD), (2, 64), (2, 64, V3_RA), (1, 64), (1, 64, V3_RA), (2, 64, V3_FD)],
                 128: [(2, 64), (2, 64, V3_FD), (1, 64)]}
V3_VARIANT_SUFFIX = {0: "", V3_FD: "_fd", V3_RA: "_ra"}


def _v3_variant(cfg):
    return cfg[2] if len(cfg) > 2 else 0
V3_ARCH = "90a"
# Blocks started together share the operands of V3_HEAD_GROUP heads through L2 (v3_block_order in
# kernels_cu/flash_attention_v3.cuh); 0 = the old order (head = blockIdx.x). Compiled in (-D).
V3_HEAD_GROUP = 16


def _v3_options():
    return (f"-DV3_HEAD_GROUP={int(V3_HEAD_GROUP)}",)
# The default backward (version=None) is 3 where it applies (bf16, sm_90, head dim in the
# tables, 16-byte aligned), else as before. False reverts the default to v2 without code changes.
V3_BWD_DEFAULT = True
BWD_VERSIONS = (1, 2, 3)
# Non-fused dq configs: after the preprocess, run the dQ pass on a side stream concurrently with
# the dK/dV pass on the caller's (both only read qkv/dout/lse/D and write disjoint column blocks
# of dqkv, so the result is the same bits). The GPU then fills the idle SMs of one pass' causal
# tail with the other's blocks. False: one stream, preprocess -> dkdv -> dq.
V3_BWD_STREAMS = True


def _v3_stages(hd):
    """Q/dO (dK/dV pass) and K/V (dQ pass) ring stages: 3 at hd 64, where the dK / dQ wgmma
    group of one tile runs on into the next (the kernels static_assert the same rule), else 2."""
    return 3 if hd == 64 else 2


def _v3_dkdv_smem(hd, wgs, bm):
    st = _v3_stages(hd)
    return 1024 + (2 * 64 * wgs + 2 * st * bm) * hd * 2 + 8 * st * bm


def _v3_dq_smem(hd, wgs, bn):
    return 1024 + (2 * 64 * wgs + 2 * _v3_stages(hd) * bn) * hd * 2


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


def _flash_ok(dtype, hd, arrays) -> str | None:
    """None if version 2 runs on these arrays, else the reason it does not."""
    if dtype != BF16:
        return f"version 2 takes bfloat16, got {dtypes.name(dtype)} (float32 runs version 1)"
    if hd not in FWD_CONFIGS:
        return f"version 2 supports head dims {sorted(FWD_CONFIGS)}, got {hd}"
    for name, a in arrays:
        if a.data.ptr % 16:
            return f"{name}: version 2 needs 16-byte aligned arrays"
    return None


def _pick_version(version, dtype, hd, arrays):
    reason = _flash_ok(dtype, hd, arrays)
    if version is None:
        return 1 if reason else 2
    if version == 2 and reason:
        raise (TypeError if reason.startswith("version 2 takes") else ValueError)(reason)
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
    k = runtime.get_kernel("attention", f"attention_{name}_kernel_v1_{dtypes.kernel_suffix(x.dtype)}")
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
    k = runtime.get_kernel("attention", name)
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

def _forward_v2(qkv, NH, out, lse, cfg=None):
    B, T, C3 = qkv.shape
    hd = C3 // 3 // NH
    warps, mt, bn = cfg or FWD_CONFIGS[hd][0]
    k = runtime.get_kernel("flash_attention", f"attention_forward_kernel_v2_hd{hd}_w{warps}_mt{mt}_n{bn}_bf16")
    runtime.launch(k, (B * NH, -(-T // (16 * mt * warps))), 32 * warps,
                   (out, lse, qkv, np.int32(T), np.int32(NH), np.float32(1.0 / math.sqrt(hd))),
                   shared_mem=_fwd_smem(hd, warps, mt, bn))


def _v3_reason(what, dtype, hd, configs, arch, arrays) -> str | None:
    """None if the version 3 `what` ("forward"/"backward") runs on these arrays here, else why not."""
    if dtype != BF16:
        return f"version 3 {what} takes bfloat16, got {dtypes.name(dtype)}"
    if hd not in configs:
        return f"version 3 {what} supports head dims {sorted(configs)}, got {hd}"
    for name, a in arrays:
        if a.data.ptr % 16:
            return f"{name}: version 3 {what} needs 16-byte aligned arrays"
    if runtime.device_arch() != arch[:-1]:
        return f"version 3 {what} needs an sm_{arch[:-1]} GPU (wgmma), this one is sm_{runtime.device_arch()}"
    return None


def _forward_v3(qkv, NH, out, lse, cfg=None):
    """wgmma flash forward (kernels_cu/flash_attention_v3.cu): grid (B*NH, Q tiles of 64*wgs rows)."""
    B, T, C3 = qkv.shape
    hd = C3 // 3 // NH
    wgs, bn, *st = cfg or V3_FWD_CONFIGS[hd][0]
    if st:   # pipelined variant (flash_attention_v3p.cu), st[0] K/V stages
        k = runtime.get_kernel("flash_attention_v3p",
                               f"attention_forward_kernel_v3_hd{hd}_g{wgs}_n{bn}_s{st[0]}_bf16",
                               options=_v3_options(), arch=V3_FWD_ARCH)
    else:
        k = runtime.get_kernel("flash_attention_v3", f"attention_forward_kernel_v3_hd{hd}_g{wgs}_n{bn}_bf16",
                               options=_v3_options(), arch=V3_FWD_ARCH)
    runtime.launch(k, (B * NH, -(-T // (64 * wgs))), 128 * wgs,
                   (out, lse, qkv, np.int32(T), np.int32(NH), np.float32(1.0 / math.sqrt(hd))),
                   shared_mem=_v3_fwd_smem(hd, wgs, bn, *st))


def _backward_v2(dout, qkv, out, lse, NH, dqkv, dkdv_cfg=None, dq_cfg=None):
    cp = runtime.cupy
    B, T, C3 = qkv.shape
    hd = C3 // 3 // NH
    kv_warps, bm = dkdv_cfg or DKDV_CONFIGS[hd][0]
    q_warps, bn = dq_cfg or DQ_CONFIGS[hd][0]
    scale = np.float32(1.0 / math.sqrt(hd))
    D = cp.empty((B, NH, T), dtype=F32)
    rows = B * T * NH
    k0 = runtime.get_kernel("flash_attention_bwd", f"attention_backward_preprocess_kernel_v2_hd{hd}_bf16")
    runtime.launch(k0, -(-rows * (hd // 8) // PREPROCESS_BLOCK), PREPROCESS_BLOCK,
                   (D, dout, out, np.int32(rows), np.int32(T), np.int32(NH)))
    args = (dqkv, qkv, dout, lse, D, np.int32(T), np.int32(NH), scale)
    k1 = runtime.get_kernel("flash_attention_bwd",
                            f"attention_backward_dkdv_kernel_v2_hd{hd}_w{kv_warps}_m{bm}_bf16")
    runtime.launch(k1, (B * NH, -(-T // (16 * kv_warps))), 32 * kv_warps, args,
                   shared_mem=_dkdv_smem(hd, kv_warps, bm))
    k2 = runtime.get_kernel("flash_attention_bwd", f"attention_backward_dq_kernel_v2_hd{hd}_w{q_warps}_n{bn}_bf16")
    runtime.launch(k2, (B * NH, -(-T // (16 * q_warps))), 32 * q_warps, args,
                   shared_mem=_dq_smem(hd, q_warps, bn))


# -------------------------------------------------------------- version 3 ----


def _backward_v3(dout, qkv, out, lse, NH, dqkv, dkdv_cfg=None, dq_cfg=None, streams=None):
    """v2's preprocess (D = rowsum(dout * out)), then the wgmma dK/dV and dQ passes.

    dq_cfg with a third element V3_FD (fused D): the dQ pass computes D itself and runs first, then
    the dK/dV pass (no preprocess). Otherwise, with streams (default V3_BWD_STREAMS), the dQ pass
    runs on a side stream concurrently with the dK/dV pass; the caller's stream waits for both.
    """
    cp = runtime.cupy
    B, T, C3 = qkv.shape
    hd = C3 // 3 // NH
    dkdv_cfg, dq_cfg = dkdv_cfg or V3_DKDV_CONFIGS[hd][0], dq_cfg or V3_DQ_CONFIGS[hd][0]
    kv_wgs, bm, q_wgs, bn = dkdv_cfg[0], dkdv_cfg[1], dq_cfg[0], dq_cfg[1]
    kv_suffix, q_suffix = V3_VARIANT_SUFFIX[_v3_variant(dkdv_cfg)], V3_VARIANT_SUFFIX[_v3_variant(dq_cfg)]
    fused = _v3_variant(dq_cfg) == V3_FD
    streams = V3_BWD_STREAMS if streams is None else streams
    scale = np.float32(1.0 / math.sqrt(hd))
    D = cp.empty((B, NH, T), dtype=F32)
    k1 = runtime.get_kernel("flash_attention_v3_bwd",
                            f"attention_backward_dkdv_kernel_v3_hd{hd}_g{kv_wgs}_m{bm}{kv_suffix}_bf16",
                            options=_v3_options(), arch=V3_ARCH)
    args = (dqkv, qkv, dout, lse, D, np.int32(T), np.int32(NH), scale)

    def dkdv():
        runtime.launch(k1, (B * NH, -(-T // (64 * kv_wgs))), 128 * kv_wgs, args,
                       shared_mem=_v3_dkdv_smem(hd, kv_wgs, bm))

    q_grid, q_smem = (B * NH, -(-T // (64 * q_wgs))), _v3_dq_smem(hd, q_wgs, bn)
    if fused:   # dQ pass writes D, then the dK/dV pass reads it (same stream: ordered)
        k2 = runtime.get_kernel("flash_attention_v3_bwd",
                                f"attention_backward_dq_kernel_v3_hd{hd}_g{q_wgs}_n{bn}{q_suffix}_bf16",
                                options=_v3_options(), arch=V3_ARCH)
        runtime.launch(k2, q_grid, 128 * q_wgs, (dqkv, D, qkv, dout, out, lse, np.int32(T), np.int32(NH), scale),
                       shared_mem=q_smem)
        dkdv()
        return
    rows = B * T * NH
    k0 = runtime.get_kernel("flash_attention_bwd", f"attention_backward_preprocess_kernel_v2_hd{hd}_bf16")
    runtime.launch(k0, -(-rows * (hd // 8) // PREPROCESS_BLOCK), PREPROCESS_BLOCK,
                   (D, dout, out, np.int32(rows), np.int32(T), np.int32(NH)))
    k2 = runtime.get_kernel("flash_attention_v3_bwd",
                            f"attention_backward_dq_kernel_v3_hd{hd}_g{q_wgs}_n{bn}{q_suffix}_bf16",
                            options=_v3_options(), arch=V3_ARCH)
    if not streams:
        dkdv()
        runtime.launch(k2, q_grid, 128 * q_wgs, args, shared_mem=q_smem)
        return
    main = cp.cuda.get_current_stream()
    side, forked, joined = runtime.side_stream("attention dq")
    forked.record(main)          # inputs, D (preprocess) and dqkv's allocation are ready
    side.wait_event(forked)
    # dQ first in launch order on its own stream: its heaviest tiles start while the dK/dV
    # pass' blocks queue behind; each pass fills the other's causal tail.
    runtime.launch(k2, q_grid, 128 * q_wgs, args, shared_mem=q_smem, stream=side)
    dkdv()
    joined.record(side)
    main.wait_event(joined)      # whatever the caller queues next (and D's release) sees dQ done


def scratch_bytes(B, T, NH, hd, dtype, version, backward=False) -> int:
    """Bytes of temporary device memory one call allocates (outputs excluded)."""
    dtype = dtypes.normalize(dtype)
    it = dtype.itemsize
    n_tt = B * NH * T * T
    if version in (2, 3):
        return 4 * B * NH * T if backward else 0
    qkvp = 3 * B * T * NH * hd * it
    att = n_tt * 4 + (0 if dtype == F32 else n_tt * it)
    if not backward:
        return qkvp + att + B * T * NH * hd * it
    datt = n_tt * 4 if dtype == F32 else 0
    return 2 * qkvp + att + datt + B * T * NH * hd * it


# ---------------------------------------------------------------- public -----

def attention_forward(qkv, num_heads, out=None, lse=None, version=None):
    """Causal self-attention of qkv (B, T, 3C) with num_heads heads.

    Returns (out (B, T, C) of qkv's dtype, lse (B, NH, T) float32). `version`:
    None (best available: 3 where it applies and V3_FWD_DEFAULT, else 2, else 1),
    1 (classic, stores (B, NH, T, T)), 2 (flash, bf16) or 3 (flash on Hopper wgmma:
    bf16, sm_90, head dims in V3_FWD_CONFIGS; same out/lse layout as 2).
    """
    B, T, C, NH, hd = _check_qkv(qkv, num_heads)
    _check_version(version)
    xp = runtime.array_module(qkv, out, lse)
    out = output("out", out, xp, (B, T, C), qkv.dtype)
    lse = output("lse", lse, xp, (B, NH, T), F32)
    if xp is np:
        r_out, r_lse = attention_forward_reference(qkv, NH)
        out[...] = r_out.astype(out.dtype)
        lse[...] = r_lse.astype(F32)
        return out, lse
    if version == 3 or (version is None and V3_FWD_DEFAULT):
        reason = _v3_reason("forward", qkv.dtype, hd, V3_FWD_CONFIGS, V3_FWD_ARCH, (("qkv", qkv), ("out", out)))
        if reason is None:
            if B * T:
                _forward_v3(qkv, NH, out, lse)
            return out, lse
        if version == 3:
            raise (TypeError if "takes bfloat16" in reason else ValueError)(reason)
    version = _pick_version(version, qkv.dtype, hd, (("qkv", qkv), ("out", out)))
    if B * T == 0:
        return out, lse
    if version == 2:
        _forward_v2(qkv, NH, out, lse)
    else:
        _forward_v1(qkv, NH, out, lse)
    return out, lse


def attention_backward(dout, qkv, out, lse, num_heads, dqkv=None, version=None):
    """dqkv (B, T, 3C) = gradient of the causal attention w.r.t. qkv, given dout (B, T, C).

    out and lse are attention_forward's results for this qkv. dqkv is an
    activation gradient: overwritten [=] (allocated when None). `version`: None
    (3 where it applies and V3_BWD_DEFAULT, else 2, else 1), 1, 2, or 3 (the v2
    algorithm on Hopper wgmma: bf16, sm_90, head dims in V3_DKDV_CONFIGS).
    """
    B, T, C, NH, hd = _check_qkv(qkv, num_heads)
    if version is not None and version not in BWD_VERSIONS:
        raise ValueError(f"version: must be one of {BWD_VERSIONS} or None, got {version!r}")
    check_array("dout", dout, shape=(B, T, C))
    check_array("out", out, shape=(B, T, C))
    check_array("lse", lse, dtype=F32, shape=(B, NH, T))
    check_same_dtype(qkv=qkv, dout=dout, out=out)
    xp = runtime.array_module(dout, qkv, out, lse, dqkv)
    dqkv = output("dqkv", dqkv, xp, (B, T, 3 * C), qkv.dtype)
    if xp is np:
        dqkv[...] = attention_backward_reference(dout, qkv, NH).astype(dqkv.dtype)
        return dqkv
    if version == 3 or (version is None and V3_BWD_DEFAULT):
        reason = _v3_reason("backward", qkv.dtype, hd, V3_DKDV_CONFIGS, V3_ARCH,
                            (("qkv", qkv), ("dout", dout), ("out", out), ("dqkv", dqkv)))
        if reason is None:
            if B * T:
                _backward_v3(dout, qkv, out, lse, NH, dqkv)
            return dqkv
        if version == 3:
            raise (TypeError if "takes bfloat16" in reason else ValueError)(reason)
    version = _pick_version(version, qkv.dtype, hd,
                            (("qkv", qkv), ("dout", dout), ("out", out), ("dqkv", dqkv)))
    if B * T == 0:
        return dqkv
    if version == 2:
        _backward_v2(dout, qkv, out, lse, NH, dqkv)
    else:
        _backward_v1(dout, qkv, NH, dqkv)
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
