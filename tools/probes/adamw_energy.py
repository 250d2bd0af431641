"""Probe: the AdamW update alone, milliseconds and joules a call (NVML's energy counter), as the
optimizer runs it (fp32 master weights, bf16 grads and working copy, weight decay on part of the
buffer, clipping from a device-resident norm). The step runs at the board's power cap, so an
update's joules cost step time even where its milliseconds are at the copy's speed
(tools/notes/profile.md, twenty-seventh session). Run it once per tree to compare two trees:

  PYTHONPATH=.     python3 tools/probes/adamw_energy.py [n=1557686400] [seconds=2] [rounds=2]
  PYTHONPATH=.base python3 tools/probes/adamw_energy.py ...          # the other tree, same machine

n defaults to d48's parameter count (124475904 for d12). Prints ms, J, W and the SM clock per round,
and the bytes an update moves against the time (28 bytes a parameter).
"""
import sys

import cupy
import numpy as np

import gpucore
from gpucore import power

opts = dict(n="1557686400", seconds="2", rounds="2")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
n = int(opts["n"])
meter = power.require_meter()
rng = cupy.random.default_rng(0)
params = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
m = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-4)
v = cupy.abs(rng.standard_normal(n, dtype=np.float32)) * np.float32(1e-8)
grads = (rng.standard_normal(n, dtype=np.float32) * np.float32(1e-4)).astype(gpucore.bfloat16)
lowp = cupy.empty(n, gpucore.bfloat16)
norm = gpucore.grad_norm(grads)
spans = [(0, n // 3), (n // 2, n - n // 5)]


def update():
    gpucore.adamw_update(params, grads, m, v, lr=3e-4, step=100, beta1=0.9, beta2=0.95, weight_decay=0.1,
                         decay_spans=spans, grad_norm=norm, max_grad_norm=1.0, params_lowp=lowp)


sync = cupy.cuda.Device().synchronize
update()
power.measure(update, meter, min_seconds=float(opts["seconds"]) / 4, sync=sync)
for r in range(int(opts["rounds"])):
    p = power.measure(update, meter, min_seconds=float(opts["seconds"]), sync=sync)
    ms = 1e3 * p.seconds / p.calls
    print(f"adamw n={n}: {ms:.3f} ms a call ({28 * n / ms / 1e6:.0f} GB/s), {p.joules_per_call:.3f} J, "
          f"{p.watts:.0f} W, SM {p.sm_mhz:.0f} MHz", flush=True)
