#!/usr/bin/env bash
# seeds_pair.sh -- tools/fp8_seeds.sh split over a host's GPUs: one seed a GPU at a time, the runs'
# metrics and logs tarred into $OUT/seeds.tgz (a device call returns only a few files).
#   WARM=1 SHUFFLE=1 B=64 CORPUS=python MODES="adamw fp8-sparse" tools/probes/seeds_pair.sh "1337 7" "42 1"
# Each argument is one GPU's seeds, in order. WARM=1 first builds the corpus and the cuBLASLt tune
# cache with a 2-step run, so the GPUs' runs do not race to write them.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
WORK=${WORK:-/tmp/seeds_pair}
mkdir -p "$WORK"
if [ "${WARM:-0}" = 1 ]; then
  STEPS=2 RUNS=adamw OUT=$WORK/warm tools/optimizer_lab.sh > "$WORK/warm.log" 2>&1 || tail -20 "$WORK/warm.log"
fi
gpu=0
for seeds in "$@"; do
  CUDA_VISIBLE_DEVICES=$gpu SEEDS="$seeds" OUT=$WORK/g$gpu tools/fp8_seeds.sh > "$WORK/g$gpu.log" 2>&1 &
  gpu=$((gpu + 1))
done
wait
mkdir -p "$WORK/all"
cp "$WORK"/g*/fp8_seeds/*.s*.jsonl "$WORK"/g*/fp8_seeds/*.s*.txt "$WORK/all/" 2>/dev/null
tar -czf "${OUT:-out}/seeds.tgz" -C "$WORK" all
for f in "$WORK"/g*.log; do echo "== $f"; tail -16 "$f"; done
