#!/usr/bin/env bash
# graph_check.sh [OLD_TREE] -- the CUDA-graph step (--cuda-graph) in one device call: its GPU tests
# and those of the ops it touches, then whole trainings eager vs graphed for bf16 and FP8 at each
# batch size (tools/ab_train.py, side by side; with OLD_TREE also that tree, whose bf16 losses the
# eager run must reproduce bit for bit), and `gpucore profile` (its graph row); a summary last.
#
#   git archive HEAD | (mkdir -p .old && tar -x -C .old)     # dev machine, before committing
#   tools/graph_check.sh .old                                  # GPU machine (carry .old)
#   MODEL=d48 BS=16 STEPS=10 TESTS=none tools/graph_check.sh
#
# Logs: $OUT/graph_check.
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=${1:-}
. tools/check_common.sh
TESTS=${TESTS:-tests/test_step_graph.py tests/test_cublas.py tests/test_matmul.py}
MODEL=${MODEL:-d12}
BS=${BS:-64 16}
DTYPES=${DTYPES:-bf16 fp8}
STEPS=${STEPS:-20}
ROUNDS=${ROUNDS:-1}
check_begin graph_check
run_gpu_tests 400

for B in $BS; do
  variants=()
  for dt in $DTYPES; do
    [ -n "$OLD" ] && [ "$dt" = bf16 ] && variants+=("old-$dt=$OLD::--dtype $dt")
    variants+=("eager-$dt=.::--dtype $dt --cuda-graph off" "graph-$dt=.::--dtype $dt --cuda-graph on")
  done
  OUT=$LOG/B$B $PY tools/ab_train.py --model "$MODEL" -B "$B" --steps "$STEPS" --rounds "$ROUNDS" "${variants[@]}" \
    2>&1 | tee "$LOG/ab_B$B.txt" | tail -20
done

if [ -z "${SKIP_PROFILE:-}" ]; then
  for B in $BS; do
    $PY -m gpucore.cli profile --model "$MODEL" -B "$B" --steps 3 --dtype fp8 > "$LOG/profile_fp8_B$B.txt" 2>&1
  done
fi

echo
echo "================ graph_check summary ================"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
echo "pytest -m cuda ($TESTS): $test_status"
for B in $BS; do
  grep -A20 "ab_train summary" "$LOG/ab_B$B.txt"
done
for B in $BS; do
  [ -f "$LOG/profile_fp8_B$B.txt" ] && { echo "-- profile $MODEL B=$B --dtype fp8"; grep -E "^($MODEL|sum|host|step)" "$LOG/profile_fp8_B$B.txt"; }
done
