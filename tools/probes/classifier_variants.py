"""Probe: the fused classifier's v3 kernels of this tree against another tree's (OLD_TREE, e.g. `.base`
from `git archive`), at the LM head's chunk shape (8192 x 50304 bf16, GPT-2's padded vocabulary):
bf16 dlogits in place, the FP8-only variant (E5M2 dlogits8, logits left alone: --dtype fp8's LM head)
and cross_entropy (the loss alone). Timed in alternation (medians), with GB/s of the bytes each moves;
then how far this tree's outputs are from the old tree's (losses, dlogits in bf16 ulps, E5M2 bytes).
Run:  PYTHONPATH=. python3 tools/probes/classifier_variants.py OLD_TREE [N=8192]
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
N = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
V, Vp = 50257, 50304
n_packs = Vp // 8
K = cls._v3_k(n_packs)
gs = 1.0 / (64 * 1024)
s8 = cls.dlogits_fp8_scale(gs)
rng = np.random.default_rng(0)
# logits of a half-trained model: a spread of a few units, some large outliers
logits0 = cp.asarray((rng.standard_normal((N, Vp)) * 2.5).astype(np.float32).astype(gpucore.bfloat16))
targets = cp.asarray(rng.integers(0, V, N).astype(np.int32))


def kernels(tree):
    mod = runtime.load_module(tree / "kernels_cu/classifier.cu")
    ks = (mod.get_function(f"classifier_backward_kernel_v3_k{K}_bf16"),
          mod.get_function(f"classifier_backward_fp8_kernel_v3_k{K}_bf16"),
          mod.get_function(f"classifier_forward_kernel_v3_k{K}_bf16"))
    for k in ks:
        k.max_dynamic_shared_size_bytes = n_packs * 16
        k.preferred_shared_memory_carveout = 100
    return ks


def refill(work):
    work.data.copy_from_device(logits0.data, logits0.nbytes)


def f32(a):
    """bf16 (as stored) -> float32, on the device."""
    return (a.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)


def runs(ks):
    work, d8, losses = cp.empty_like(logits0), cp.empty((N, Vp), np.uint8), cp.empty(N, np.float32)
    seed0 = np.uint64(0)                # the kernels' sparse_seed, null (unread: sparse_tau = 0); older trees ignore it
    bwd, fp8, fwd = ks
    smem = n_packs * 16
    common = (np.int32(N), np.int32(V), np.int32(Vp))
    return work, d8, losses, {
        "bf16 dlogits in place": lambda: runtime.launch(bwd, N, 512, (losses, work, targets, np.float32(gs)) + common
                                                        + (np.float32(0), seed0, np.int32(0)),   # dense
                                                        shared_mem=smem),
        "FP8 only (E5M2 dlogits8)": lambda: runtime.launch(fp8, N, 512, (losses, logits0, d8, targets, np.float32(gs),
                                                                          np.float32(s8)) + common + (np.int32(0),)
                                                          + (np.float32(0), seed0, np.int32(0)),   # dense
                                                          shared_mem=smem),
        "cross_entropy (loss only)": lambda: runtime.launch(fwd, N, 512, (losses, logits0, targets) + common,
                                                            shared_mem=smem),
    }


trees = {"old": kernels(old_tree), "new": kernels(Path(__file__).resolve().parents[2])}
state = {name: runs(ks) for name, ks in trees.items()}
nbytes = {"bf16 dlogits in place": 4, "FP8 only (E5M2 dlogits8)": 3, "cross_entropy (loss only)": 2}
labels, fns = [], []
for kind in nbytes:
    for name in trees:
        work = state[name][0]
        labels.append((kind, name))
        # the in-place kernel rewrites its input: refill before each call (timed with it, same for both)
        fns.append((lambda f=state[name][3][kind], w=work: (refill(w), f()))
                   if kind.startswith("bf16") else state[name][3][kind])
ms = time_interleaved(fns, rounds=9)
copy_ms = time_interleaved([lambda: refill(state["old"][0])], rounds=9)[0]
print(f"N={N} Vp={Vp} K={K} (bf16 rows of {Vp * 2} bytes); a refill copy of the logits: {copy_ms:.4f} ms")
for (kind, name), t in zip(labels, ms):
    t_k = t - copy_ms if kind.startswith("bf16") else t
    gbs = nbytes[kind] * N * Vp / t_k / 1e6
    print(f"{kind:<28s} {name}: {t_k:8.4f} ms  {gbs:7.1f} GB/s" + ("  (refill copy subtracted)" if kind.startswith("bf16") else ""))

# accuracy: this tree against the old one
out = {}
for name in trees:
    work, d8, losses, f = state[name]
    refill(work)
    f["bf16 dlogits in place"]()
    l_bf16, d_bf16 = losses.copy(), work.view(cp.uint16).copy()
    f["FP8 only (E5M2 dlogits8)"]()
    l_fp8, b8 = losses.copy(), d8.copy()
    f["cross_entropy (loss only)"]()
    out[name] = (l_bf16, d_bf16, l_fp8, b8, losses.copy())
o, n = out["old"], out["new"]
rel = lambda a, b: float(cp.abs(a - b).max() / cp.abs(b).max())
print(f"losses: max rel diff (bf16 kernel) {rel(n[0], o[0]):.2e}, (FP8) {rel(n[2], o[2]):.2e}, "
      f"(cross_entropy) {rel(n[4], o[4]):.2e}")
ob, nb = o[1].view(cp.int16).astype(cp.int32), n[1].view(cp.int16).astype(cp.int32)
ulps = cp.abs(nb - ob)
fo, fn = f32(o[1]), f32(n[1])
print(f"bf16 dlogits: {float((ulps != 0).mean()) * 100:.3f}% of values differ, max {int(ulps.max())} ulp(s); "
      f"rel Frobenius diff {float(cp.linalg.norm(fn - fo) / cp.linalg.norm(fo)):.2e}")
d8diff = cp.abs(n[3].astype(np.int32) - o[3].astype(np.int32))
print(f"E5M2 dlogits8: {float((d8diff != 0).mean()) * 100:.3f}% of bytes differ, max {int(d8diff.max())} step(s)")
