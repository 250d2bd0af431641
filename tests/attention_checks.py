"""Checks shared by the attention tests (test_attention: the production path; ladder/test_attention:
every config and the non-pipelined v3 forward). On a failure the messages name the worst (batch,
head, 16-row block), so a fragment-layout or masking bug shows up as a pattern."""
import functools
import re
from pathlib import Path

import numpy as np
import pytest

import gpucore
from gpucore import runtime
from gpucore.ops import attention as attn
from conftest import poison, rel_err, to_cpu

BF16 = gpucore.bfloat16


def make_qkv(rng, B, T, NH, hd, dtype=np.float32, sigma=1.0):
    return (sigma * rng.standard_normal((B, T, 3 * NH * hd))).astype(dtype)


def instantiations(path, macro):
    """The argument tuples of every `MACRO(...)` line of a kernel file."""
    return [tuple(int(x) for x in m.split(","))
            for m in re.findall(rf"^{macro}\(([\d, ]+)\)", Path(path).read_text(), re.MULTILINE)]


def config_table(rows):
    """[(hd, *config)] -> {hd: [config, ...]} in file order."""
    t = {}
    for hd, *cfg in rows:
        t.setdefault(hd, []).append(tuple(cfg))
    return t


def v2_instantiations():
    """(forward, dK/dV, dQ) tables of attention/flash_fwd.cu and flash_bwd.cu."""
    kdir = runtime.KERNEL_DIR / "attention"
    bwd = kdir / "flash_bwd.cu"
    return (config_table(instantiations(kdir / "flash_fwd.cu", "FLASH_FWD")),
            config_table(instantiations(bwd, "FLASH_BWD_DKDV")), config_table(instantiations(bwd, "FLASH_BWD_DQ")))


def v2_names(fwd, dkdv, dq):
    """The kernel names of v2 forward / dK/dV / dQ configs."""
    return ({f"attention_forward_kernel_v2_hd{hd}_w{w}_mt{mt}_n{n}_bf16" for hd in fwd for w, mt, n in fwd[hd]}
            | {f"attention_backward_dkdv_kernel_v2_hd{hd}_w{w}_m{m}_bf16" for hd in dkdv for w, m in dkdv[hd]}
            | {f"attention_backward_dq_kernel_v2_hd{hd}_w{w}_n{n}_bf16" for hd in dq for w, n in dq[hd]})


def check_v2_config_limits(fwd, dkdv, dq):
    """Shared memory fits sm_80 and the copy loops divide evenly, for every config of the tables."""
    for hd, cfgs in fwd.items():
        for w, mt, bn in cfgs:
            assert attn.v2_fwd_smem(hd, w, mt, bn) <= 163 * 1024      # fits sm_80 too
            assert (16 * mt * w * hd // 8) % (32 * w) == 0 and (bn * hd // 8) % (32 * w) == 0
    for hd in dkdv:
        for w, bm in dkdv[hd]:
            assert attn.v2_dkdv_smem(hd, w, bm) <= 163 * 1024 and (bm * hd // 8) % (32 * w) == 0
        for w, bn in dq[hd]:
            assert attn.v2_dq_smem(hd, w, bn) <= 163 * 1024 and (bn * hd // 8) % (32 * w) == 0


@functools.cache
def kernel_rows(arch, *files):
    """runtime.check_kernels rows of kernels_cu/<file> for one arch (compiled once per session)."""
    return tuple(runtime.check_kernels((arch,), [runtime.KERNEL_DIR / f for f in files]))


def locate(out, ref, B, T, NH, hd, S=1):
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


def lse_locate(lse, ref):
    d = np.abs(np.asarray(lse, np.float64) - ref)
    b, h, t = np.unravel_index(np.nanargmax(np.where(np.isnan(d), np.inf, d)), d.shape)
    return f"max |lse err| {np.nanmax(d):.3e} at b={b} h={h} t={t}; NaN: {int(np.isnan(d).sum())}"


def v3_bwd_instantiations(fused_d=None):
    """(dK/dV, dQ) tables of attention/flash_v3_bwd.cu. Instantiations are (hd, warpgroups, tile,
    min blocks per SM); the tables omit the last and add the variant: register-A kernels
    (FLASH_V3_*_RA) are (warpgroups, tile, V3_RA), fused-D dq kernels (FLASH_V3_DQF)
    (warpgroups, BN, fused_d) -- left out when fused_d is None (they are ladder-only)."""
    src = runtime.KERNEL_DIR / "attention" / "flash_v3_bwd.cu"
    dkdv = config_table([r[:3] for r in instantiations(src, "FLASH_V3_DKDV")]
                        + [(*r[:3], attn.V3_RA) for r in instantiations(src, "FLASH_V3_DKDV_RA")])
    dq = config_table([r[:3] for r in instantiations(src, "FLASH_V3_DQ")]
                      + ([(*r[:3], fused_d) for r in instantiations(src, "FLASH_V3_DQF")] if fused_d else [])
                      + [(*r[:3], attn.V3_RA) for r in instantiations(src, "FLASH_V3_DQ_RA")])
    return dkdv, dq


def check_v3_bwd_config_limits(dkdv, dq, dq_variants=((), (attn.V3_RA,))):
    """Variants where they exist, shared memory within sm_90's 227 KB, copy loops dividing evenly."""
    for hd in dkdv:
        for g, bm, *var in dkdv[hd]:
            assert var in ([], [attn.V3_RA]) and (not var or (bm, hd) == (64, 64))
            assert bm in (64, 128) and attn.v3_dkdv_smem(hd, g, bm) <= 227 * 1024
            assert (bm * hd // 8) % (128 * g) == 0 and (64 * g * hd // 8) % (128 * g) == 0
        for g, bn, *var in dq[hd]:
            assert bn in (64, 128) and attn.v3_dq_smem(hd, g, bn) <= 227 * 1024
            assert tuple(var) in dq_variants and (var != [attn.V3_RA] or (bn, hd) == (64, 64))
            assert (bn * hd // 8) % (128 * g) == 0


def v3_bwd_names(dkdv, dq, suffixes):
    """The kernel names of the v3 backward configs, the variant's name suffix from `suffixes`."""
    suffix = lambda c: suffixes[attn.v3_variant(c)]  # noqa: E731
    return ({f"attention_backward_dkdv_kernel_v3_hd{hd}_g{c[0]}_m{c[1]}{suffix(c)}_bf16" for hd in dkdv for c in dkdv[hd]}
            | {f"attention_backward_dq_kernel_v3_hd{hd}_g{c[0]}_n{c[1]}{suffix(c)}_bf16" for hd in dq for c in dq[hd]})


def need_sm90():
    if runtime.device_arch() != attn.V3_ARCH[:-1]:
        pytest.skip(f"version 3 needs sm_{attn.V3_ARCH[:-1]}")


def check_v3_backward(rng, B, NH, T, hd, run):
    """v2 forward, then `run(dout, qkv, out, lse, dqkv)` into a NaN-poisoned dqkv; checks dq, dk, dv."""
    cp = runtime.cupy
    C = NH * hd
    qkv = make_qkv(rng, B, T, NH, hd, BF16, sigma=1.5)
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
        assert err < 1e-2, f"d{name} rel err {err:.3e}\n{locate(d, ref, B, T, NH, hd, S=3)}"


def v3_backward_case(rng, hd, B=2, NH=3, T=300):
    """(NH, qkv, dout, out, lse) on the GPU for the v3 backward tests: bf16, T not a tile multiple,
    forward by v2 (the backward under test gets the same inputs whatever v3's forward does)."""
    cp = runtime.cupy
    qkv = cp.asarray(make_qkv(rng, B, T, NH, hd, BF16))
    dout = cp.asarray(rng.standard_normal((B, T, NH * hd)).astype(BF16))
    out, lse = gpucore.attention_forward(qkv, NH, version=2)
    return NH, qkv, dout, out, lse


def v3_backward_bits(qkv, dout, out, lse, NH, backward=None, **kw):
    """The bytes of dqkv after `backward(dout, qkv, out, lse, NH, dqkv, **kw)` (default
    ops.attention.backward_v3) into a NaN-poisoned dqkv, read on the caller's stream."""
    dqkv = poison(qkv.shape, BF16)
    (backward or attn.backward_v3)(dout, qkv, out, lse, NH, dqkv, **kw)
    return to_cpu(dqkv).tobytes()        # reads on the caller's stream: must see the side stream's dQ


def v3_fwd_instantiations(path="attention/flash_v3_fwd.cu"):
    """hd -> sorted configs of a v3 forward file: (g, bn, stages) of the pipelined
    attention/flash_v3_fwd.cu, (g, bn) of ladder/attention/flash_v3_fwd_serial.cu (instantiations
    end in MINB, not in the configs); order is set in Python only."""
    macro = "FLASH_FWD_V3" if "serial" in path else "FLASH_FWD_V3P"
    return {hd: sorted(c) for hd, c in config_table([r[:-1] for r in instantiations(runtime.KERNEL_DIR / path,
                                                                                    macro)]).items()}


def check_v3_fwd_config_limits(table):
    for hd, cfgs in table.items():
        assert hd in (64, 128)
        for g, bn, *st in cfgs:
            nt = 128 * g
            assert g in (1, 2) and bn in (64, 128) and attn.v3_fwd_smem(hd, g, bn, *(st or [2])) <= 227 * 1024
            assert not st or st[0] in (3, 4)
            assert (64 * g * hd // 8) % nt == 0 and (bn * hd // 8) % nt == 0   # copy loops divide evenly


def v3_fwd_names(table):
    """Kernel names of v3 forward configs: (g, bn, stages) pipelined, (g, bn) serial."""
    return {f"attention_forward_kernel_v3_hd{hd}_g{c[0]}_n{c[1]}" + "".join(f"_s{x}" for x in c[2:]) + "_bf16"
            for hd, cfgs in table.items() for c in cfgs}


def check_v3_forward(rng, B, NH, T, hd, forward=None, cfg=None, sigma=1.5):
    """`forward(qkv, NH, out, lse, config=cfg)` (default ops.attention.forward_v3) into NaN-poisoned
    out/lse vs the float64 reference."""
    cp = runtime.cupy
    qkv = make_qkv(rng, B, T, NH, hd, BF16, sigma=sigma)
    out = poison((B, T, NH * hd), BF16)
    lse = poison((B, NH, T), np.float32)
    (forward or attn.forward_v3)(cp.asarray(qkv), NH, out, lse, config=cfg)
    ref_out, ref_lse = attn.attention_forward_reference(qkv, NH)
    o, l_ = to_cpu(out), to_cpu(lse)
    err = rel_err(o, ref_out)
    assert not np.isnan(o.astype(np.float32)).any(), f"NaN in out\n{locate(o, ref_out, B, T, NH, hd)}"
    assert err < 1e-2, f"cfg {cfg}: out rel err {err:.3e}\n{locate(o, ref_out, B, T, NH, hd)}"
    lse_err = np.abs(l_.astype(np.float64) - ref_lse)
    assert np.all(lse_err < 2e-3), f"cfg {cfg}: " + lse_locate(l_, ref_lse)
