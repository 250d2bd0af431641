"""Probe: would Hopper's 2:4 sparse tensor cores pay on the LM head's thinned dlogits?

The thinned dlogits (settings.fp8_lm_head_sparse: p < 2^-13 becomes 0 or 2^-13, unbiased) are ~97%
zeros, and the head's dx GEMM (dlnf = dlogits @ wte, K = V = 50304) multiplies them dense: 16% faster
at the 700 W cap than on dense rows, but every zero still goes through the tensor cores. Hopper's
sparse MMA (wgmma .sp: A in 2:4 form, half its K stored, 2 bits of metadata a kept value) does the
same GEMM with half the multiplies. Building that (a classifier writing 2:4 rows with an unbiased
choice of the survivors, our own sparse FP8 GEMM) is several sessions of work; this measures first,
with PyTorch's cuSPARSELt / CUTLASS bindings as the oracle (device machine only, never the package):

  - how often a group of 4 columns holds more than 2 nonzeros after thinning (what a 2:4 thinning
    would have to resample), on the realistic rows of tools/probes/head_sparse_dlogits.py;
  - the dx GEMM for one 8192-row chunk, ms / joules / W / MHz under NVML's counter at the cap:
    dense on thinned rows (today's data), dense on the same rows pruned to 2:4, and the 2:4 sparse
    GEMM on them (bf16: to_sparse_semi_structured, both backends; FP8 E4M3: _cslt_sparse_mm when
    the installed cuSPARSELt has it), beside our own FP8 dense GEMM (fp8_matmul, as the step runs it).

Run (GPU):  PYTHONPATH=. python3 tools/probes/sparse24_head.py [seconds=1] [rounds=2] [tau=1.220703125e-4]
"""
import sys

import cupy as cp
import numpy as np
import torch

import gpucore
from gpucore import power
from gpucore.ops.classifier import dlogits_fp8_scale
from gpucore.ops.fp8 import fp8_matmul, fp8_quantize

opts = dict(seconds="1", rounds="2", tau=str(2.0 ** -13), a="1.0", s="3.0")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
R, V, C, TOKENS = 8192, 50304, 768, 65536
BF = gpucore.bfloat16


def rows(gen):
    """p - onehot(target) for R rows shaped like a d12 model's (head_sparse_dlogits.py's generator)."""
    v = torch.arange(V, device="cuda", dtype=torch.float32)
    z = -float(opts["a"]) * torch.log1p(v)[None, :] + float(opts["s"]) * torch.randn((R, V), device="cuda", generator=gen)
    p = torch.softmax(z, dim=1)
    u = torch.rand((R, 1), device="cuda", generator=gen)
    target = torch.clamp((torch.cumsum(p, dim=1) < u).sum(dim=1), max=V - 1)
    loss = float(-torch.log(p[torch.arange(R), target] + 1e-30).mean())
    p[torch.arange(R), target] -= 1.0
    return p, loss


def thin(d, tau, gen):
    """The classifier's rule: |d| < tau -> sign(d) tau with probability |d| / tau, else 0."""
    small = d.abs() < tau
    keep = torch.rand(d.shape, device="cuda", generator=gen) * tau < d.abs()
    return torch.where(small, torch.where(keep, torch.sign(d) * tau, torch.zeros_like(d)), d)


def prune24(d):
    """Keep the 2 largest |values| of each group of 4 columns (timing only: not unbiased)."""
    g = d.reshape(R, V // 4, 4)
    idx = g.abs().topk(2, dim=2).indices
    mask = torch.zeros_like(g, dtype=torch.bool).scatter_(2, idx, True)
    return (g * mask).reshape(R, V)


def _search(comp, b, alpha):
    """cuSPARSELt's own search over its algorithms (0 when this torch has none)."""
    try:
        return int(torch._cslt_sparse_mm_search(comp, b, alpha=alpha))
    except Exception:                                               # noqa: BLE001
        return 0


def main():
    meter = power.require_meter()
    sync = torch.cuda.synchronize
    gen = torch.Generator(device="cuda").manual_seed(0)
    tau, grad_scale = float(opts["tau"]), 1.0 / TOKENS
    p, loss = rows(gen)
    d = thin(p, tau, gen)
    del p
    nz = (d != 0)
    per_group = nz.reshape(R, V // 4, 4).sum(dim=2)
    big = (d.abs() >= tau).reshape(R, V // 4, 4).sum(dim=2)
    print(f"rows: mean loss {loss:.3f}; thinned at tau {tau:g}: zeros {1 - nz.float().mean().item():.4f}, "
          f"nonzeros a row {nz.sum(dim=1).float().mean().item():.0f} (of them >= tau {(d.abs() >= tau).sum(dim=1).float().mean().item():.0f})")
    for k in range(5):
        print(f"  groups of 4 with {k} nonzeros: {(per_group == k).float().mean().item():.6f}"
              f"   ({k} values >= tau: {(big == k).float().mean().item():.6f})")
    d24 = prune24(d)
    lost = ((d - d24).abs().sum() / d.abs().sum()).item()
    print(f"  pruned to 2:4 (largest two kept): {lost:.2e} of the |mass| dropped")

    wte = 0.02 * torch.randn((V, C), device="cuda", generator=gen)
    dl, dl24 = (d * grad_scale).to(torch.bfloat16), (d24 * grad_scale).to(torch.bfloat16)
    dense_rand = (torch.randn((R, V), device="cuda", generator=gen) * 1e-5).to(torch.bfloat16)
    wb = wte.to(torch.bfloat16)
    del d, d24
    runs = {}
    out = torch.empty((R, C), device="cuda", dtype=torch.bfloat16)
    runs["bf16 dense, random rows"] = lambda: torch.mm(dense_rand, wb, out=out)
    runs["bf16 dense, thinned"] = lambda: torch.mm(dl, wb, out=out)
    runs["bf16 dense, thinned 2:4"] = lambda: torch.mm(dl24, wb, out=out)
    ref = torch.mm(dl24.float(), wb.float())
    try:
        from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured
        for backend, cutlass in (("cuSPARSELt", False), ("CUTLASS", True)):
            try:
                SparseSemiStructuredTensor._FORCE_CUTLASS = cutlass
                sp = to_sparse_semi_structured(dl24)
                y = torch.mm(sp, wb)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                print(f"  bf16 2:4 {backend}: relative error against the dense product {err:.2e}")
                runs[f"bf16 2:4 sparse ({backend})"] = (lambda sp=sp: torch.mm(sp, wb))
                if not cutlass:
                    comp16 = torch._cslt_compress(dl24)
                    alg = _search(comp16, wb, None)
                    runs[f"bf16 2:4 sparse (cuSPARSELt alg {alg})"] = (
                        lambda alg=alg: torch._cslt_sparse_mm(comp16, wb, alg_id=alg))
            except Exception as e:                                  # noqa: BLE001 -- report and go on
                print(f"  bf16 2:4 {backend}: unavailable ({type(e).__name__}: {str(e)[:160]})")
    except ImportError as e:
        print(f"  torch.sparse semi-structured: unavailable ({e})")

    # FP8: ours (E5M2 dlogits x E4M3 wte^T, as the step runs it) and cuSPARSELt's E4M3 when present
    s8 = cp.asarray([dlogits_fp8_scale(grad_scale)], cp.float32)
    d8, w8t = cp.empty((R, V), cp.uint8), cp.empty((C, V), cp.uint8)
    fp8_quantize(cp.from_dlpack(dl.float().contiguous()).astype(BF), "e5m2", s8, out=d8)
    fp8_quantize(cp.from_dlpack(wte.t().contiguous()).astype(BF), "e4m3", cp.asarray([2048.0], cp.float32), out=w8t)
    inv, winv = 1.0 / s8, cp.asarray([1.0 / 2048.0], cp.float32)
    d8p = cp.empty((R, V), cp.uint8)
    fp8_quantize(cp.from_dlpack(dl24.float().contiguous()).astype(BF), "e5m2", s8, out=d8p)
    dxo = cp.empty((R, C), BF)
    runs["fp8 ours dense, thinned 2:4"] = lambda: fp8_matmul(d8p, w8t, "e5m2", "e4m3", inv, winv, out=dxo,
                                                            fast_accum=True)
    runs["fp8 ours dense (e5m2 x e4m3), thinned"] = lambda: fp8_matmul(d8, w8t, "e5m2", "e4m3", inv, winv, out=dxo,
                                                                        fast_accum=True)
    try:
        a8 = (dl24.float() * TOKENS * 256).to(torch.float8_e4m3fn)
        b8 = (wte * 2048).to(torch.float8_e4m3fn)                    # (V, C) row-major = (K, N)
        sa, sb = torch.tensor(1.0 / (TOKENS * 256), device="cuda"), torch.tensor(1.0 / 2048, device="cuda")
        bt = b8.t().contiguous().t()                                 # column-major (K, N) for _scaled_mm
        runs["fp8 torch dense e4m3, thinned 2:4"] = lambda: torch._scaled_mm(a8, bt, sa, sb, out_dtype=torch.bfloat16,
                                                                            use_fast_accum=True)
        comp = torch._cslt_compress(a8)
        for layout, bm in (("B row-major", b8), ("B column-major", bt)):
            try:
                alg = _search(comp, bm, sa * sb)
                y = torch._cslt_sparse_mm(comp, bm, alpha=sa * sb, out_dtype=torch.bfloat16, alg_id=alg)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                print(f"  fp8 e4m3 2:4 cuSPARSELt, {layout}, alg {alg}: relative error against the bf16 product {err:.2e}")
                runs[f"fp8 e4m3 2:4 sparse ({layout})"] = (
                    lambda bm=bm, alg=alg: torch._cslt_sparse_mm(comp, bm, alpha=sa * sb, out_dtype=torch.bfloat16,
                                                                  alg_id=alg))
            except Exception as e:                                  # noqa: BLE001
                print(f"  fp8 2:4 {layout}: unavailable ({type(e).__name__}: {str(e)[:120]})")
    except Exception as e:                                          # noqa: BLE001
        print(f"  fp8 2:4: unavailable ({type(e).__name__}: {str(e)[:200]})")

    def both_sync():
        torch.cuda.synchronize()
        cp.cuda.Device().synchronize()

    seconds, last = float(opts["seconds"]), {}
    for _ in range(int(opts["rounds"])):
        for name, fn in runs.items():
            power.measure(fn, meter, min_seconds=seconds / 2, sync=both_sync)
            last[name] = power.measure(fn, meter, min_seconds=seconds, sync=both_sync)
    flops = 2.0 * R * V * C
    print(f"\nthe head's dx GEMM for one {R}-row chunk ({R} x {V} x {C}), {seconds:g} s a variant, last of "
          f"{opts['rounds']} rounds; TFLOP/s counts the dense multiply-adds")
    print(f"{'variant':40s} {'ms':>7s} {'TFLOP/s':>8s} {'mJ/call':>8s} {'W':>5s} {'MHz':>5s}")
    for name, r in last.items():
        ms = 1e3 * r.seconds / r.calls
        print(f"{name:40s} {ms:7.4f} {flops / ms / 1e9:8.0f} {1e3 * r.joules_per_call:8.2f} {r.watts:5.0f} {r.sm_mhz:5.0f}")
    print(f"torch {torch.__version__}, cuSPARSELt {getattr(torch.backends, 'cusparselt', None) and torch.backends.cusparselt.version()}")


if __name__ == "__main__":
    main()
