"""`gpucore bench attention`: causal attention forward/backward in TFLOP/s, v1 / v2 / v3.

Shape (issue 5): B=64, NH=12, T=1024, hd=64 (GPT-2 124M at batch 64), bf16.
FLOPs counted the usual way for causal attention: forward = 4*B*NH*T*T*hd / 2
(Q K^T and P V over the lower triangle), backward = 2.5 x forward (5 matmuls).
The flash backwards' two deterministic passes actually do 7 matmul-equivalents, so
their real tensor-core rate is 1.4x the printed backward number.
Targets (H100/H200): forward >= 300 TFLOP/s and backward >= 200 TFLOP/s; the flash
rows show them as the reference ("% of ref", PASS/FAIL at 100%).
`scratch` is the device memory one call takes from CuPy's pool beyond its
inputs and outputs, measured with a memory hook (`peak_hook`): v1 holds
(B, NH, T, T) score matrices, v2/v3 only D = rowsum(dout * out) (B, NH, T) in the backward.

Rows: --version all (default) runs v1 and v2 through the public API, then the v3 rows
(Hopper wgmma, sm_90 GPUs only): the v3 forward, and the v3 backward on v2 forward's
out/lse. --version 1,2,3 (any list) runs those versions forward and backward.
--dtype bfloat16|float32 (float32 runs v1 only); --opt B=.. NH=.. T=.. hd=..
--opt sweep=1 adds a row per tile configuration of gpucore/ladder/attention.py (the
production default first): v2 forward / dK/dV / dQ (with v2 in the versions), the v3
pipelined and serial forwards, the v3 dK/dV and dQ passes (fused D included), so the best
can be made the default (ops/attention.py's *_CONFIG tables) from one run.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, runtime
from ..ladder import attention as ladder
from ..ops import attention as attn
from . import Result, benchmark, time_ms

FWD_TARGET_TFLOPS = 300.0
BWD_TARGET_TFLOPS = 200.0


def peak_hook():
    """A CuPy memory hook, used as `with peak_hook() as h: ...`: h.peak is the most bytes held
    from CuPy's pool at once inside the block, counted from its start (what a call allocates)."""
    import cupy

    class PeakHook(cupy.cuda.MemoryHook):
        name = "gpucore_peak_alloc"

        def __init__(self):
            self.cur = self.peak = 0

        def malloc_postprocess(self, **kw):
            self.cur += kw["mem_size"]
            self.peak = max(self.peak, self.cur)

        def free_postprocess(self, **kw):
            self.cur -= kw["mem_size"]

    return PeakHook()


def _measure_scratch(fn) -> int:
    import cupy
    cupy.cuda.get_current_stream().synchronize()
    with peak_hook() as hook:
        fn()
    cupy.cuda.get_current_stream().synchronize()
    return hook.peak


def _mib(n):
    return f"{n / 2**20:.1f}MiB"


@benchmark("attention")
def bench_attention(B: int = 64, NH: int = 12, T: int = 1024, hd: int = 64, version="all",
                    dtype: str = "bfloat16", sweep: int = 0, **_):
    import cupy

    import gpucore
    dt = dtypes.normalize(dtype)
    versions = [1, 2] if version in (None, "all") else [int(v) for v in str(version).split(",")]
    if dt != dtypes.bfloat16:
        versions = [v for v in versions if v == 1]
    C = NH * hd
    qkv = cupy.random.standard_normal((B, T, 3 * C), dtype=np.float32).astype(dt)
    dout = cupy.random.standard_normal((B, T, C), dtype=np.float32).astype(dt)
    out = cupy.empty((B, T, C), dtype=dt)
    lse = cupy.empty((B, NH, T), dtype=np.float32)
    dqkv = cupy.empty_like(qkv)
    flops_f = 4.0 * B * NH * T * T * hd / 2
    flops_b = 2.5 * flops_f
    shape = f"B={B} NH={NH} T={T} hd={hd} {dtypes.name(dt)}"
    results = []
    for v in versions:
        fwd = lambda: gpucore.attention_forward(qkv, NH, out=out, lse=lse, version=v)  # noqa: E731
        bwd = lambda: gpucore.attention_backward(dout, qkv, out, lse, NH, dqkv=dqkv, version=v)  # noqa: E731
        fwd()
        bwd()                                    # compile + warm the pool before measuring
        s_f, s_b = _measure_scratch(fwd), _measure_scratch(bwd)
        ms_f = time_ms(fwd)
        ms_b = time_ms(bwd)
        tgt = {} if v == 1 else {"target": 1.0}
        results.append(Result(f"attention v{v} forward {shape}", ms_f, flops=flops_f,
                              ref_tflops=FWD_TARGET_TFLOPS, extra={"scratch": _mib(s_f)}, **tgt))
        results.append(Result(f"attention v{v} backward {shape}", ms_b, flops=flops_b,
                              ref_tflops=BWD_TARGET_TFLOPS, extra={"scratch": _mib(s_b)}, **tgt))
        cupy.get_default_memory_pool().free_all_blocks()   # v1's score matrices are GBs
    if sweep and 2 in versions and hd in ladder.V2_FWD_CONFIGS:
        results += _v2_sweep(qkv, dout, out, lse, dqkv, NH, hd, flops_f, flops_b)
    want3 = version in (None, "all") or "3" in str(version).split(",")
    v3_here = want3 and dt == dtypes.bfloat16 and runtime.device_arch() == attn.V3_ARCH[:-1]
    if v3_here and hd in attn.V3_FWD_CONFIG:
        results += _v3_forward_rows(qkv, out, lse, NH, hd, flops_f, shape, sweep, results)
    have3 = any(r.name.startswith("attention v3 backward") for r in results)   # from --version 3's loop
    if v3_here and hd in attn.V3_DKDV_CONFIG and (sweep or not have3):
        results += _v3_backward_rows(qkv, dout, out, lse, dqkv, NH, hd, flops_b, shape, sweep, not have3)
    return results


def _v2_sweep(qkv, dout, out, lse, dqkv, NH, hd, flops_f, flops_b):
    """Every v2 tile configuration: forward per V2_FWD_CONFIGS entry, backward varying one pass at a time."""
    rows = []
    for cfg in ladder.V2_FWD_CONFIGS[hd]:
        ms = time_ms(lambda: attn.forward_v2(qkv, NH, out, lse, config=cfg))
        rows.append(Result(f"  v2 forward warps={cfg[0]} rows/warp={16 * cfg[1]} BN={cfg[2]}", ms, flops=flops_f,
                           ref_tflops=FWD_TARGET_TFLOPS, target=1.0))
    for kind, table in (("dkdv", ladder.V2_DKDV_CONFIGS), ("dq", ladder.V2_DQ_CONFIGS)):
        for cfg in table[hd]:
            kw = {f"{kind}_config": cfg}
            ms = time_ms(lambda: attn.backward_v2(dout, qkv, out, lse, NH, dqkv, **kw))
            tile = "BM" if kind == "dkdv" else "BN"
            rows.append(Result(f"  v2 backward {kind} warps={cfg[0]} {tile}={cfg[1]}", ms, flops=flops_b,
                               ref_tflops=BWD_TARGET_TFLOPS, target=1.0))
    return rows


def _v3_forward_rows(qkv, out, lse, NH, hd, flops_f, shape, sweep, results):
    """Version 3 forward (sm_90; target 300 TFLOP/s), the default config's row unless --version 3's
    loop made it; with sweep, every pipelined (V3_FWD_CONFIGS) and serial (V3_SERIAL_FWD_CONFIGS) config."""
    rows = []
    if not any(r.name.startswith("attention v3 forward") for r in results):
        fwd = lambda: attn.forward_v3(qkv, NH, out, lse)  # noqa: E731
        fwd()                                    # compile before measuring
        rows.append(Result(f"attention v3 forward {shape}", time_ms(fwd), flops=flops_f,
                           ref_tflops=FWD_TARGET_TFLOPS, target=1.0, extra={"scratch": _mib(0)}))
    if sweep:
        runs = ([(cfg, f" stages={cfg[2]} (pipelined)", attn.forward_v3) for cfg in ladder.V3_FWD_CONFIGS[hd]]
                + [(cfg, "", ladder.forward_v3_serial) for cfg in ladder.V3_SERIAL_FWD_CONFIGS.get(hd, [])])
        for cfg, label, fn in runs:
            ms = time_ms(lambda: fn(qkv, NH, out, lse, config=cfg))
            rows.append(Result(f"  v3 forward warpgroups={cfg[0]} BN={cfg[1]}{label}", ms, flops=flops_f,
                               ref_tflops=FWD_TARGET_TFLOPS, target=1.0))
    return rows


def _v3_backward_rows(qkv, dout, out, lse, dqkv, NH, hd, flops_b, shape, sweep, main_row=True):
    """Version 3 backward (sm_90) on v2 forward's out/lse (the default configs' row unless
    main_row is False); with sweep, every V3_DKDV_CONFIGS / V3_DQ_CONFIGS entry."""
    import gpucore
    gpucore.attention_forward(qkv, NH, out=out, lse=lse, version=2)
    bwd = lambda: gpucore.attention_backward(dout, qkv, out, lse, NH, dqkv=dqkv, version=3)  # noqa: E731
    bwd()                                        # compile before measuring
    rows = []
    if main_row:
        s_b = _measure_scratch(bwd)
        rows.append(Result(f"attention v3 backward {shape}", time_ms(bwd), flops=flops_b,  # default configs
                           ref_tflops=BWD_TARGET_TFLOPS, target=1.0, extra={"scratch": _mib(s_b)}))
    if sweep:
        labels = {0: "", ladder.V3_FD: " (D fused into dq)", attn.V3_RA: " (register A)"}
        for kind, table in (("dkdv", ladder.V3_DKDV_CONFIGS), ("dq", ladder.V3_DQ_CONFIGS)):
            for cfg in table[hd]:
                kw = {f"{kind}_config": cfg}
                ms = time_ms(lambda: ladder.backward_v3(dout, qkv, out, lse, NH, dqkv, **kw))
                tile = "BM" if kind == "dkdv" else "BN"
                rows.append(Result(f"  v3 backward {kind} warpgroups={cfg[0]} {tile}={cfg[1]}"
                                   f"{labels[attn.v3_variant(cfg)]}", ms, flops=flops_b,
                                   ref_tflops=BWD_TARGET_TFLOPS, target=1.0))
    return rows
