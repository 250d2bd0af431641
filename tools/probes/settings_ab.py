"""Probe: settings A/B on whole graphed training steps, in one process, timed in alternation.

tools/ab_train.py times whole trainings in separate processes, one after another; at the 700 W cap
their drift (0.5-1%) is the size of the levers left. This keeps one model and gives each variant a
StepGraph of its own, captured under its settings, then replays them in alternation
(time_interleaved: every round times each variant once), the optimizer step included. The
thirty-first session's interleaved A/Bs of the graph's memset moves read 0.3-2.7% slower in FP8
where a separate-run A/B had read 0.5% faster (tools/notes/step_graph.md).

A variant is GPUCORE_SETTINGS text ("" = the defaults); the first is the base of the ratios:
  PYTHONPATH=. python3 tools/probes/settings_ab.py model=d12 B=64 dtype=fp8 rounds=7 repeat=4 \\
      "" "encoder_dwpe_beside=0" "attention_v3_streams=0,attention_head_group=0"
Settings read when the model is built (BUILT_ONCE: the FP8 scaling's constructor, the LM-head
buffers) would take the defaults in every variant, so a variant that changes one is refused: compare
those with tools/ab_train.py.
"""
import sys

import cupy

from gpucore import settings
from gpucore.bench import time_interleaved
from gpucore.profile import synthetic_training
from gpucore.step_graph import StepGraph
from gpucore.train import train_step

opts = dict(model="d12", B="64", dtype="bf16", rounds="7", repeat="4")
texts = []
for arg in sys.argv[1:]:
    key, sep, value = arg.partition("=")
    if sep and key in opts:
        opts[key] = value
    else:
        texts.append(arg)
texts = texts or [""]
variants = [settings.from_env({"GPUCORE_SETTINGS": t}) for t in texts]
BUILT_ONCE = ("fp8_lm_head", "fp8_history", "fp8_margin", "fp8_weights_current", "lm_head_chunk_bytes")
for text, s in zip(texts, variants):
    fixed = [f for f in BUILT_ONCE if getattr(s, f) != getattr(variants[0], f)]
    if fixed:
        sys.exit(f"settings_ab: {text!r} changes {', '.join(fixed)}, read once when the model is built; "
                 "use tools/ab_train.py")
run = synthetic_training(opts["model"], int(opts["B"]), None, "cuda", opts["dtype"])
graphs = [StepGraph(run.net, strict=True) for _ in variants]


def stepper(s, g):
    def fn():
        with settings.using(s):
            return train_step(run.net, run.opt, lambda: (run.x, run.y), 1, 1e-4, graph=g)
    return fn


fns = [stepper(s, g) for s, g in zip(variants, graphs)]
for fn in fns:                         # eager call, capture, replays
    for _ in range(4):
        float(fn()[0])
cupy.cuda.Device().synchronize()
ms = time_interleaved(fns, rounds=int(opts["rounds"]), repeat=int(opts["repeat"]))
for text, t in zip(texts, ms):
    print(f"{opts['model']} B={opts['B']} {opts['dtype']:5s} {t:8.2f} ms/step  x{ms[0] / t:.4f}  {text or '(defaults)'}")
