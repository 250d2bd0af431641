#!/usr/bin/env bash
# ab_d12.sh OLD_TREE -- the d12 training step of another source tree and of this one, timed in
# alternation in one device call (machines differ by 5-10%, so only this comparison is fair).
#
#   git archive 96e5f43 | (mkdir -p .old && tar -x -C .old)    # on the dev machine; .old is ignored
#   tools/ab_d12.sh .old                                          # on the GPU machine (carry .old)
#
# Runs old, new, old, new, ... (ROUNDS, default 2) d12 runs of STEPS (default 20) at B=64, T=1024,
# bf16, then prints the median step time of each run (step 1 excluded: compile and autotune), and
# whether the losses agree bit for bit: new vs new (determinism) and old vs new (both read the same
# cuBLASLt tune cache, so unchanged kernels must give the same bits). Logs: $OUT/ab_d12.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OLD=$(cd "${1:?usage: tools/ab_d12.sh OLD_TREE_DIR}" && pwd)
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-20}
B=${B:-64}
PY=${PYTHON:-python3}
LOG=${OUT:-$ROOT/out}/ab_d12
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
[ -f data/tinyshakespeare/tinyshakespeare_train.bin ] || PYTHONPATH=. $PY -m gpucore.cli prepro >/dev/null

for r in $(seq "$ROUNDS"); do
  for side in old new; do
    tree=$([ "$side" = old ] && echo "$OLD" || echo "$ROOT")
    (cd "$tree" && PYTHONPATH=. $PY -m gpucore.cli train --model d12 -B "$B" -T 1024 --steps "$STEPS" --lr 3e-4 \
       --dtype bf16 --device cuda --val-every 0 --sample-every 0 --no-checkpoint \
       --data "$ROOT/data/tinyshakespeare" --out-dir "$LOG/$side$r" --metrics "$LOG/$side$r.jsonl") \
       > "$LOG/$side$r.txt" 2>&1 || { echo "$side run $r failed:"; tail -5 "$LOG/$side$r.txt"; exit 1; }
  done
done

echo "================ ab_d12 summary (B=$B, $STEPS steps, $ROUNDS rounds) ================"
$PY - "$LOG" "$ROUNDS" <<'PY'
import json, statistics, sys
from pathlib import Path
log, rounds = Path(sys.argv[1]), int(sys.argv[2])
runs = {}
for side in ("old", "new"):
    for r in range(1, rounds + 1):
        recs = [json.loads(l) for l in (log / f"{side}{r}.jsonl").read_text().splitlines()]
        runs[side, r] = [x for x in recs if "loss" in x]
for (side, r), steps in runs.items():
    ms = statistics.median(x["ms"] for x in steps[1:])
    print(f"{side} run {r}: median {ms:.1f} ms/step, loss at step {steps[-1]['step']} {steps[-1]['loss']:.6f}")
med = {s: statistics.median(statistics.median(x["ms"] for x in runs[s, r][1:]) for r in range(1, rounds + 1))
       for s in ("old", "new")}
print(f"new / old step time: {med['new'] / med['old']:.3f} (old {med['old']:.1f} ms, new {med['new']:.1f} ms)")
losses = {k: [x["loss"] for x in v] for k, v in runs.items()}
new_det = all(losses["new", r] == losses["new", 1] for r in range(1, rounds + 1))
old_new = losses["old", 1] == losses["new", 1]
print(f"determinism, new tree ({rounds} runs): {'PASS bitwise identical' if new_det else 'FAIL'}")
print(f"old vs new losses: {'bitwise identical' if old_new else 'DIFFER: ' + str(losses['old', 1][:3]) + ' vs ' + str(losses['new', 1][:3])}")
PY
