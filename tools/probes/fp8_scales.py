"""Probe: how each FP8 tensor's scale fits its data, step by step, in a real `gpucore train --dtype fp8`
run (d12 B=64 on Tiny Shakespeare unless told otherwise). After every step it prints the loss and, per
tensor, r = amax * scale / fmax (the share of the format's range the step's largest value used with
the scale it was cast with: r > 1 saturated, r << 1 wastes range at the bottom). Answers: which tensor
(layer, linear, x/W/grad) goes wrong when delayed scaling spikes?
With adaptive scaling it also lists the tensors whose cast was redone this step (the gate fired).
Run:  PYTHONPATH=. python3 tools/probes/fp8_scales.py [steps] [field=value of TrainArgs...]
      e.g. fp8_scaling=adaptive; or data=data/pyall shuffle=1 warmup=100 lr=6e-4 metrics=out/m.jsonl
      (its ms per step include this probe's reads of the scales: compare runs, not against train;
      with metrics=x.jsonl each step's amax of every tensor goes to x.amax.npy, (steps, tensors))
"""
import sys
from collections import Counter

import numpy as np

from gpucore import train as T
from gpucore.fp8_linear import QKV, ATTPROJ, FC, FCPROJ   # noqa: F401 - the slot order below

LIN = ["qkv", "attproj", "fc", "fcproj"]
KIND = ["x", "W", "g"]
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 14
orig = T.train_step


def step(model, opt, next_batch, grad_accum, lr, **kw):
    s = model.fp8.scaling
    used = s.scale.get().copy() if hasattr(s.scale, "get") else np.array(s.scale)
    loss, norm = orig(model, opt, next_batch, grad_accum, lr, **kw)
    hist = s.history.get() if hasattr(s.history, "get") else s.history
    amax = hist[(s.step_index - 1) % s.history_len]
    amax_rows.append(np.array(amax, np.float32))
    fmax = np.array([448.0 if f == "e4m3" else 57344.0 for f in s.formats])
    r = amax * used / fmax
    order = np.argsort(r)

    def name(i):
        return f"L{i // 12}.{LIN[(i % 12) // 3]}.{KIND[i % 3]}"
    recast = ""
    if s.mode == "adaptive":   # the gate of each tensor's last cast this step (x and g: cast once per step)
        slots = s._slots.get() if hasattr(s._slots, "get") else s._slots
        fired = [i for i in range(s.n) if slots[3, i, 1] != 0 and i % 3 != 1]
        kinds = Counter(name(i).split(".", 1)[1] for i in fired)
        recast = (f" | re-cast {len(fired)}/{2 * s.n // 3}: " + ", ".join(name(i) for i in fired[:6])
                  + " | by tensor: " + " ".join(f"{k}={v}" for k, v in sorted(kinds.items())))
    print(f"step {s.step_index}: loss {float(loss):.3f} norm {float(norm):.2f} | highest r: "
          + ", ".join(f"{name(i)} {r[i]:.2f}" for i in order[::-1][:4]) + " | lowest r: "
          + ", ".join(f"{name(i)} {r[i]:.1e}" for i in order[:3]) + recast, flush=True)
    return loss, norm


amax_rows = []      # each step's amax of every tensor: saved beside the metrics (metrics=x.jsonl -> x.amax.npy)
T.train_step = step
args = T.TrainArgs(model="d12", batch_size=64, seq_len=1024, steps=steps, lr=3e-4, dtype="fp8", device="cuda",
                   val_every=0, sample_every=0, checkpoint=False, out_dir="/tmp/fp8_scales")
for kv in sys.argv[2:]:
    k, v = kv.split("=", 1)
    old = getattr(args, k)
    if old is None or isinstance(old, bool):    # shuffle=1, metrics=path: fields whose default is None
        v = {"1": True, "true": True, "0": False, "false": False}.get(v.lower(), v)
    else:
        v = type(old)(v)
    setattr(args, k, v)
T.run(args, echo=lambda s: None)
if args.metrics and amax_rows:
    np.save(args.metrics.removesuffix(".jsonl") + ".amax.npy", np.stack(amax_rows))
