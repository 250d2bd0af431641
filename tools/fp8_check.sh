#!/usr/bin/env bash
# fp8_check.sh [OLD_TREE] -- issue 16's measurement in one device call: the FP8 GPU tests, whole
# d12 trainings of bf16 against each FP8 scaling mode side by side (tools/ab_train.py; with
# OLD_TREE also that tree's FP8 default), and `gpucore profile --dtype fp8`; a summary last.
#
#   git archive HEAD | (mkdir -p .old && tar -x -C .old)     # dev machine, before committing
#   tools/fp8_check.sh .old                                    # GPU machine (carry .old)
#   MODES="adaptive delayed" B=64 STEPS=20 ROUNDS=2 TESTS=none tools/fp8_check.sh
#
# Logs: $OUT/fp8_check.
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=${1:-}
. tools/check_common.sh
TESTS=${TESTS:-tests/test_fp8.py tests/test_model.py tests/test_train.py tests/test_train_resume.py tests/test_profile.py}
MODES=${MODES:-adaptive current delayed}
MODEL=${MODEL:-d12}
B=${B:-64}
STEPS=${STEPS:-15}
ROUNDS=${ROUNDS:-1}
check_begin fp8_check
run_gpu_tests 300

variants=("bf16=.")
[ -n "$OLD" ] && variants+=("old-fp8=$OLD::--dtype fp8")
for m in $MODES; do variants+=("fp8-$m=.::--dtype fp8 --fp8-scaling $m"); done
OUT=$LOG $PY tools/ab_train.py --model "$MODEL" -B "$B" --steps "$STEPS" --rounds "$ROUNDS" "${variants[@]}" \
  2>&1 | tee "$LOG/ab.txt" | tail -14

if [ -z "${SKIP_PROFILE:-}" ]; then
  $PY -m gpucore.cli profile --model "$MODEL" -B "$B" --steps 3 --dtype fp8 --json "$LOG/profile_fp8.json" \
    > "$LOG/profile_fp8.txt" 2>&1
fi

echo
echo "================ fp8_check summary ================"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
echo "pytest -m cuda ($TESTS): $test_status"
grep -A14 "ab_train summary" "$LOG/ab.txt"
[ -f "$LOG/profile_fp8.txt" ] && { echo "-- profile, --dtype fp8 (adaptive)"; grep -E "^($MODEL|fp8|matmul|attention|step|sum|host)" "$LOG/profile_fp8.txt"; }
