"""Probe: the FP8 classifier's thinned E5M2 rows with the skim (packs decided in logit space, no exp)
against another tree's kernel (OLD_TREE, e.g. `.base` from `git archive`).

One 8192-row LM-head chunk (d12's), V = 50257 (Vp 50304), rows of two spreads: a Zipf-like prior plus
N(0, noise^2) (noise 3: tools/probes/classifier_sparse_cost.py's rows; noise 1.5: peakier). Prints:
  - each kernel's time alone (interleaved medians), the dense kernel beside them;
  - the share of packs the skim sends down the exact path (a value near or above tau, the target's,
    the padding's);
  - how the new bytes differ from the old ones, and whether both stay unbiased: over the values
    below tau, (sum of the thinned values - sum of the dense ones) / its standard error (|z| < ~4).
Run (GPU):  PYTHONPATH=. python3 tools/probes/classifier_skim.py OLD_TREE
"""
import sys
from pathlib import Path

import cupy as cp
import numpy as np

import gpucore
from gpucore import runtime
from gpucore.bench import time_interleaved
from gpucore.ops import classifier as cls

old_tree = Path(sys.argv[1]).resolve()
R, V, Vp, TOKENS = 8192, 50257, 50304, 65536
n_packs = Vp // 8
K = cls._v3_k(n_packs)
gs = 1.0 / TOKENS
s8 = cls.dlogits_fp8_scale(gs)
tau = cls.sparse_tau_of(2.0 ** -13, gs, s8)
seed = cp.asarray([7], np.uint32)


def fp8_kernel(tree):
    mod = runtime.load_module(tree / "kernels_cu/classifier.cu")
    k = mod.get_function(f"classifier_backward_fp8_kernel_v3_k{K}_bf16")
    k.max_dynamic_shared_size_bytes = n_packs * 16
    k.preferred_shared_memory_carveout = 100
    return k


def e5m2_to_f32(b):
    """E5M2 bytes -> float32: an E5M2 byte is the top byte of an f16."""
    return (b.astype(cp.uint16) << 8).view(cp.float16).astype(cp.float32)


kernels = {"old": fp8_kernel(old_tree), "new": fp8_kernel(Path(__file__).resolve().parents[2])}
grid = cls.v3_fp8_grid(kernels["new"], R, n_packs)
rng = cp.random.default_rng(0)
targets = cp.asarray(np.random.default_rng(1).integers(0, 200, R).astype(np.int32))   # frequent tokens
for noise in (3.0, 1.5):
    z = -cp.log1p(cp.arange(Vp, dtype=cp.float32))[None, :] + noise * rng.standard_normal((R, Vp), dtype=cp.float32)
    z[:, V:] = -30.0
    logits = z.astype(gpucore.bfloat16)
    del z
    losses = cp.empty(R, np.float32)
    outs = {name: cp.empty((R, Vp), cp.uint8) for name in ("old", "new", "dense")}

    def run(name, tau_):
        k = kernels["old" if name == "dense" else name]
        runtime.launch(k, grid, 512, (losses, logits, outs[name], targets, np.float32(gs), np.float32(s8),
                                      np.int32(R), np.int32(V), np.int32(Vp), np.int32(0), np.float32(tau_),
                                      seed, np.int32(0)), shared_mem=n_packs * 16)

    fns = [lambda: run("old", tau), lambda: run("new", tau), lambda: run("dense", 0.0)]
    for f in fns:
        f()
    ms = time_interleaved(fns, rounds=9)
    # the dense dlogits, scaled, from the bf16 kernel (v = bf16 dlogits * s8, exact: s8 a power of two)
    work = logits.copy()
    bwd = runtime.load_module(old_tree / "kernels_cu/classifier.cu").get_function(f"classifier_backward_kernel_v3_k{K}_bf16")
    bwd.max_dynamic_shared_size_bytes = n_packs * 16
    runtime.launch(bwd, R, 512, (losses, work, targets, np.float32(gs), np.int32(R), np.int32(V), np.int32(Vp),
                                 np.float32(0), np.uint64(0), np.int32(0)), shared_mem=n_packs * 16)
    v = (work.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32) * np.float32(s8)
    lf = logits.astype(cp.float32)
    lse = losses + lf[cp.arange(R), targets]
    base = lse + np.float32(np.log(tau / (gs * s8)))
    pmax = lf[:, :n_packs * 8].reshape(R, n_packs, 8).max(axis=2)
    exact = pmax >= (base[:, None] - 1 / 64)
    exact[:, (V // 8):] = True
    exact[cp.arange(R), targets // 8] = True
    print(f"noise {noise}: old thinned {ms[0]:.4f} ms, new (skim) {ms[1]:.4f} ms (x{ms[0] / ms[1]:.3f}), "
          f"dense {ms[2]:.4f} ms; packs on the exact path {float(exact.mean()) * 100:.2f}%, "
          f"values >= tau {float((v >= tau).mean()) * 100:.2f}%")
    small = (cp.abs(v) < tau * 0.98)
    var = float((cp.abs(v) * (tau - cp.abs(v)))[small].sum())
    for name in ("old", "new"):
        got = e5m2_to_f32(outs[name])
        zs = float((got - v)[small].sum()) / np.sqrt(var)
        print(f"  {name}: zeros {float((outs[name] == 0).mean()) * 100:.2f}%, bias over the small values "
              f"z = {zs:+.2f}")
    diff = outs["new"] != outs["old"]
    print(f"  new vs old bytes: {float(diff.mean()) * 100:.4f}% differ; on the exact path's packs "
          f"{int((diff.reshape(R, n_packs, 8).any(axis=2) & exact).sum())} packs differ (0 expected)")
    del logits, work, v, lf, pmax, exact, outs
