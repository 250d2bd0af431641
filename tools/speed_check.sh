#!/usr/bin/env bash
# speed_check.sh OLD_TREE -- issue 15's measurement in one device call: the GPU tests of the ops a
# speed change touched, the whole-step A/B of the old tree against this one (and variants of this
# one), and `gpucore profile` of both trees; a summary last.
#
#   git archive HEAD | (mkdir -p .old && tar -x -C .old)     # dev machine, before committing
#   tools/speed_check.sh .old                                  # GPU machine (carry .old)
#   TESTS="tests/test_model.py" MODELS="d12:64 d48:16" tools/speed_check.sh .old
#
# VARIANTS (this tree with other settings) default to the GELU choices of issue 15: "sep" (GELU in
# separate kernels, recomputed: the old arithmetic, so its losses must equal old's bit for bit) and
# "recompute" (GELU epilogues, outputs recomputed in the backward). Logs: $OUT/speed_check.
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=${1:?usage: tools/speed_check.sh OLD_TREE_DIR}
. tools/check_common.sh
TESTS=${TESTS:-tests/test_matmul.py tests/test_model.py tests/test_cublas.py tests/test_gelu.py}
MODELS=${MODELS:-d12:64}
STEPS=${STEPS:-20}
ROUNDS=${ROUNDS:-2}
check_begin speed_check
run_gpu_tests 240

if [ -n "${VARIANTS+x}" ]; then read -r -a variants <<< "$VARIANTS"   # space-separated, no spaces inside
else variants=("sep=.:GPUCORE_SETTINGS=gelu_epilogue=0:--keep-gelu=off" "recompute=.::--keep-gelu=off"); fi
for mb in $MODELS; do
  m=${mb%%:*}; b=${mb##*:}
  OUT=$LOG/$m $PY tools/ab_train.py --model "$m" -B "$b" --steps "$STEPS" --rounds "$ROUNDS" "old=$OLD" new=. \
    "${variants[@]}" 2>&1 | tee "$LOG/ab_$m.txt" | tail -12
done

if [ -z "${SKIP_PROFILE:-}" ]; then
  for side in old new; do
    tree=$([ $side = old ] && echo "$OLD" || echo .)
    (cd "$tree" && PYTHONPATH=. $PY -m gpucore.cli profile --model d12 -B 64 --steps 3 \
       --json "$LOG/profile_$side.json") > "$LOG/profile_$side.txt" 2>&1
  done
fi

echo
echo "================ speed_check summary ================"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
echo "pytest -m cuda ($TESTS): $test_status"
for mb in $MODELS; do grep -A12 "ab_train summary" "$LOG/ab_${mb%%:*}.txt"; done
for side in old new; do
  [ -f "$LOG/profile_$side.txt" ] && { echo "-- profile, $side tree"; grep -E "^(d12|matmul|attention|gelu|step|sum|host)" "$LOG/profile_$side.txt"; }
done
