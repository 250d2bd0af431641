# check_common.sh -- sourced by the device check scripts (speed_check.sh, fp8_check.sh,
# graph_check.sh): what they share, once.
#   check_begin NAME     PYTHONPATH, PY, LOG = $OUT/NAME (absolute), and the GPU line
#   run_gpu_tests SECS   pytest -m cuda $TESTS ("none": skipped) into $LOG/pytest.txt, its tail
#                        shown; test_status = its summary line (for the script's summary)
# The caller has already cd'ed to the repository root.

check_begin() {
  export PYTHONPATH=. PYTHONUNBUFFERED=1
  PY=${PYTHON:-python3}
  LOG=${OUT:-out}/$1
  mkdir -p "$LOG" && LOG=$(cd "$LOG" && pwd)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1
}

run_gpu_tests() {
  test_status=skipped
  if [ "$TESTS" != none ]; then
    timeout "${TEST_TIMEOUT:-$1}" $PY -m pytest -m cuda -q -p no:cacheprovider $TESTS 2>&1 \
      | tee "$LOG/pytest.txt" | tail -25
    test_status=$(grep -E "(passed|failed|error|skipped)" "$LOG/pytest.txt" | tail -1)
  fi
}
