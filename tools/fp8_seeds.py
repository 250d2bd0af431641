#!/usr/bin/env python3
"""fp8_seeds.py -- issue 16's quality question answered against bf16's own seed-to-seed spread.

Reads tools/optimizer_lab.sh's metrics (LOG/<run>.s<SEED>.jsonl: one file per mode and seed,
written by `tools/fp8_seeds.sh`) and prints, at every evaluation, each mode's validation loss per
seed, bf16's spread across seeds, and each FP8 mode's gap to bf16 at the same seed and to bf16's
seed mean, with the standard error of that mean gap (the per-seed gaps' standard deviation over
sqrt(seeds): what the seeds can tell apart); a summary last, with the same-seed gaps' rms and how
many of them break issue 16's 1% (evaluations after the first: step 0 holds only the forward's
rounding, no training).
Run:  python3 tools/fp8_seeds.py LOG[,LOG ...] MODE [MODE ...]   (first MODE = bf16)
Several LOG folders (comma-separated) pool the seeds of several calls; a mode and seed found twice
is refused.
"""
import json
import statistics
import sys
from pathlib import Path


def val_losses(path: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}


def main(logs: list[Path], modes: list[str]) -> None:
    runs = {}
    for log in logs:
        for p in sorted(log.glob("*.s*.jsonl")):
            mode, seed = p.stem.rsplit(".s", 1)
            if mode in modes:
                if seed in runs.get(mode, {}):
                    raise SystemExit(f"{mode} seed {seed} is in more than one of {', '.join(map(str, logs))}")
                runs.setdefault(mode, {})[seed] = val_losses(p)
    base = modes[0]
    if base not in runs:
        raise SystemExit(f"no {base} runs under {', '.join(map(str, logs))}")
    seeds = sorted(runs[base])
    steps = sorted(set.intersection(*(set(v) for m in runs.values() for v in m.values())))
    print(f"val loss per evaluation; seeds {', '.join(seeds)}")
    print(f"{'step':>5}  {base + ' (per seed)':<30} {'spread':>7}  " + "  ".join(f"{m + ' gap vs same seed':<34}" for m in modes[1:] if m in runs))
    worst = {m: 0.0 for m in modes[1:]}
    worst_mean = {m: 0.0 for m in modes[1:]}
    trained = {m: [] for m in modes[1:]}                    # same-seed gaps after the first evaluation
    spread_max = 0.0
    for st in steps:
        b = [runs[base][s][st] for s in seeds]
        mean = statistics.mean(b)
        spread = (max(b) - min(b)) / mean
        spread_max = max(spread_max, spread)
        cells = []
        for m in modes[1:]:
            if m not in runs:
                continue
            both = [s for s in seeds if s in runs[m]]        # the means over the seeds both modes ran
            gaps = [(runs[m][s][st] - runs[base][s][st]) / runs[base][s][st] for s in both]
            bm = statistics.mean(runs[base][s][st] for s in both)
            gm = (statistics.mean(runs[m][s][st] for s in both) - bm) / bm
            worst[m] = max(worst[m], max(abs(g) for g in gaps))
            worst_mean[m] = max(worst_mean[m], abs(gm))
            if st != steps[0]:
                trained[m] += gaps
            se = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
            cells.append(" ".join(f"{100 * g:+.2f}%" for g in gaps) + f" (means {100 * gm:+.2f}% +- {100 * se:.2f}%)")
        print(f"{st:>5}  {' '.join(f'{x:.4f}' for x in b):<30} {100 * spread:6.2f}%  " + "  ".join(f"{c:<34}" for c in cells))
    print(f"\nsummary: {base} seed-to-seed spread up to {100 * spread_max:.2f}% at an evaluation")
    for m in modes[1:]:
        if m in runs:
            final = steps[-1]
            fg = statistics.mean((runs[m][s][final] - runs[base][s][final]) / runs[base][s][final] for s in seeds if s in runs[m])
            print(f"  {m}: worst same-seed gap {100 * worst[m]:.2f}%, worst gap of the seed means "
                  f"{100 * worst_mean[m]:.2f}%, final (step {final}) mean gap {100 * fg:+.2f}%")
            if trained[m]:
                g = trained[m]
                rms = (sum(x * x for x in g) / len(g)) ** 0.5
                print(f"    same-seed gaps after step {steps[0]}: rms {100 * rms:.2f}%, "
                      f"over 1% at {sum(abs(x) > 0.01 for x in g)} of {len(g)}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main([Path(p) for p in sys.argv[1].split(",")], sys.argv[2:])
