#!/usr/bin/env bash
# fp8_seeds.sh -- issue 16's quality study with several seeds: tools/optimizer_lab.sh's 1,000-step
# d12 runs (B=16, warmup 100, the Python stdlib corpus) for each MODE and SEED, then
# tools/fp8_seeds.py's table: FP8 against bf16's own seed-to-seed spread. Logs: $OUT/fp8_seeds.
#   SEEDS="1337 7 42" MODES="adamw fp8 fp8-head" tools/fp8_seeds.sh
# The default MODES set bf16 against fp8-sparse, the recipe `--dtype fp8` runs by default. Add
# adamw-order (bf16, the bias gradients summed in another order) for the noise floor: how far bf16
# rounding alone moves a run of the same seed. SHUFFLE=1: the train batches in a per-epoch random
# order from each seed (`gpucore train --shuffle`) instead of the corpus's file order. B, LR and
# CORPUS pass through to tools/optimizer_lab.sh: B=64 CORPUS=python is the speed targets' batch on a
# corpus that 1,000 such steps do not repeat.
set -uo pipefail
cd "$(dirname "$0")/.."
SEEDS=${SEEDS:-1337 7 42}
MODES=${MODES:-adamw fp8-sparse}
LOG=${OUT:-out}/fp8_seeds
mkdir -p "$LOG"
for seed in $SEEDS; do
  for mode in $MODES; do
    OUT=$LOG/run SEED=$seed RUNS=$mode tools/optimizer_lab.sh > "$LOG/$mode.s$seed.txt" 2>&1 || echo "$mode seed $seed FAILED"
    cp "$LOG/run/optimizer_lab/$mode.jsonl" "$LOG/$mode.s$seed.jsonl" 2>/dev/null || true
  done
done
echo "================ fp8_seeds summary ================"
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
${PYTHON:-python3} tools/fp8_seeds.py "$LOG" $MODES
