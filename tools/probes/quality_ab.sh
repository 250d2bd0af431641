#!/usr/bin/env bash
# quality_ab.sh -- issue 16's 1,000-step quality runs (tools/optimizer_lab.sh's recipe: d12 B=16,
# warmup 100, lr 6e-4, the Python stdlib corpus) of several trees side by side, one run at a time,
# then a table of their validation losses and largest gradient norms. Each RUN is LABEL=TREE:MODE:SEED
# (MODE one of optimizer_lab.sh's runs), e.g. to ask whether a change moved a loss spike:
#   tools/probes/quality_ab.sh new=.:fp8-sparse:1337 old=.base:fp8-sparse:1337 bf16=.:adamw:1337
# The trees share this tree's corpus (data/pystdlib, built by the first run) and one HOME.
# Metrics: $OUT/quality_ab/LABEL.jsonl; STEPS (default 1000) passes through to optimizer_lab.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
mkdir -p "${OUT:-out}/quality_ab"
LOG=$(cd "${OUT:-out}/quality_ab" && pwd)   # absolute: each run starts in its own tree
for spec in "$@"; do
  label=${spec%%=*}; rest=${spec#*=}
  IFS=: read -r tree mode seed <<< "$rest"
  if [ "$tree" != . ] && [ -f data/pystdlib/corpus_train.bin ] && [ ! -e "$tree/data/pystdlib" ]; then
    mkdir -p "$tree/data" && ln -s "$ROOT/data/pystdlib" "$tree/data/pystdlib"
  fi
  start=$(date +%s)
  (cd "$tree" && OUT="$LOG/run_$label" SEED="$seed" RUNS="$mode" tools/optimizer_lab.sh) \
    > "$LOG/$label.txt" 2>&1 || echo "$label FAILED"
  cp "$LOG/run_$label/optimizer_lab/$mode.jsonl" "$LOG/$label.jsonl" 2>/dev/null || echo "$label: no metrics"
  echo "$label ($tree $mode seed $seed): $(( $(date +%s) - start )) s"
done
echo "================ quality_ab summary ================"
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
${PYTHON:-python3} - "$LOG" "$@" <<'PY'
import json, sys
from pathlib import Path
log, labels = Path(sys.argv[1]), [s.split("=", 1)[0] for s in sys.argv[2:]]
runs = {}
for lab in labels:
    p = log / f"{lab}.jsonl"
    if p.exists():
        recs = [json.loads(line) for line in p.read_text().splitlines()]
        runs[lab] = ({r["step"]: r["val_loss"] for r in recs if "val_loss" in r},
                     {r["step"]: r["grad_norm"] for r in recs if "grad_norm" in r})
print("val loss  step " + "".join(f"{lab:>12}" for lab in runs))
for s in sorted({s for v, _ in runs.values() for s in v}):
    print(f"{s:>15} " + "".join(f"{v[s]:>12.4f}" if s in v else f"{'-':>12}" for v, _ in runs.values()))
for lab, (_, g) in runs.items():   # steps 1-20 start from random weights: their norms are large anyway
    top = sorted(((n, s) for s, n in g.items() if s > 20), reverse=True)[:4]
    print(f"{lab}: largest grad norms after step 20: " + ", ".join(f"{n:.1f} (step {s})" for n, s in top))
PY
