"""Probe: the FP8 LM head's classifier kernel (E5M2 dlogits only, thinned: the --dtype fp8 default) of
this tree against another tree's, on one 8192-row chunk of realistic rows.

Why: the kernel runs at the 700 W cap on an H200, where its joules, not its bytes, set its time, so
a change of its instructions is measured alone (interleaved medians) and at the cap (each variant
1 s a round under NVML's energy counter, 2 rounds, alternating). It also prints how many E5M2 bytes
differ between the two trees and the losses' largest relative difference.
Used for the fifty-ninth session's f16 rows (tools/notes/fp8.md): OLD is the tree before them.
Run (GPU):  OLD=.base PYTHONPATH=. python3 tools/probes/classifier_fp8_ab.py
(the other tree's classifier.cu is compiled with this tree's headers first on the include path.)
"""
import os
from pathlib import Path

import cupy as cp
import numpy as np

import gpucore
from gpucore import power, runtime
from gpucore.bench import time_interleaved
from gpucore.ops.classifier import V3_BLOCK, _v3_k, dlogits_fp8_scale, sparse_tau_of, v3_fp8_grid
from gpucore.settings import current

OLD = Path(os.environ.get("OLD", ".base")).resolve()
R, V, Vp = 8192, 50257, 50304
n_packs = Vp // 8
name = f"classifier_backward_fp8_kernel_v3_k{_v3_k(n_packs)}_bf16"
kernels = {"old": runtime.load_module(str(OLD / "kernels_cu" / "classifier.cu")).get_function(name),
           "new": runtime.get_kernel("classifier", name)}
for k in kernels.values():
    k.max_dynamic_shared_size_bytes = n_packs * 16
    k.preferred_shared_memory_carveout = 100

rng = cp.random.default_rng(0)    # Zipf-like rows: a token's logit falls with its rank, plus noise
z = -cp.log1p(cp.arange(Vp, dtype=cp.float32))[None, :] + 3.0 * rng.standard_normal((R, Vp), dtype=cp.float32)
z[:, V:] = -30.0
logits = z.astype(gpucore.bfloat16)
del z
targets = cp.asarray(np.random.default_rng(1).integers(0, 200, R).astype(np.int32))
gs = 1.0 / 65536
s8 = dlogits_fp8_scale(gs)
tau = sparse_tau_of(current().fp8_lm_head_sparse or 2.0 ** -13, gs, s8)
seed = cp.asarray([7], np.uint32)
grid = v3_fp8_grid(kernels["new"], R, n_packs)
outs = {label: (cp.empty(R, np.float32), cp.empty((R, Vp), np.uint8)) for label in kernels}


def launcher(label):
    k, (losses, d8) = kernels[label], outs[label]
    args = (losses, logits, d8, targets, np.float32(gs), np.float32(s8), np.int32(R), np.int32(V), np.int32(Vp),
            np.int32(0), np.float32(tau), seed, np.int32(0))
    return lambda: runtime.launch(k, grid, V3_BLOCK, args, shared_mem=n_packs * 16)


fns = {label: launcher(label) for label in kernels}
for f in fns.values():
    f()
cp.cuda.Device().synchronize()
ms = time_interleaved(list(fns.values()), rounds=11)
src, dst = cp.empty(R * Vp * 3 // 2, np.uint8), cp.empty(R * Vp * 3 // 2, np.uint8)
copy_ms = time_interleaved([lambda: dst.data.copy_from_device(src.data, dst.nbytes)], rounds=11)[0]
meter = power.require_meter("classifier_fp8_ab")
sync = cp.cuda.Device().synchronize
energy = {label: [] for label in fns}
for _ in range(2):                    # alternating rounds; the last one's reading is printed
    for label, f in fns.items():
        energy[label].append(power.measure(f, meter, min_seconds=1.0, sync=sync))
print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: one {R}-row chunk, tau={tau:g}, grid {grid}, "
      f"old tree {OLD}")
print(f"{'tree':5s} {'ms alone':>9s} {'% copy':>7s} {'ms at cap':>10s} {'mJ':>6s} {'W':>5s} {'MHz':>5s} {'zeros':>6s}")
for (label, f), t in zip(fns.items(), ms):
    p = energy[label][-1]
    zeros = float(((outs[label][1] & 0x7F) == 0).mean())
    print(f"{label:5s} {t:9.4f} {100 * copy_ms / t:6.1f}% {1e3 * p.seconds / p.calls:10.4f} "
          f"{1e3 * p.joules_per_call:6.1f} {p.watts:5.0f} {p.sm_mhz:5.0f} {zeros:6.4f}")
(lo, bo), (ln, bn) = outs["old"], outs["new"]
print(f"new / old alone x{ms[0] / ms[1]:.3f}; bytes that differ {100 * float((bo != bn).mean()):.4f}%; "
      f"losses' max relative difference {float(cp.abs(ln - lo).max() / cp.abs(lo).max()):.2e}")
