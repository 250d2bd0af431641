"""`gpucore bench attention`: causal attention forward/backward in TFLOP/s, v1 (classic) vs v2 (flash).

Shape (issue 5): B=64, NH=12, T=1024, hd=64 (GPT-2 124M at batch 64), bf16.
FLOPs counted the usual way for causal attention: forward = 4*B*NH*T*T*hd / 2
(Q K^T and P V over the lower triangle), backward = 2.5 x forward (5 matmuls).
v2's two-pass deterministic backward actually does 7 matmul-equivalents, so its
real tensor-core rate is 1.4x the printed backward number.
Targets (H100/H200): v2 forward >= 300 TFLOP/s and backward >= 200 TFLOP/s; the
rows show them as the reference ("% of ref", PASS/FAIL at 100%).
`scratch` is the device memory one call takes from CuPy's pool beyond its
inputs and outputs, measured with a memory hook: v1 holds (B, NH, T, T) score
matrices, v2 only D = rowsum(dout * out) (B, NH, T) in the backward.
v3 backward rows (wgmma, sm_90 only; run on v2 forward's out/lse) come with
--version all or a list containing 3; with --opt sweep=1 also per V3_*_CONFIGS entry.
v3 forward rows (wgmma, sm_90 only, target 300) likewise; sweep=1 adds one per V3_FWD_CONFIGS entry.
Options: --version all|1|2, --dtype bfloat16|float32 (float32 runs v1 only),
--opt B=.. NH=.. T=.. hd=.., --opt sweep=1 also times every v2 tile configuration
(gpucore.ops.attention FWD_CONFIGS / DKDV_CONFIGS / DQ_CONFIGS; the first of each is
the default) so the best can be made the default from one run.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, runtime
from ..ops import attention as attn
from . import Result, benchmark, time_ms

FWD_TARGET_TFLOPS = 300.0
BWD_TARGET_TFLOPS = 200.0


def _peak_hook():
    import cupy

    class PeakHook(cupy.cuda.MemoryHook):
        name = "gpucore_bench_peak"

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
    with _peak_hook() as hook:
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
    if sweep and 2 in versions and hd in attn.FWD_CONFIGS:
        results += _sweep(qkv, dout, out, lse, dqkv, NH, hd, flops_f, flops_b)
    if dt == dtypes.bfloat16 and hd in attn.V3_FWD_CONFIGS and (
            version in (None, "all") or "3" in str(version).split(",")):
        results += _v3_forward_rows(qkv, out, lse, NH, hd, flops_f, shape, sweep, results)
    want3 = version in (None, "all") or "3" in str(version).split(",")
    have3 = any(r.name.startswith("attention v3 backward") for r in results)   # from --version 3's loop
    if (want3 and dt == dtypes.bfloat16 and hd in attn.V3_DKDV_CONFIGS
            and runtime.device_arch() == attn.V3_ARCH[:-1] and (sweep or not have3)):
        results += _v3_backward_rows(qkv, dout, out, lse, dqkv, NH, hd, flops_b, shape, sweep, not have3)
    return results


def _v3_backward_rows(qkv, dout, out, lse, dqkv, NH, hd, flops_b, shape, sweep, main_row=True):
    """Version 3 backward (wgmma, sm_90) on v2 forward's out/lse (the default configs' row unless
    main_row is False); with sweep, every tile config."""
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
        for kind, table in (("dkdv", attn.V3_DKDV_CONFIGS), ("dq", attn.V3_DQ_CONFIGS)):
            for cfg in table[hd]:
                kw = {"dkdv_cfg" if kind == "dkdv" else "dq_cfg": cfg}
                ms = time_ms(lambda: attn._backward_v3(dout, qkv, out, lse, NH, dqkv, **kw))
                tile = "BM" if kind == "dkdv" else "BN"
                fused = {0: "", attn.V3_FD: " (D fused into dq)", attn.V3_RA: " (register A)"}[attn._v3_variant(cfg)]
                rows.append(Result(f"  v3 backward {kind} warpgroups={cfg[0]} {tile}={cfg[1]}{fused}", ms, flops=flops_b,
                                   ref_tflops=BWD_TARGET_TFLOPS, target=1.0))
    return rows


def _sweep(qkv, dout, out, lse, dqkv, NH, hd, flops_f, flops_b):
    """Every v2 tile configuration: forward per FWD_CONFIGS entry, backward varying one pass at a time."""
    rows = []
    for cfg in attn.FWD_CONFIGS[hd]:
        ms = time_ms(lambda: attn._forward_v2(qkv, NH, out, lse, cfg=cfg))
        rows.append(Result(f"  v2 forward warps={cfg[0]} rows/warp={16 * cfg[1]} BN={cfg[2]}", ms, flops=flops_f,
                           ref_tflops=FWD_TARGET_TFLOPS, target=1.0))
    for kind, table in (("dkdv", attn.DKDV_CONFIGS), ("dq", attn.DQ_CONFIGS)):
        for cfg in table[hd]:
            kw = {"dkdv_cfg" if kind == "dkdv" else "dq_cfg": cfg}
            ms = time_ms(lambda: attn._backward_v2(dout, qkv, out, lse, NH, dqkv, **kw))
            tile = "BM" if kind == "dkdv" else "BN"
            rows.append(Result(f"  v2 backward {kind} warps={cfg[0]} {tile}={cfg[1]}", ms, flops=flops_b,
                               ref_tflops=BWD_TARGET_TFLOPS, target=1.0))
    return rows


def _v3_forward_rows(qkv, out, lse, NH, hd, flops_f, shape, sweep, results):
    """Version 3 forward (wgmma, sm_90 only; target 300 TFLOP/s); with sweep, every V3_FWD_CONFIGS entry."""
    from .. import runtime as _rt
    if _rt.device_arch() != attn.V3_FWD_ARCH[:-1]:
        return []
    rows = []
    if not any(r.name.startswith("attention v3 forward") for r in results):
        fwd = lambda: attn._forward_v3(qkv, NH, out, lse)  # noqa: E731
        fwd()                                    # compile before measuring
        rows.append(Result(f"attention v3 forward {shape}", time_ms(fwd), flops=flops_f,
                           ref_tflops=FWD_TARGET_TFLOPS, target=1.0, extra={"scratch": _mib(0)}))
    if sweep:
        for cfg in attn.V3_FWD_CONFIGS[hd]:
            ms = time_ms(lambda: attn._forward_v3(qkv, NH, out, lse, cfg=cfg))
            stages = f" stages={cfg[2]} (pipelined)" if len(cfg) > 2 else ""
            rows.append(Result(f"  v3 forward warpgroups={cfg[0]} BN={cfg[1]}{stages}", ms, flops=flops_f,
                               ref_tflops=FWD_TARGET_TFLOPS, target=1.0))
    return rows
