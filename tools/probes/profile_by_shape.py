"""Probe: `gpucore profile`'s per-op timing, one row per (op, shape of its first array argument),
so that the many calls of one family (FP8 casts of weights, activations and gradients) show apart.
Run:  PYTHONPATH=. python3 tools/probes/profile_by_shape.py [model=d12] [B=64] [dtype=fp8] [steps=3] [top=40] [warm=2]
warm: untimed steps first (FP8's adaptive scales re-cast many tensors in the first ~15 steps; warm=20
profiles the steady state).
"""
import sys

from gpucore import profiler
from gpucore.profile import _sync, synthetic_training

opts = dict(model="d12", B="64", dtype="fp8", steps="3", top="40", warm="2")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
steps = int(opts["steps"])
run = synthetic_training(opts["model"], int(opts["B"]), None, "cuda", opts["dtype"])
step, device = run.step, run.device


def label(name, args, kwargs):
    shape = next((tuple(a.shape) for a in args if hasattr(a, "shape")), ())
    return f"{name} {'x'.join(map(str, shape))}"


for _ in range(int(opts["warm"])):
    float(step()[0])
_sync(device)
with profiler.recording(label) as rec:
    for _ in range(steps):
        step()
totals = rec.totals()
rows = sorted(((t.ms / steps, t.calls / steps, name) for name, t in totals.items()), reverse=True)
total = sum(r[0] for r in rows)
print(f"{opts['model']} B={opts['B']} {opts['dtype']}: sum of ops {total:.2f} ms per step")
print(f"{'op and first argument shape':60s} {'calls':>6s} {'ms':>8s} {'us/call':>8s}")
for ms, calls, name in rows[:int(opts["top"])]:
    print(f"{name:60s} {calls:6.1f} {ms:8.3f} {1e3 * ms / calls:8.1f}")
