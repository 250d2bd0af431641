"""Probe: A/B of settings.graph_private_workspaces on whole graphed training steps (thirty-first
session, tools/notes/step_graph.md). Up to four StepGraphs of one model, each captured under its own
settings, replayed in alternation (time_interleaved) with the optimizer step:
  private   counter-only GEMMs on workspaces of their own, their memsets hoisted; the other
            memsets moved where they can be
  hoist     the same without the moves (graph_move_memsets off)
  shared    graph_private_workspaces off: one shared workspace, memsets moved where they can be
  captured  both off: the graph as stream capture recorded it
All give the same bits (tests/test_graph_nodes.py checks it on the GPU); this times them.
Run (GPU):  PYTHONPATH=. python3 tools/probes/graph_private_ab.py [model=d12] [B=64] [dtype=bf16]
            [rounds=7] [repeat=4] [order=private,hoist,shared,captured]
"""
import sys

import cupy

from gpucore import settings
from gpucore.bench import time_interleaved
from gpucore.profile import synthetic_training
from gpucore.step_graph import StepGraph
from gpucore.train import train_step

opts = dict(model="d12", B="64", dtype="bf16", rounds="7", repeat="4", order="private,hoist,shared,captured")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
run = synthetic_training(opts["model"], int(opts["B"]), None, "cuda", opts["dtype"])
every = {"private": dict(), "hoist": dict(graph_move_memsets=False), "shared": dict(graph_private_workspaces=False),
         "captured": dict(graph_move_memsets=False, graph_private_workspaces=False)}
variants = {name: every[name] for name in opts["order"].split(",")}
graphs = {name: StepGraph(run.net, strict=True) for name in variants}


def stepper(name):
    def fn():
        with settings.using(**variants[name]):
            return train_step(run.net, run.opt, lambda: (run.x, run.y), 1, 1e-4, graph=graphs[name])
    return fn


fns = [stepper(name) for name in variants]
for fn in fns:                         # eager call, capture, two replays each
    for _ in range(4):
        float(fn()[0])
cupy.cuda.Device().synchronize()
ms = time_interleaved(fns, rounds=int(opts["rounds"]), repeat=int(opts["repeat"]))
base = ms[list(variants).index("shared")] if "shared" in variants else ms[0]
for (name, g), t in zip(graphs.items(), ms):
    print(f"{opts['model']} B={opts['B']} {opts['dtype']:5s} {name:9s} {t:8.2f} ms/step  x{base / t:.4f} vs shared"
          f"  hoisted {g.hoisted_memsets:4d}  moved {g.moved_memsets:4d}")
