"""Probe: the FP8 classifier's thinned E5M2-only rows with each exp made once (KEEP_E, the default)
against the two-exp build (-DCLS_FP8_EXPS_TWICE), one 8192-row d12 chunk of realistic rows (a
Zipf-like prior plus noise, tools/probes/classifier_sparse_cost.py's), tau at p = 2^-13:
  - the kernel alone, interleaved medians (ms), 9 rounds;
  - the same back to back under NVML's counter at the power cap (ms, J a call, W, MHz);
  - how many E5M2 bytes the two builds write differently.
Run (GPU): PYTHONPATH=. python3 tools/probes/classifier_keep_e.py [seconds=1] [rounds=2]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import power
from gpucore.bench import time_interleaved
from gpucore.ops.classifier import dlogits_fp8_scale, launch_fused_fp8, sparse_tau_of

opts = dict(seconds="1", rounds="2")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
R, V, Vp, TOKENS = 8192, 50257, 50304, 65536
BF = gpucore.bfloat16
rng = cp.random.default_rng(0)
z = -cp.log1p(cp.arange(Vp, dtype=cp.float32))[None, :] + 3.0 * rng.standard_normal((R, Vp), dtype=cp.float32)
z[:, V:] = -30.0
logits = z.astype(BF)
del z
targets = cp.asarray(np.random.default_rng(1).integers(0, 200, R).astype(np.int32))
gs = 1.0 / TOKENS
s8 = dlogits_fp8_scale(gs)
tau = sparse_tau_of(2.0 ** -13, gs, s8)
seed = cp.asarray([7], np.uint32)
losses = cp.empty(R, np.float32)
builds = {"keep e (default)": (), "two exps": ("-DCLS_FP8_EXPS_TWICE",)}
outs, fns = {}, []
for name, options in builds.items():
    d8 = cp.empty((R, Vp), cp.uint8)

    def run(d8=d8, options=options):
        launch_fused_fp8(logits, targets, losses, V, gs, d8, s8, write_dlogits=False, sparse_tau=tau,
                         sparse_seed=seed, options=options)

    run()
    outs[name] = d8
    fns.append(run)
cp.cuda.Device().synchronize()
a, b = outs.values()
print(f"one {R}-row chunk, tau {tau:g}: bytes that differ between the builds {float((a != b).mean()):.2e}, "
      f"zeros {float(((a & 0x7F) == 0).mean()):.3f}")
times = time_interleaved(fns, rounds=9)
meter = power.require_meter()
sync = cp.cuda.Device().synchronize
last = {}
for _ in range(int(opts["rounds"])):
    for name, fn in zip(builds, fns):
        power.measure(fn, meter, min_seconds=float(opts["seconds"]) / 2, sync=sync)
        last[name] = power.measure(fn, meter, min_seconds=float(opts["seconds"]), sync=sync)
print(f"{'build':18s} {'alone ms':>9s} {'capped ms':>10s} {'J/call':>7s} {'W':>5s} {'MHz':>5s}")
for (name, r), t in zip(last.items(), times):
    print(f"{name:18s} {t:9.4f} {1e3 * r.seconds / r.calls:10.4f} {r.joules_per_call:7.4f} {r.watts:5.0f} {r.sm_mhz:5.0f}")
