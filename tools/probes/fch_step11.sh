#!/usr/bin/env bash
# fch_step11.sh -- probe: is fch-as-E4M3's step-11 loss spike (settings.fp8_fch_e4m3, no warmup,
# tools/notes/fp8.md, 52nd session) made by the weights it reached, or by step 11's forward?
# Trains ab_train's recipe (d12 B=64, lr 3e-4, no warmup, Tiny Shakespeare, FP8) STEPS_BEFORE steps
# with fch in E4M3 and a checkpoint there, then resumes that checkpoint for one step twice: fch in
# E4M3 (bitwise the straight run, so the spike again) and fch in bf16. Both spike: the weights (the
# trajectory) did it. Only the E4M3 one: its forward parts from bf16 fch's on that batch.
#   tools/probes/fch_step11.sh                 # on the device; summary last
#   STEPS_BEFORE=10 MODEL=d12 B=64 tools/probes/fch_step11.sh
#   MODEL=tiny B=2 T=64 DEVICE=cpu STEPS_BEFORE=3 tools/probes/fch_step11.sh      # the plumbing, on a CPU
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STEPS_BEFORE=${STEPS_BEFORE:-10}
MODEL=${MODEL:-d12}
B=${B:-64}
T=${T:-1024}
DEVICE=${DEVICE:-cuda}
LOG=${OUT:-out}/fch_step11
DATA=data/tinyshakespeare
mkdir -p "$LOG"
[ -d "$DATA" ] || $PY -m gpucore.cli prepro > /dev/null
common=(-B "$B" -T "$T" --lr 3e-4 --device "$DEVICE" --val-every 0 --sample-every 0 --data "$DATA")
GPUCORE_SETTINGS=fp8_fch_e4m3=1 $PY -m gpucore.cli train --model "$MODEL" --dtype fp8 "${common[@]}" --steps $((STEPS_BEFORE + 1)) \
  --ckpt-every "$STEPS_BEFORE" --out-dir "$LOG/straight" --metrics "$LOG/straight.jsonl" > "$LOG/straight.txt" 2>&1
ckpt=$(ls "$LOG"/straight/ckpt_*"$STEPS_BEFORE".ckpt | head -1)
for fch8 in 1 0; do
  GPUCORE_SETTINGS=fp8_fch_e4m3=$fch8 $PY -m gpucore.cli train --resume "$ckpt" --steps $((STEPS_BEFORE + 1)) \
    "${common[@]}" --no-checkpoint --out-dir "$LOG/resumed$fch8" --metrics "$LOG/resumed$fch8.jsonl" \
    > "$LOG/resumed$fch8.txt" 2>&1
done
echo "================ fch_step11 summary ================"
$PY - "$LOG" "$STEPS_BEFORE" <<'PY'
import json, sys
from pathlib import Path
log, n = Path(sys.argv[1]), int(sys.argv[2])
def losses(name):
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, (log / f"{name}.jsonl").open()) if "loss" in r}
s = losses("straight")
print("straight, fch E4M3: " + " ".join(f"{k}:{v[0]:.3f}/{v[1]:.1f}" for k, v in sorted(s.items())))
for fch8, what in (("1", "E4M3"), ("0", "bf16")):
    r = losses(f"resumed{fch8}")
    print(f"step {n + 1} from step {n}'s checkpoint, fch {what}: loss {r[n + 1][0]:.4f}, grad norm {r[n + 1][1]:.2f}")
PY
