#!/usr/bin/env bash
# gpu_check.sh -- run on a machine with an NVIDIA GPU (the device machine, a GPU CI runner):
# the GPU tests (pytest -m cuda), then the benchmarks, then a short summary last.
#
#   tools/gpu_check.sh                 # all GPU tests + all benchmarks
#   TESTS="tests/test_reduce.py" BENCHES="sum cast" tools/gpu_check.sh
#   SKIP_TESTS=1 BENCHES=matmul tools/gpu_check.sh
#
# Logs go to $OUT (if set) or ./out/. Runs from the source tree (PYTHONPATH=.).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOG=${OUT:-out}
mkdir -p "$LOG"
BENCHES=${BENCHES:-all}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1
$PY -m gpucore.cli info 2>&1 | tee "$LOG/info.txt"

test_status="skipped"
if [ -z "${SKIP_TESTS:-}" ]; then
  $PY -m pytest -m cuda -q -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee "$LOG/pytest_cuda.txt" | tail -40
  test_status=$(grep -E "^[0-9]+ (passed|failed)|(passed|failed|error)" "$LOG/pytest_cuda.txt" | tail -1)
fi

: > "$LOG/bench.txt"
if [ "$BENCHES" != "none" ]; then
  for b in $BENCHES; do
    $PY -m gpucore.cli bench "$b" 2>&1 | tee -a "$LOG/bench.txt"
  done
fi

echo
echo "================ gpu_check summary ================"
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
echo "pytest -m cuda: $test_status"
grep -E "target|TFLOP|GB/s|Error|error" "$LOG/bench.txt" | grep -v "^#" | cut -c1-160
