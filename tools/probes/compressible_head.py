"""Probe: the FP8 LM head's thinned dlogits in compressible memory (Compute Data Compression).

Ampere and Hopper can keep an allocation compressed in DRAM and the L2 ("generic" compression,
opted into per physical allocation through the driver's virtual-memory API: cuMemCreate with
allocFlags.compressionType = CU_MEM_ALLOCATION_COMP_GENERIC). With the default thinning the
classifier's E5M2 dlogits are ~97% zero bytes, and each 8192-row chunk's bytes cross DRAM ~5 times
(the classifier writes 412 MB, fp8_transpose reads them and writes the transpose, the dx and dwte
GEMMs read one each): ~16 GB of mostly zeros a d12 step. At the 700 W cap a step's time follows its
joules, and DRAM traffic is part of them. Nothing about the arithmetic changes: the same kernels
read and write the same bytes.

This measures one chunk of the head's backward (the real kernels at d12 shapes, realistic rows: a
Zipf-like prior plus noise, as tools/probes/head_sparse_dlogits.py) with dlogits8 and its transpose
in ordinary memory (CuPy's pool) and in compressible memory (gpucore/compressible.py), and the
logits chunk in either:
ms, joules, watts and clock of the chain classifier -> transpose -> dx GEMM -> dwte GEMM and of each
stage, back to back under NVML's counter; and checks that every output is bit for bit the same.

Run (GPU):  PYTHONPATH=. python3 tools/probes/compressible_head.py [seconds=1] [rounds=2] [p=1.2207e-4]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import compressible, power
from gpucore.ops.classifier import dlogits_fp8_scale, fused_classifier, sparse_tau_of
from gpucore.ops.fp8 import fp8_matmul, fp8_quantize, fp8_transpose

opts = dict(seconds="1", rounds="2", p=str(2.0 ** -13), a="1.0", s="3.0")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
R, V, Vp, C, TOKENS = 8192, 50257, 50304, 768, 65536
BF = gpucore.bfloat16


def rows(rng):
    """R realistic logit rows (bf16; the padding columns [V, Vp) zero, which the classifier ignores)
    and targets drawn from the rows' own distributions."""
    v = cp.arange(V, dtype=cp.float32)
    z = -float(opts["a"]) * cp.log1p(v)[None, :] + float(opts["s"]) * rng.standard_normal((R, V), dtype=cp.float32)
    p = cp.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    u = rng.random((R, 1), dtype=cp.float32)
    target = cp.minimum((cp.cumsum(p, axis=1) < u).sum(axis=1), V - 1).astype(cp.int32)
    logits = cp.zeros((R, Vp), BF)
    logits[:, :V] = z.astype(BF)
    return logits, target


def main():
    meter = power.require_meter()
    sync = cp.cuda.Device().synchronize
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: compressible memory offered: "
          f"{compressible.supported()}")
    rng = cp.random.default_rng(0)
    logits0, target = rows(rng)
    grad_scale = 1.0 / TOKENS
    s = dlogits_fp8_scale(grad_scale)
    tau = sparse_tau_of(float(opts["p"]), grad_scale, s)
    seed = cp.asarray([7], cp.uint32)
    lnf = rng.standard_normal((R, C), dtype=cp.float32).astype(BF)
    wte = (0.02 * rng.standard_normal((Vp, C), dtype=cp.float32)).astype(BF)
    one, inv = cp.ones(1, cp.float32), cp.asarray([1.0 / s], cp.float32)
    x8, w8t = cp.empty((R, C), cp.uint8), cp.empty((C, Vp), cp.uint8)
    fp8_quantize(lnf, "e4m3", cp.asarray([64.0], cp.float32), out=x8)
    fp8_quantize(wte.T.copy(), "e4m3", cp.asarray([4096.0], cp.float32), out=w8t)
    x8t = fp8_transpose(x8)
    losses = cp.empty(R, cp.float32)

    setups = {}
    for name, comp_d8, comp_logits in (("plain", False, False), ("compressed dlogits8", True, False),
                                       ("compressed all", True, True)):
        logits = compressible.empty((R, Vp), BF) if comp_logits else logits0.copy()
        logits[...] = logits0
        new = compressible.empty if comp_d8 else cp.empty
        d8, d8t = new((R, Vp), np.uint8), new((Vp, R), np.uint8)
        g_l, g8, g8t = (compressible.is_compressed(a) for a in (logits, d8, d8t))
        dx, dw = cp.empty((R, C), BF), cp.zeros((Vp, C), BF)
        print(f"{name}: compression granted -- logits {g_l}, dlogits8 {g8}, transpose {g8t}")

        def classify(logits=logits, d8=d8):
            fused_classifier(logits, target, vocab_size=V, grad_scale=grad_scale, losses=losses,
                             check_targets=False, dlogits8=d8, dlogits8_scale=s, write_dlogits=False,
                             sparse_tau=tau, sparse_seed=seed)

        def transpose(d8=d8, d8t=d8t):
            fp8_transpose(d8, out=d8t)

        def gemm_dx(d8=d8, dx=dx):
            fp8_matmul(d8, w8t, "e5m2", "e4m3", inv, one, out=dx)

        def gemm_dwte(d8t=d8t, dw=dw):
            fp8_matmul(d8t, x8t, "e5m2", "e4m3", inv, one, out=dw, accumulate=True)

        def chain(f=(classify, transpose, gemm_dx, gemm_dwte)):
            for g in f:
                g()

        dw[...] = 0
        chain()
        sync()
        setups[name] = dict(chain=chain, classifier=classify, transpose=transpose, dx=gemm_dx, dwte=gemm_dwte,
                            out=(d8.get(), d8t.get(), dx.get(), dw.get()))
    ref = setups["plain"]["out"]
    zeros = float(((ref[0] & 0x7F) == 0).mean())
    print(f"dlogits8: {zeros:.3f} zero bytes (tau {tau:g}: p < {float(opts['p']):.3g})")
    for name, st in setups.items():
        same = all(a.tobytes() == b.tobytes() for a, b in zip(st["out"], ref))
        print(f"{name}: outputs bit for bit the plain memory's: {same}")

    seconds, last = float(opts["seconds"]), {}
    for _ in range(int(opts["rounds"])):
        for stage in ("chain", "classifier", "transpose", "dx", "dwte"):
            for name, st in setups.items():
                power.measure(st[stage], meter, min_seconds=seconds / 3, sync=sync)     # settle
                last[(stage, name)] = power.measure(st[stage], meter, min_seconds=seconds, sync=sync)
    print(f"\none {R}-row chunk of the FP8 head's backward, round {opts['rounds']}, {seconds:g} s a row")
    print(f"{'stage':11s} {'memory':20s} {'ms':>8s} {'J/call':>8s} {'W':>5s} {'MHz':>5s} {'x vs plain':>10s}")
    for stage in ("chain", "classifier", "transpose", "dx", "dwte"):
        base = last[(stage, "plain")]
        for name in setups:
            r = last[(stage, name)]
            ms = 1e3 * r.seconds / r.calls
            print(f"{stage:11s} {name:20s} {ms:8.4f} {r.joules_per_call:8.4f} {r.watts:5.0f} {r.sm_mhz:5.0f} "
                  f"{(base.seconds / base.calls) / (r.seconds / r.calls):9.3f}x")


if __name__ == "__main__":
    main()
