"""Attention ladder: the rungs and tile configurations that lost to the production kernels.

gpucore/ops/attention.py runs one config per head dim of each production kernel (its module
docstring lists them and which instantiations only this module launches). Here live, for
`gpucore bench attention --opt sweep=1`, tools/probes/attention_*.py and tests/ladder/:

    V2_FWD_CONFIGS, V2_DKDV_CONFIGS, V2_DQ_CONFIGS   v2 (attention/flash_fwd.cu, flash_bwd.cu)
    V3_FWD_CONFIGS                                   v3 pipelined forward (attention/flash_v3_fwd.cu)
    V3_SERIAL_FWD_CONFIGS, forward_v3_serial         v3 forward without the pipeline
                                                     (kernels_cu/ladder/attention/flash_v3_fwd_serial.cu)
    V3_DKDV_CONFIGS, V3_DQ_CONFIGS, backward_v3      v3 backward passes, with the fused-D dQ pass (V3_FD)

Every table maps head dim -> configs, the production default first (taken from ops/attention.py),
then the alternatives in the order they measured; each must match the .cu instantiations
(tests/ladder/test_attention.py checks). v2 configs run through ops.attention.forward_v2 /
backward_v2, pipelined v3 forward configs through ops.attention.forward_v3.

The training path never imports this module.
"""
from __future__ import annotations

import math

import numpy as np

from .. import runtime
from ..ops import attention as attn


def _with_default(defaults, alternatives):
    """hd -> [production default, *alternatives]."""
    return {hd: [defaults[hd], *alternatives[hd]] for hd in defaults}


# v2 forward: (warps per block, m16 tiles per warp, keys per KV tile)
V2_FWD_CONFIGS = _with_default(attn.V2_FWD_CONFIG, {64: [(4, 2, 64), (4, 1, 64), (8, 1, 128)],
                                                    128: [(4, 1, 64), (8, 1, 32)]})
# v2 backward dK/dV pass: (warps, Q-tile rows); dQ pass: (warps, keys per KV tile)
V2_DKDV_CONFIGS = _with_default(attn.V2_DKDV_CONFIG, {64: [(8, 64), (4, 32)], 128: [(8, 32)]})
V2_DQ_CONFIGS = _with_default(attn.V2_DQ_CONFIG, {64: [(8, 64), (4, 32)], 128: [(8, 32)]})

# v3 forward, pipelined (warpgroups, BN, K/V stages) and serial (warpgroups, BN). Measured on an
# H200 (B=64 NH=12 T=1024 hd=64 causal, 2026-11-22, before the block order and the lean copies):
# (2,64,3) 256.5 TFLOP/s, (2,64,4) 248.5, serial (2,64) 238.5, serial (2,128) 204.7,
# serial (1,128) 195.8, (2,128,3) 194.8. (Warp-specialised / ping-pong variants ran 142-173
# TFLOP/s and were removed; code in commit 6df0503, see tools/notes/attention.md.)
V3_FWD_CONFIGS = _with_default(attn.V3_FWD_CONFIG, {64: [(2, 64, 4), (2, 128, 3)], 128: []})
V3_SERIAL_FWD_CONFIGS = {64: [(2, 64), (2, 128), (1, 128)], 128: [(2, 64), (2, 128)]}

# v3 backward: (warpgroups, tile[, variant]) as in ops/attention.py; variant V3_FD (dQ pass only):
# fused D (FLASH_V3_DQF, kernel names ..._fd_bf16) -- the dQ pass computes D = rowsum(dout * out)
# of its own rows and writes it, no preprocess kernel, the dK/dV pass runs after the dQ pass.
# H200 hd 64 (whole backward, 2026-11-22): dq (2,128) 1.345 ms, (2,64) 1.391, (1,64) 1.440.
V3_FD = 1
V3_VARIANT_SUFFIX = {**attn.V3_VARIANT_SUFFIX, V3_FD: "_fd"}
V3_DKDV_CONFIGS = _with_default(attn.V3_DKDV_CONFIG, {64: [(2, 64), (1, 64), (1, 64, attn.V3_RA)], 128: []})
V3_DQ_CONFIGS = _with_default(attn.V3_DQ_CONFIG, {
    64: [(2, 128, V3_FD), (2, 64), (2, 64, attn.V3_RA), (1, 64), (1, 64, attn.V3_RA), (2, 64, V3_FD)],
    128: [(2, 64, V3_FD), (1, 64)]})

SERIAL_FAMILY = "ladder/attention/flash_v3_fwd_serial"


def forward_v3_serial(qkv, NH, out, lse, config=None):
    """The v3 forward without the pipeline (kernels_cu/ladder/attention/flash_v3_fwd_serial.cu):
    fence -> wgmma -> wait per batch, K/V double-buffered. `config` (warpgroups, BN), default
    V3_SERIAL_FWD_CONFIGS[hd][0]; arrays as for ops.attention.forward_v3 (bf16 on an sm_90 GPU).
    Same out/lse as the production forward."""
    B, T, C3 = qkv.shape
    hd = C3 // 3 // NH
    wgs, bn = config or V3_SERIAL_FWD_CONFIGS[hd][0]
    k = runtime.get_kernel(SERIAL_FAMILY, f"attention_forward_kernel_v3_hd{hd}_g{wgs}_n{bn}_bf16",
                           options=attn.v3_compile_options(), arch=attn.V3_ARCH)
    runtime.launch(k, (B * NH, -(-T // (64 * wgs))), 128 * wgs,
                   (out, lse, qkv, np.int32(T), np.int32(NH), np.float32(1.0 / math.sqrt(hd))),
                   shared_mem=attn.v3_fwd_smem(hd, wgs, bn, 2))


def backward_v3(dout, qkv, out, lse, NH, dqkv, dkdv_config=None, dq_config=None, streams=None):
    """The v3 backward with any V3_DKDV_CONFIGS / V3_DQ_CONFIGS entry: a fused-D dq config runs
    the dQ pass (it writes D) and then the dK/dV pass, one stream; any other is
    ops.attention.backward_v3 (`streams` as there)."""
    B, T, C3 = qkv.shape
    hd = C3 // 3 // NH
    if dq_config is None or attn.v3_variant(dq_config) != V3_FD:
        attn.backward_v3(dout, qkv, out, lse, NH, dqkv, dkdv_config=dkdv_config, dq_config=dq_config,
                         streams=streams)
        return
    cp = runtime.cupy
    wgs, bn = dq_config[:2]
    D = cp.empty((B, NH, T), dtype=np.float32)
    k = runtime.get_kernel("attention/flash_v3_bwd", f"attention_backward_dq_kernel_v3_hd{hd}_g{wgs}_n{bn}_fd_bf16",
                           options=attn.v3_compile_options(), arch=attn.V3_ARCH)
    runtime.launch(k, (B * NH, -(-T // (64 * wgs))), 128 * wgs,
                   (dqkv, D, qkv, dout, out, lse, np.int32(T), np.int32(NH), np.float32(1.0 / math.sqrt(hd))),
                   shared_mem=attn.v3_dq_smem(hd, wgs, bn))
    attn.backward_v3_dkdv(dout, qkv, lse, D, NH, dqkv, config=dkdv_config)   # same stream: after D is written
