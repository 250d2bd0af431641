"""Probe: what cuBLASLt's chosen algorithms need of the workspace, and where the step graph's
workspace memsets sit (tools/notes/profile.md, thirtieth and thirty-first sessions).

For one synthetic run (model, B, dtype) this captures the graphed step and prints:
  - per GEMM plan with a choice: its shape key and the workspace bytes its algorithm asks for;
  - the graph's memset nodes inside a cuBLAS(Lt) workspace: offset from the workspace's start,
    bytes, and what kind of node each depends on after graph_nodes' moves (ours / cuBLAS / none);
  - how many cuBLAS kernel nodes follow such a memset directly.

Run (GPU):  PYTHONPATH=. python3 tools/probes/lt_workspace.py [model=d12] [B=64] [dtype=bf16]
"""
import ctypes
import sys
from collections import Counter

import cupy

from gpucore import cublas, graph_nodes, lt_search, runtime
from gpucore.profile import synthetic_training
from gpucore.step_graph import StepGraph
from gpucore.train import train_step

opts = dict(model="d12", B="64", dtype="bf16")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
run = synthetic_training(opts["model"], int(opts["B"]), None, "cuda", opts["dtype"])
graph = StepGraph(run.net, strict=True)
for _ in range(3):
    float(train_step(run.net, run.opt, lambda: (run.x, run.y), 1, 1e-4, graph=graph)[0])
cupy.cuda.Device().synchronize()

lt = cublas.lt_binding()
_, handle, ws = lt.device_state()
print(f"== {opts['model']} B={opts['B']} {opts['dtype']}: moved memsets {graph.moved_memsets}, "
      f"hoisted {graph.hoisted_memsets}")
sizes = Counter()
for key, plan in lt.plans.items():
    if plan is None or plan.choice is None or plan.choice == cublas.GEMMEX:
        continue
    n = len(plan.results) // cublas._HEURISTIC_BYTES
    if plan.choice < n:
        w = int.from_bytes(bytes(plan.results[plan.choice * 96 + 64:plan.choice * 96 + 72]), "little")
    else:
        res = (ctypes.c_ubyte * 96)()
        lt_search._bind(lt.lib).cublasLtMatmulAlgoCheck(handle, plan.desc, plan.lay_b, plan.lay_a, plan.lay_c,
                                                        plan.lay_c, plan.algo_ptr(plan.choice), ctypes.addressof(res))
        w = int.from_bytes(bytes(res[64:72]), "little")
    sizes[w] += 1
    print(f"  plan {str(key[1:12]):60s} {plan.label(plan.choice):10s} workspace {w:>10d} B")
print("  plans by workspace bytes:", dict(sorted(sizes.items())))

nodes, edges = graph_nodes.read_graph(graph.graph.graph, runtime.kernel_handles(), cublas.workspace_ranges())
preds, succs = {n: [] for n in nodes}, {n: [] for n in nodes}
for a, b, _ in edges:
    preds[b].append(a)
    succs[a].append(b)
cu = graph_nodes.driver()
bases = cublas.workspace_ranges()
where, pred_kind, follow = Counter(), Counter(), Counter()
for h, node in nodes.items():
    if node.kind == graph_nodes.MEMSET and node.in_workspace:
        mp = graph_nodes._MemsetParams()
        cu.cuGraphMemsetNodeGetParams(ctypes.c_void_p(h), ctypes.byref(mp))
        base = next(p for p, s in bases if p <= mp.dst < p + s)
        where[(base == ws.data.ptr, mp.dst - base, mp.width * mp.element_size, mp.height)] += 1
        kinds = tuple(sorted("ours" if nodes[p].ours else nodes[p].kind if nodes[p].kind != "kernel" else "cublas"
                             for p in preds[h]))
        pred_kind[kinds or ("root",)] += 1
        for s in succs[h]:
            follow["ours" if nodes[s].ours else nodes[s].kind] += 1
print(f"  nodes {len(nodes)}, cuBLAS kernels {sum(n.kind == 'kernel' and not n.ours for n in nodes.values())}")
print("  workspace memsets (is Lt's, offset, bytes, rows):", dict(where))
print("  their dependencies:", dict(pred_kind))
print("  what follows them:", dict(follow))
