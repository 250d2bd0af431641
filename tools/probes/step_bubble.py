"""step_bubble.py -- what the training loop's per-step host sync costs: the GPU idles from the end
of step k until the host, having read step k's loss and norm, launches step k+1.

Graphed train_step()s of one model (d12 B=64 T=1024, AdamW, a fixed batch), in alternating rounds:
  sync    every step followed by float(loss), float(norm) -- as gpucore train's loop does
  async   the steps queued back to back, one sync after the round
  lag1    each step's loss and norm read after the next step is queued (one step late)
ms/step = a round's wall time / steps; the difference is the bubble a step.

    PYTHONPATH=. python3 tools/probes/step_bubble.py [dtype=bf16|fp8] [steps=40] [rounds=3]
"""
import statistics
import sys
import time

import cupy as cp
import numpy as np

from gpucore.model import GPT2, GPT2Config
from gpucore.optim import AdamW
from gpucore.step_graph import StepGraph
from gpucore.train import train_step


def main():
    kw = dict(a.split("=") for a in sys.argv[1:])
    dtype, steps, rounds = kw.get("dtype", "bf16"), int(kw.get("steps", 40)), int(kw.get("rounds", 3))
    cfg = GPT2Config.from_preset("d12")
    m = GPT2(cfg, xp=cp, dtype="bfloat16", seed=1, fp8="adaptive" if dtype == "fp8" else None)
    opt = AdamW(m, weight_decay=0.1, max_grad_norm=1.0)
    graph = StepGraph(m, strict=True)
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.integers(0, cfg.vocab_size, size=(64, 1024)).astype(np.int32))
    y = cp.asarray(rng.integers(0, cfg.vocab_size, size=(64, 1024)).astype(np.int32))
    batch = lambda: (x, y)                                   # noqa: E731
    step = lambda: train_step(m, opt, batch, 1, 3e-4, graph=graph)   # noqa: E731

    def sync_round():
        for _ in range(steps):
            loss, norm = step()
            float(loss), float(norm)

    def async_round():
        out = [step() for _ in range(steps)]
        float(out[-1][0])

    def lag1_round():
        prev = None
        for _ in range(steps):
            cur = step()
            if prev is not None:
                float(prev[0]), float(prev[1])
            prev = cur
        float(prev[0]), float(prev[1])

    modes = {"sync": sync_round, "async": async_round, "lag1": lag1_round}
    for _ in range(30):                                     # warm-up: compiles, races, capture, scales
        float(step()[0])
    times = {k: [] for k in modes}
    for _ in range(rounds):
        for name, fn in modes.items():
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            fn()
            cp.cuda.Device().synchronize()
            times[name].append((time.perf_counter() - t0) * 1e3 / steps)
    base = statistics.median(times["sync"])
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{name}, d12 B=64 {dtype}, graphed, {steps} steps x {rounds} rounds (ms/step, medians):")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"  {k:6s} {med:7.2f}  ({', '.join(f'{t:.2f}' for t in v)})  {base - med:+.2f} vs sync")


if __name__ == "__main__":
    main()
