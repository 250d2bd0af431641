#!/usr/bin/env python3
"""fp8_seeds.py -- issue 16's quality question answered against bf16's own seed-to-seed spread.

Reads tools/optimizer_lab.sh's metrics (LOG/<run>.s<SEED>.jsonl: one file per mode and seed,
written by `tools/fp8_seeds.sh`) and prints, at every evaluation, each mode's validation loss per
seed, bf16's spread across seeds, and each FP8 mode's gap to bf16 at the same seed and to bf16's
seed mean, with the standard error of that mean gap (the per-seed gaps' standard deviation over
sqrt(seeds): what the seeds can tell apart); a summary last, with the same-seed gaps' rms and how
many of them break issue 16's 1% (evaluations after the first: step 0 holds only the forward's
rounding, no training), and issue 16's test read seed by seed: which seeds' FP8 run stays within 1%
of bf16's at every evaluation, and where each other seed parts furthest.
Run:  python3 tools/fp8_seeds.py LOG[,LOG ...] MODE [MODE ...]   (first MODE = bf16)
Several LOG folders (comma-separated) pool the seeds of several calls; a mode and seed found twice
is refused. With two FP8 modes or more, each later one is paired with the first per seed (the
difference of their rms same-seed gaps: does a change narrow the gap to bf16?). Where the logs hold
the training steps too, each mode's runs are checked: non-finite losses, whether each run's largest
one-step loss rise falls at the same step as bf16's of its seed (a batch's, not the precision's), and
the step time (median of steps after STEADY_FROM).
"""
import json
import math
import statistics
import sys
from pathlib import Path


STEADY_FROM = 40     # step times from here on: the adaptive scales have settled (tools/ratio_check.sh's 41-100)


def val_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def train_steps(records: list[dict]) -> dict[int, tuple[float, float | None]]:
    """step -> (training loss, ms) of the run's steps, the step that stopped it on a non-finite loss
    (gpucore train's "non-finite" event, its loss a "nan" or "inf" string) included."""
    return {r["step"]: (float(r["loss"]), r.get("ms")) for r in records
            if "loss" in r and r.get("event", "non-finite") == "non-finite"}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rms(gaps: list[float]) -> float:
    return (sum(g * g for g in gaps) / len(gaps)) ** 0.5


def _sem(xs: list[float]) -> float:
    return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")


def paired(runs: dict, base: str, ref: str, mode: str, steps: list[int]) -> str:
    """Per seed both FP8 modes ran: mode's rms same-seed gap to base (after the first evaluation)
    minus ref's, as mean +- standard error over the seeds, and in how many seeds mode's is smaller."""
    seeds = [s for s in runs[base] if s in runs[ref] and s in runs[mode]]
    gap = lambda m, s: _rms([(runs[m][s][t] - runs[base][s][t]) / runs[base][s][t] for t in steps[1:]])
    d = [gap(mode, s) - gap(ref, s) for s in seeds]
    return (f"  {mode} against {ref}, per seed: rms gap difference {100 * statistics.mean(d):+.3f}% +- "
            f"{100 * _sem(d):.3f}, smaller in {sum(x < 0 for x in d)} of {len(d)}")


def seed_test(runs: dict, base: str, mode: str, steps: list[int]) -> str:
    """Issue 16's test as it is written, one pair at a time: the seeds whose `mode` run stays within 1%
    of bf16's at every evaluation (step 0 included), and each other seed's largest gap and its step."""
    worst = {s: max((abs(runs[mode][s][st] / runs[base][s][st] - 1), st) for st in steps)
             for s in runs[mode] if s in runs[base]}
    out = sorted(((g, st, s) for s, (g, st) in worst.items() if g > 0.01), reverse=True)
    line = f"every evaluation within 1% of the same seed's: {len(worst) - len(out)} of {len(worst)} seeds"
    return line + ("; the others: " + ", ".join(f"seed {s} {100 * g:.2f}% (step {st})" for g, st, s in out)
                   if out else "")


def health(train: dict, base: str, mode: str) -> str | None:
    """One line on mode's runs from their training steps (None when the logs hold none)."""
    seeds = [s for s in train.get(mode, {}) if train[mode][s]]
    if not seeds:
        return None
    nonfinite = sum(not math.isfinite(l) for s in seeds for l, _ in train[mode][s].values())

    def top_rise(steps):
        rises = [(steps[t][0] - steps[t - 1][0], t) for t in steps if t > 2 and t - 1 in steps
                 and math.isfinite(steps[t][0] - steps[t - 1][0])]
        return max(rises)[1] if rises else None
    same = [s for s in seeds if s in train.get(base, {}) and top_rise(train[mode][s]) == top_rise(train[base][s])]
    steady = ([ms for t, (_, ms) in train[mode][s].items() if t > STEADY_FROM and ms] for s in seeds)
    meds = [statistics.median(times) for times in steady if times]
    time = f", step time {min(meds):.1f}-{max(meds):.1f} ms (medians of steps > {STEADY_FROM})" if meds else ""
    rise = "" if mode == base else f", largest loss rise at {base}'s step in {len(same)} of {len(seeds)}"
    return f"  {mode}: {len(seeds)} runs, {nonfinite} non-finite losses{rise}{time}"


def main(logs: list[Path], modes: list[str]) -> None:
    runs, train = {}, {}
    for log in logs:
        for p in sorted(log.glob("*.s*.jsonl")):
            mode, seed = p.stem.rsplit(".s", 1)
            if mode in modes:
                if seed in runs.get(mode, {}):
                    raise SystemExit(f"{mode} seed {seed} is in more than one of {', '.join(map(str, logs))}")
                records = _records(p)
                runs.setdefault(mode, {})[seed] = val_losses(records)
                train.setdefault(mode, {})[seed] = train_steps(records)
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
            cells.append(" ".join(f"{100 * g:+.2f}%" for g in gaps) + f" (means {100 * gm:+.2f}% +- {100 * _sem(gaps):.2f}%)")
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
                print(f"    same-seed gaps after step {steps[0]}: rms {100 * _rms(g):.2f}%, "
                      f"over 1% at {sum(abs(x) > 0.01 for x in g)} of {len(g)}")
            print("    " + seed_test(runs, base, m, steps))
    fp8 = [m for m in modes[1:] if m in runs]
    for m in fp8[1:]:
        if len(steps) > 1:
            print(paired(runs, base, fp8[0], m, steps))
    lines = [line for m in [base] + fp8 if (line := health(train, base, m))]
    if lines:
        print("runs:")
        print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main([Path(p) for p in sys.argv[1].split(",")], sys.argv[2:])
