"""The attention ladder (gpucore/ladder/attention.py): every tile configuration of the flash
kernels, the non-pipelined v3 forward and the fused-D dQ pass, against the same references as
the production path (tests/test_attention.py; shared helpers in tests/attention_checks.py).

CPU: the ladder tables start with ops/attention.py's defaults and equal the kernel files'
instantiations (production files + kernels_cu/ladder/attention/flash_v3_fwd_serial.cu);
every config's shared memory and copy loops fit; every name compiles.
GPU (pytest -m cuda): each non-default config (v3: each config) correct on T not a tile
multiple; the fused-D backward deterministic and within rounding of the default one.
"""
import numpy as np
import pytest

from gpucore import runtime
from gpucore.ladder import attention as ladder
from gpucore.ops import attention as attn
from conftest import poison, rel_err, to_cpu
from attention_checks import (BF16, check_v2_config_limits, check_v3_backward, check_v3_bwd_config_limits,
                            check_v3_forward, check_v3_fwd_config_limits, instantiations, kernel_rows, locate,
                            make_qkv, need_sm90, v2_instantiations, v2_names, v3_backward_bits, v3_backward_case,
                            v3_bwd_instantiations, v3_bwd_names, v3_fwd_instantiations, v3_fwd_names)

SERIAL_FILE = "ladder/attention/flash_v3_fwd_serial.cu"
TABLES = [(ladder.V2_FWD_CONFIGS, attn.V2_FWD_CONFIG), (ladder.V2_DKDV_CONFIGS, attn.V2_DKDV_CONFIG),
          (ladder.V2_DQ_CONFIGS, attn.V2_DQ_CONFIG), (ladder.V3_FWD_CONFIGS, attn.V3_FWD_CONFIG),
          (ladder.V3_DKDV_CONFIGS, attn.V3_DKDV_CONFIG), (ladder.V3_DQ_CONFIGS, attn.V3_DQ_CONFIG)]


def _same(kernels, configs):
    """Order-free: the Python tables put the production default first, then the measured order."""
    return {hd: sorted(v) for hd, v in kernels.items()} == {hd: sorted(v) for hd, v in configs.items()}


# ------------------------------------------------------------------- CPU -----

def test_tables_start_with_the_production_defaults():
    for table, default in TABLES:
        assert set(table) == set(default)
        for hd, cfgs in table.items():
            assert cfgs[0] == default[hd] and len(set(cfgs)) == len(cfgs), (hd, cfgs)


def test_v2_tables_match_kernel_instantiations():
    fwd, dkdv, dq = v2_instantiations()
    assert fwd == ladder.V2_FWD_CONFIGS
    assert dkdv == ladder.V2_DKDV_CONFIGS
    assert dq == ladder.V2_DQ_CONFIGS
    bwd = runtime.KERNEL_DIR / "attention" / "flash_bwd.cu"
    assert {hd for (hd,) in instantiations(bwd, "FLASH_BWD_PRE")} == set(ladder.V2_FWD_CONFIGS)
    assert set(ladder.V2_DKDV_CONFIGS) == set(ladder.V2_DQ_CONFIGS) == set(ladder.V2_FWD_CONFIGS)
    check_v2_config_limits(ladder.V2_FWD_CONFIGS, ladder.V2_DKDV_CONFIGS, ladder.V2_DQ_CONFIGS)


def test_v3_backward_tables_match_kernel_instantiations():
    # fused-D dq kernels (FLASH_V3_DQF) are the table's (warpgroups, BN, V3_FD) entries, register-A
    # ones (FLASH_V3_*_RA) the (warpgroups, tile, V3_RA) entries
    dkdv, dq = v3_bwd_instantiations(fused_d=ladder.V3_FD)
    assert _same(dkdv, ladder.V3_DKDV_CONFIGS)
    assert _same(dq, ladder.V3_DQ_CONFIGS)
    assert set(ladder.V3_DKDV_CONFIGS) == set(ladder.V3_DQ_CONFIGS) <= set(ladder.V2_FWD_CONFIGS)
    check_v3_bwd_config_limits(ladder.V3_DKDV_CONFIGS, ladder.V3_DQ_CONFIGS,
                               dq_variants=((), (ladder.V3_FD,), (attn.V3_RA,)))


def test_v3_forward_tables_match_kernel_instantiations():
    assert v3_fwd_instantiations() == {hd: sorted(c) for hd, c in ladder.V3_FWD_CONFIGS.items()}
    assert v3_fwd_instantiations(SERIAL_FILE) == {hd: sorted(c) for hd, c in ladder.V3_SERIAL_FWD_CONFIGS.items()}
    for table in (ladder.V3_FWD_CONFIGS, ladder.V3_SERIAL_FWD_CONFIGS):
        assert set(table) <= set(ladder.V2_FWD_CONFIGS)   # v2 is the fallback for the same hd
        assert all(len(c) == (3 if table is ladder.V3_FWD_CONFIGS else 2) for cfgs in table.values() for c in cfgs)
        check_v3_fwd_config_limits(table)


@pytest.mark.skipif(runtime.cupy is None, reason="needs CuPy + NVRTC")
def test_v2_kernel_names_exist():
    rows = kernel_rows("90", "attention/classic.cu", "attention/flash_fwd.cu", "attention/flash_bwd.cu")
    assert not [r for r in rows if not r["ok"]]
    assert v2_names(ladder.V2_FWD_CONFIGS, ladder.V2_DKDV_CONFIGS, ladder.V2_DQ_CONFIGS) <= {r["kernel"] for r in rows}


@pytest.mark.skipif(runtime.cupy is None, reason="needs CuPy + NVRTC")
def test_v3_kernels_compile_for_sm90a_and_names_exist():
    """Every ladder config's kernel exists; the serial forward compiles without errors or spills.
    (The production files' compile and "serialized" checks: tests/test_attention.py.)"""
    bwd = kernel_rows("90a", "attention/flash_v3_bwd.cu")
    fwd = kernel_rows("90a", "attention/flash_v3_fwd.cu")
    serial = kernel_rows("90a", SERIAL_FILE)
    for rows in (bwd, fwd, serial):
        assert rows and not [r for r in rows if not r["ok"]], rows
    assert v3_bwd_names(ladder.V3_DKDV_CONFIGS, ladder.V3_DQ_CONFIGS, ladder.V3_VARIANT_SUFFIX) <= {
        r["kernel"] for r in bwd}
    assert v3_fwd_names(ladder.V3_FWD_CONFIGS) <= {r["kernel"] for r in fwd}
    assert v3_fwd_names(ladder.V3_SERIAL_FWD_CONFIGS) <= {r["kernel"] for r in serial}


# ------------------------------------------------------------------- GPU -----

FLASH_VARIANTS = ([("fwd", hd, c) for hd, cs in ladder.V2_FWD_CONFIGS.items() for c in cs[1:]]
                  + [("dkdv", hd, c) for hd, cs in ladder.V2_DKDV_CONFIGS.items() for c in cs[1:]]
                  + [("dq", hd, c) for hd, cs in ladder.V2_DQ_CONFIGS.items() for c in cs[1:]])


@pytest.mark.cuda
@pytest.mark.parametrize("variant", FLASH_VARIANTS, ids=lambda v: f"{v[0]}-hd{v[1]}-" + "-".join(map(str, v[2])))
def test_gpu_flash_tile_variants(rng, variant):
    """The non-default v2 tile configurations (timed by `bench attention --opt sweep=1`) are correct too."""
    cp = runtime.cupy
    kind, hd, cfg = variant
    B, NH, T = 2, 2, 301
    C = NH * hd
    qkv = make_qkv(rng, B, T, NH, hd, BF16, sigma=1.5)
    dout = rng.standard_normal((B, T, C)).astype(BF16)
    qkv_g, dout_g = cp.asarray(qkv), cp.asarray(dout)
    out, lse = poison((B, T, C), BF16), poison((B, NH, T), np.float32)
    attn.forward_v2(qkv_g, NH, out, lse, config=cfg if kind == "fwd" else None)
    ref_out, _ = attn.attention_forward_reference(qkv, NH)
    assert rel_err(to_cpu(out), ref_out) < 1e-2, locate(to_cpu(out), ref_out, B, T, NH, hd)
    dqkv = poison(qkv.shape, BF16)
    attn.backward_v2(dout_g, qkv_g, out, lse, NH, dqkv, dkdv_config=cfg if kind == "dkdv" else None,
                     dq_config=cfg if kind == "dq" else None)
    ref = attn.attention_backward_reference(dout, qkv, NH)
    d = to_cpu(dqkv)
    assert rel_err(d, ref) < 1e-2, locate(d, ref, B, T, NH, hd, S=3)


V3_VARIANTS = ([("dkdv", hd, c) for hd, cs in ladder.V3_DKDV_CONFIGS.items() for c in cs[1:]]
               + [("dq", hd, c) for hd, cs in ladder.V3_DQ_CONFIGS.items() for c in cs[1:]])


@pytest.mark.cuda
@pytest.mark.parametrize("variant", V3_VARIANTS, ids=lambda v: f"{v[0]}-hd{v[1]}-" + "-".join(map(str, v[2])))
@pytest.mark.parametrize("T", [100, 301])
def test_gpu_backward_v3_tile_variants(rng, variant, T):
    need_sm90()
    kind, hd, cfg = variant
    kw = {f"{kind}_config": cfg}
    check_v3_backward(rng, 2, 2, T, hd, lambda do, qkv, o, l, dqkv: ladder.backward_v3(do, qkv, o, l, 2, dqkv, **kw))


@pytest.mark.cuda
@pytest.mark.parametrize("hd", [64, 128])
def test_gpu_backward_v3_fused_d(rng, hd):
    """The fused-D dq configs (D computed by the dQ pass, then the dK/dV pass) are deterministic and
    within bf16 rounding of the production backward's one-stream result."""
    need_sm90()
    NH, qkv, dout, out, lse = v3_backward_case(rng, hd)
    one = v3_backward_bits(qkv, dout, out, lse, NH, streams=False)
    fd_configs = [c for c in ladder.V3_DQ_CONFIGS[hd] if attn.v3_variant(c) == ladder.V3_FD]
    assert fd_configs
    for cfg in fd_configs:
        fd = [v3_backward_bits(qkv, dout, out, lse, NH, backward=ladder.backward_v3, dq_config=cfg) for _ in range(2)]
        assert fd[0] == fd[1], cfg
        ref = np.frombuffer(one, dtype=BF16).astype(np.float32)
        got = np.frombuffer(fd[0], dtype=BF16).astype(np.float32)
        assert rel_err(got, ref) < 1e-2, cfg


V3_FWD_VARIANTS = ([("pipelined", hd, c) for hd, cs in ladder.V3_FWD_CONFIGS.items() for c in cs]
                   + [("serial", hd, c) for hd, cs in ladder.V3_SERIAL_FWD_CONFIGS.items() for c in cs])


@pytest.mark.cuda
@pytest.mark.parametrize("variant", V3_FWD_VARIANTS,
                         ids=lambda v: f"{v[0]}-hd{v[1]}-g{v[2][0]}-n{v[2][1]}" + "".join(f"-s{x}" for x in v[2][2:]))
@pytest.mark.parametrize("T", [1, 64, 100, 129, 301])
def test_gpu_forward_v3_tile_variants(rng, variant, T):
    need_sm90()
    kind, hd, cfg = variant
    check_v3_forward(rng, 2, 2, T, hd, forward=attn.forward_v3 if kind == "pipelined" else ladder.forward_v3_serial,
                     cfg=cfg)


@pytest.mark.cuda
@pytest.mark.parametrize("hd", [64, 128])
def test_gpu_forward_v3_serial_sharp_softmax(rng, hd):
    """Large scores (sigma 4): the running max changes often, exercising the O rescale."""
    need_sm90()
    check_v3_forward(rng, 1, 2, 300, hd, forward=ladder.forward_v3_serial, sigma=4.0)
