#!/usr/bin/env python3
"""ab_train.py -- whole training runs of several variants, timed in alternation in one device call.

Machines differ by 5-10%, so speed-ups are only measured side by side: this runs every variant
once per round (round 1: a, b, c, ...; round 2: a, b, c, ...), then prints per variant the median
step time (the first --skip steps excluded, default 1: compiles, autotune), tokens/s, the ratio to
the first variant, the CuPy pool's high-water mark, the last loss, and which variants' losses agree
bit for bit (a variant with itself across rounds: determinism).

A variant is NAME=TREE[:ENV=VALUE,...][:EXTRA TRAIN OPTIONS]:

    git archive HEAD | (mkdir -p .old && tar -x -C .old)       # the dev machine; .old is ignored
    tools/ab_train.py --model d12 -B 64 --steps 20 --rounds 2 \\
        old=.old  new=.  "sep=.:GPUCORE_SETTINGS=gelu_epilogue=0:--keep-gelu off"  "recompute=.::--keep-gelu off"

Every run: `gpucore train --dtype bf16 --device cuda` on Tiny Shakespeare (made with `gpucore
prepro` when missing), lr 3e-4, no validation, sampling or checkpoints. Logs under $OUT/ab_train.

The cuBLASLt algorithms are raced once and cached under HOME (~/.cache/gpucore). Variants that share
HOME share the race's picks; variants with a HOME each race their own, and at d48 the picks alone
have moved whole steps by 1.5% (tools/notes/profile.md, twenty-seventh session). So compare trees
whose GEMMs are the same with one HOME ("a=.old:HOME=/tmp/h" "b=.:HOME=/tmp/h"), and give a tree
its own HOME only when its caches' format or its GEMM paths differ (tools/ratio_check.sh's 843553c).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_variant(text: str):
    name, _, rest = text.partition("=")
    parts = rest.split(":", 2) + ["", ""]
    tree, env_text, extra = parts[0], parts[1], parts[2]
    if not name or not tree:
        raise SystemExit(f"variant {text!r}: expected NAME=TREE[:ENV=VALUE,...][:OPTIONS]")
    env = dict(kv.split("=", 1) for kv in env_text.split(",") if kv)
    return name, (ROOT / tree).resolve(), env, shlex.split(extra)


def run(variant, tag, args, log: Path) -> Path:
    name, tree, env, extra = variant
    metrics = log / f"{name}.{tag}.jsonl"
    cmd = [sys.executable, "-m", "gpucore.cli", "train", "--model", args.model, "-B", str(args.B), "-T", "1024",
           "--steps", str(args.steps), "--lr", "3e-4", "--dtype", "bf16", "--device", "cuda", "--val-every", "0",
           "--sample-every", "0", "--no-checkpoint", "--data", str(ROOT / "data" / "tinyshakespeare"),
           "--out-dir", str(log / f"{name}.{tag}"), "--metrics", str(metrics), *extra]
    full_env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1", **env}
    with open(log / f"{name}.{tag}.txt", "w") as out:
        rc = subprocess.run(cmd, cwd=tree, env=full_env, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc:
        tail = (log / f"{name}.{tag}.txt").read_text().splitlines()[-8:]
        raise SystemExit(f"{name} run {tag} failed (exit {rc}):\n" + "\n".join(tail))
    return metrics


def read(metrics: Path):
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    end = next((r for r in recs if r.get("event") == "end"), {})
    return steps, end.get("peak_gpu_bytes")


def steady_median(steps, key, skip):
    """The median of one metric ("ms", "tokens_per_s") over a run's steps after the first `skip`."""
    return statistics.median(x[key] for x in steps[skip:])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+")
    p.add_argument("--model", default="d12")
    p.add_argument("-B", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip", type=int, default=1,
                   help="steps left out of the medians (default 1: compiles and the GEMM race). Steady state "
                        "wants 20-40: FP8's scales settle and bf16's GEMMs draw more power as training leaves "
                        "its initial values (tools/notes/profile.md, forty-first session)")
    p.add_argument("--json", help="also write the summary (per variant: ms/step, tokens/s, pool peak) here")
    args = p.parse_args()
    if not 1 <= args.skip < args.steps:
        p.error(f"--skip must be at least 1 and below --steps ({args.steps}), got {args.skip}")
    variants = [parse_variant(v) for v in args.variants]
    # absolute: each run's working directory is its own tree, where a relative OUT would point elsewhere
    log = Path(os.environ.get("OUT", ROOT / "out")).resolve() / "ab_train"
    log.mkdir(parents=True, exist_ok=True)
    if not (ROOT / "data" / "tinyshakespeare" / "tinyshakespeare_train.bin").exists():
        subprocess.run([sys.executable, "-m", "gpucore.cli", "prepro"], cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
    results = {v[0]: [] for v in variants}
    for r in range(1, args.rounds + 1):
        for v in variants:
            results[v[0]].append(read(run(v, str(r), args, log)))
            steps = results[v[0]][-1][0]
            print(f"{v[0]} round {r}: median {steady_median(steps, 'ms', args.skip):.1f} ms/step", flush=True)

    # bf16 unless a variant's options say otherwise (e.g. --dtype fp8)
    print(f"================ ab_train summary ({args.model} B={args.B} T=1024, {args.steps} steps, "
          f"{args.rounds} rounds, medians of steps {args.skip + 1}-{args.steps}) ================")
    first = None
    summary = {}
    for name, runs in results.items():
        ms = statistics.median(steady_median(steps, "ms", args.skip) for steps, _ in runs)
        tps = statistics.median(steady_median(steps, "tokens_per_s", args.skip) for steps, _ in runs)
        first = first or ms
        peak = max((pk or 0) for _, pk in runs)
        summary[name] = {"ms": ms, "tokens_per_s": tps, "peak_bytes": peak}
        losses = [[x["loss"] for x in steps] for steps, _ in runs]
        det = "bitwise" if all(ls == losses[0] for ls in losses) else "DIFFER"
        print(f"{name:<14} {ms:8.1f} ms/step {tps:>10,.0f} tok/s  x{first / ms:.3f} vs {variants[0][0]}  "
              f"pool peak {peak / 1e9:6.2f} GB  loss@{runs[0][0][-1]['step']} {losses[0][-1]:.6f}  rounds {det}")
    names = list(results)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            la = [x["loss"] for x in results[a][0][0]]
            lb = [x["loss"] for x in results[b][0][0]]
            worst = max(abs(x - y) / abs(x) for x, y in zip(la, lb))
            print(f"losses {a} vs {b}: " + ("bitwise identical" if la == lb else f"max rel diff {worst:.2e}"))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "B": args.B, "steps": args.steps,
                                               "skip": args.skip, "rounds": args.rounds, "variants": summary},
                                              indent=1))


if __name__ == "__main__":
    main()
