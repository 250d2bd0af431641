#!/usr/bin/env bash
# spike_seeds.sh -- probe: do runs without lr warmup take one-step loss spikes, in which modes, and how
# high? ab_train's recipe (d12 B=64, lr 3e-4, no warmup, Tiny Shakespeare in file order, so every seed
# meets the same batches) for STEPS steps, each MODE at each seed, one argument's seeds a GPU; then
# tools/probes/loss_spikes.py's lines and its per-mode summary, last. 71st and 72nd sessions, 36 seeds:
# bf16 9 (+0.5 to +5.8), FP8 with fch as E4M3 7 (+0.5 to +4.8), FP8 with fch in bf16 2 (+0.5, +2.2);
# tools/notes/fp8.md. The 72nd session ran it on 3 GPUs of one host: 24 seeds x 3 modes in 214 s.
#   MODES="bf16 fch16 fch8" tools/probes/spike_seeds.sh "1337 99 7" "42 1 2"     # two GPUs
# Modes: bf16; fp8 (--dtype fp8's default, whatever it is); fch16 and fch8 (FP8 with fp8_fch_e4m3=0 / 1:
# fch in bf16 / as E4M3, the default since the 72nd session). Logs: $OUT/spike_seeds.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STEPS=${STEPS:-15}
MODES=${MODES:-bf16 fch16 fch8}
LOG=${OUT:-out}/spike_seeds
variant() {     # MODE SEED -> ab_train's NAME=TREE:ENV:OPTIONS
  case $1 in
    bf16) echo "bf16-s$2=.::--seed $2" ;;
    fp8)  echo "fp8-s$2=.::--dtype fp8 --seed $2" ;;
    fch16) echo "fch16-s$2=.:GPUCORE_SETTINGS=fp8_fch_e4m3=0:--dtype fp8 --seed $2" ;;
    fch8) echo "fch8-s$2=.:GPUCORE_SETTINGS=fp8_fch_e4m3=1:--dtype fp8 --seed $2" ;;
    *) echo "MODES: unknown mode '$1' (bf16, fp8, fch16, fch8)" >&2; return 2 ;;
  esac
}
for m in $MODES; do variant "$m" 0 > /dev/null || exit 2; done      # a misspelt mode stops here, before any work
mkdir -p "$LOG"
[ -f data/tinyshakespeare/tinyshakespeare_train.bin ] || $PY -m gpucore.cli prepro > /dev/null
gpu=0
for seeds in "$@"; do
  vs=()
  for s in $seeds; do for m in $MODES; do vs+=("$(variant "$m" "$s")"); done; done
  CUDA_VISIBLE_DEVICES=$gpu OUT=$LOG/g$gpu $PY tools/ab_train.py --steps "$STEPS" --skip 1 --rounds 1 "${vs[@]}" \
    > "$LOG/g$gpu.log" 2>&1 &
  gpu=$((gpu + 1))
done
wait
mkdir -p "$LOG/all/ab_train"
cp "$LOG"/g*/ab_train/*.jsonl "$LOG/all/ab_train/" 2>/dev/null
echo "================ spike_seeds summary ($STEPS steps, no warmup) ================"
$PY tools/probes/loss_spikes.py "$LOG/all"
