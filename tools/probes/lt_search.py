"""Probe: what searching cuBLASLt's configuration space (settings.lt_search) buys per GEMM of a real
training step. Runs a few steps of `gpucore train` with a private, empty tune cache and lt_search = N,
then lists every raced plan: its shape, the heuristic's best, gemmEx, the best searched
configuration and which won (times from the race itself: 3 rounds x 3 calls, min).
Run:  [LT_SEARCH_CACHE=winners.json] PYTHONPATH=. python3 tools/probes/lt_search.py [N=1500] [field=value ...]
      (fields of TrainArgs; the winners file can then serve whole trainings: settings.lt_tune_cache)
      e.g. dtype=fp8 model=d48 batch_size=16
"""
import os
import sys
import tempfile
import time

from gpucore import cublas, lt_search, settings
from gpucore import train as T

budget = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 1500
args = T.TrainArgs(model="d12", batch_size=64, seq_len=1024, steps=2, lr=3e-4, dtype="bfloat16", device="cuda",
                   val_every=0, sample_every=0, checkpoint=False, out_dir=tempfile.mkdtemp())
for kv in sys.argv[1 + (len(sys.argv) > 1 and sys.argv[1].isdigit()):]:
    k, v = kv.split("=", 1)
    setattr(args, k, type(getattr(args, k))(v))
cache = os.environ.get("LT_SEARCH_CACHE") or tempfile.mktemp(suffix=".json")   # fresh: nothing decided yet
t0 = time.time()
with settings.using(lt_search=budget, lt_tune_cache=cache):
    T.run(args, echo=lambda s: None)
print(f"{args.model} B={args.batch_size} {args.dtype}, lt_search={budget}: {time.time() - t0:.1f} s "
      f"for {args.steps} steps (searches included)")
lt = cublas.lt_binding()
rows = []
for key, plan in lt.plans.items():
    if plan is None or plan.times is None:
        continue
    n_heur = len(plan.candidates)
    t = plan.times
    heur = min(t[:n_heur])
    gemmex = t[len(plan.raced)] if len(t) > len(plan.raced) else None
    searched = min(t[n_heur:len(plan.raced)], default=None)
    base = min(heur, gemmex) if gemmex is not None else heur
    chosen = "gemmEx" if plan.choice == cublas.GEMMEX else plan.label(plan.choice)
    won = t[len(plan.raced)] if plan.choice == cublas.GEMMEX else t[plan.raced.index(plan.choice)]
    desc = lt_search.describe(lt.lib, plan.algo_ptr(plan.choice)) if plan.choice != cublas.GEMMEX else ""
    rows.append((base - won, key, heur, gemmex, searched, chosen, won, desc))
print(f"{'plan key (M N K / fp8 ...)':70s} {'heur':>8s} {'gemmEx':>8s} {'search':>8s} {'chosen':>10s} {'gain':>6s}")
for saving, key, heur, gemmex, searched, chosen, won, desc in sorted(rows, key=lambda r: -r[0]):
    shape = str(key[1:])[:70]
    ge = f"{gemmex:8.4f}" if gemmex is not None else f"{'-':>8s}"
    se = f"{searched:8.4f}" if searched is not None else f"{'-':>8s}"
    print(f"{shape:70s} {heur:8.4f} {ge} {se} {chosen:>10s} {saving / (won + saving):6.1%}  {desc}")
print(f"sum of per-call savings over {len(rows)} raced plans: {sum(r[0] for r in rows):.4f} ms")
