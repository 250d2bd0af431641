"""Probe: the graphed training step's kernel timeline, read by CUPTI (through torch.profiler).

Every earlier profile timed ops with CUDA events around eager calls (gpucore.profiler), which
perturbs the step and cannot see inside the CUDA graph that replays forward + backward. CUPTI's
kernel activity records each kernel's start and end on the GPU, graph replays included, for every
library in the process (CuPy's RawModules and cuBLAS alike). From K recorded steps this prints:

  - the step's GPU window, the time some kernel was running (union of intervals) and the idle rest;
  - the memsets and copies in the step, and each memset between the kernels around it;
  - the idle gaps between consecutive kernels: how many, a size histogram, the largest kinds by
    (kernel before -> kernel after), so launch latency and host waits show apart;
  - kernels by name: calls and in-step time (at the step's own clock, not alone).

Measured: tools/notes/profile.md, twenty-second session. torch is used here as a tracer only (the device machines have it; the package never imports it).
Run (GPU):  PYTHONPATH=. python3 tools/probes/step_timeline.py [model=d12] [B=64] [dtype=bf16]
            [warm=12] [steps=4] [top=30] [graph=1] [sizes=fp8_,adamw]
  sizes=S1,S2: for kernels whose name holds one of these, calls a step by duration bucket (a tiny
  weight cast and an activation cast share a kernel name)
"""
import bisect
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import cupy
import torch
from torch.profiler import ProfilerActivity, profile

from gpucore.profile import synthetic_training
from gpucore.step_graph import StepGraph
from gpucore.train import train_step

opts = dict(model="d12", B="64", dtype="bf16", warm="12", steps="4", top="30", graph="1", sizes="")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
K = int(opts["steps"])
run = synthetic_training(opts["model"], int(opts["B"]), None, "cuda", opts["dtype"])
graph = StepGraph(run.net, strict=True) if opts["graph"] == "1" else None


def step():
    return train_step(run.net, run.opt, lambda: (run.x, run.y), 1, 1e-4, graph=graph)


torch.zeros(1, device="cuda")        # torch's CUDA state up front, not inside the trace
for _ in range(int(opts["warm"])):
    float(step()[0])
cupy.cuda.Device().synchronize()
t0 = time.perf_counter()
for _ in range(K):
    loss, _ = step()
float(loss)
cupy.cuda.Device().synchronize()
plain_ms = (time.perf_counter() - t0) * 1e3 / K

with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(K):
        loss, _ = step()
    float(loss)
    cupy.cuda.Device().synchronize()
path = os.path.join(tempfile.mkdtemp(), "trace.json")
prof.export_chrome_trace(path)
with open(path) as f:
    events = json.load(f)["traceEvents"]
kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                 if e.get("ph") == "X" and e.get("cat") == "kernel")
others = defaultdict(lambda: [0.0, 0])       # memsets and copies: nodes that are not kernels
for e in events:
    if e.get("ph") == "X" and e.get("cat") in ("gpu_memset", "gpu_memcpy"):
        others[e["cat"]][0] += e["dur"]
        others[e["cat"]][1] += 1
if not kernels:
    sys.exit("no kernel activity recorded: CUPTI did not see CuPy's context")


def short(name, n=60):
    name = name.split("(")[0]
    return name if len(name) <= n else name[:n - 3] + "..."


window = kernels[-1][1] - kernels[0][0]
busy, end = 0.0, kernels[0][0]
gaps = []                       # (us, before, after)
prev_name = None
for s, e, name in kernels:
    if s > end:
        gaps.append((s - end, prev_name, name))
        busy += e - s
    else:
        busy += max(0.0, e - end)
    if e >= end:
        end, prev_name = e, name
idle = window - busy
print(f"{opts['model']} B={opts['B']} {opts['dtype']} graph={opts['graph']}: untraced {plain_ms:.2f} ms/step; "
      f"traced window {window / 1e3 / K:.2f} ms/step, kernels busy {busy / 1e3 / K:.2f}, "
      f"idle {idle / 1e3 / K:.2f} ({100 * idle / window:.1f}%), {len(kernels) / K:.0f} kernels and "
      f"{len(gaps) / K:.0f} gaps a step")
for cat, (t, n) in others.items():
    print(f"{cat}: {n / K:.1f} a step, {t / 1e3 / K:.3f} ms")
# each memset between the kernels around it: what it precedes, and the time it adds to that gap
sets = sorted((e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("bytes", 0)) for e in events
              if e.get("ph") == "X" and e.get("cat") == "gpu_memset")
starts = [k[0] for k in kernels]
around = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0])      # (before, after) -> n, us before, us of memset, us after, bytes
for ms0, ms1, nb in sets:
    i = bisect.bisect_left(starts, ms0)
    if 0 < i < len(kernels):
        r = around[(short(kernels[i - 1][2], 40), short(kernels[i][2], 40))]
        r[0] += 1
        r[1] += ms0 - kernels[i - 1][1]
        r[2] += ms1 - ms0
        r[3] += kernels[i][0] - ms1
        r[4] = nb
if sets:
    print("memsets by the kernels around them: a step, mean us from the kernel before / memset / to the kernel after, bytes")
    for (a, b), (n, u0, u1, u2, nb) in sorted(around.items(), key=lambda kv: -kv[1][0])[:10]:
        print(f"  {n / K:6.1f}  {u0 / n:6.2f} {u1 / n:6.2f} {u2 / n:6.2f}  {nb:>9}  {a} -> {b}")
edges = [0, 1, 2, 3, 5, 10, 50, 1e9]
hist = [0.0] * (len(edges) - 1)
count = [0] * (len(edges) - 1)
for g, _, _ in gaps:
    i = next(i for i in range(len(edges) - 1) if g < edges[i + 1])
    hist[i] += g
    count[i] += 1
print("gap size (us)   gaps/step   idle ms/step")
for i in range(len(edges) - 1):
    hi = "inf" if edges[i + 1] > 1e8 else f"{edges[i + 1]:g}"
    print(f"  [{edges[i]:g}, {hi})".ljust(16) + f"{count[i] / K:10.1f} {hist[i] / 1e3 / K:12.3f}")
pairs = defaultdict(lambda: [0.0, 0])
for g, a, b in gaps:
    p = pairs[(short(a or "", 40), short(b, 40))]
    p[0] += g
    p[1] += 1
print(f"\nlargest idle by kernel pair (before -> after): ms/step, gaps/step, mean us")
for (a, b), (g, n) in sorted(pairs.items(), key=lambda kv: -kv[1][0])[:int(opts["top"]) // 2]:
    print(f"  {g / 1e3 / K:7.3f} {n / K:6.1f} {g / n:7.2f}  {a} -> {b}")
by_name = defaultdict(lambda: [0.0, 0])
for s, e, name in kernels:
    r = by_name[short(name)]
    r[0] += e - s
    r[1] += 1
print(f"\nkernels by name: ms/step, calls/step, us/call (in the step)")
for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:int(opts["top"])]:
    print(f"  {t / 1e3 / K:8.3f} {n / K:7.1f} {t / n:8.1f}  {name}")
if opts["sizes"]:
    dur_edges = [0, 3, 6, 12, 25, 50, 100, 200, 400, 1e9]
    print(f"\ncalls a step by duration (us), ms/step: buckets {dur_edges[1:-1]}")
    buckets = defaultdict(lambda: [[0, 0.0] for _ in dur_edges[:-1]])
    for s0, e0, name in kernels:
        if any(k in name for k in opts["sizes"].split(",")):
            d = e0 - s0
            b = buckets[short(name, 50)][bisect.bisect_right(dur_edges, d) - 1]
            b[0] += 1
            b[1] += d
    for name, bs in sorted(buckets.items()):
        cells = "  ".join(f"<{dur_edges[i + 1]:g}:{n / K:.0f}/{t / 1e3 / K:.3f}" for i, (n, t) in enumerate(bs) if n)
        print(f"  {name}: {cells}")
