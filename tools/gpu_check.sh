#!/usr/bin/env bash
# gpu_check.sh -- run on a machine with an NVIDIA GPU (the device machine, a GPU CI runner):
# the GPU tests (pytest -m cuda), then the benchmarks, then a short summary last.
#
#   tools/gpu_check.sh                 # all GPU tests + all benchmarks
#   TESTS="tests/test_reduce.py" BENCHES="sum cast" tools/gpu_check.sh
#   SKIP_TESTS=1 BENCHES=matmul tools/gpu_check.sh
#   JOBS=4 BENCHES=none tools/gpu_check.sh    # the GPU tests in 4 processes at once (one GPU)
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
JOBS=${JOBS:-1}
# a pytest log's summary line (not simply its last line: warnings and messages printed at interpreter
# exit can follow it); nothing, and status 1, when the log has none (the process crashed)
summary_line() { grep -E "^[0-9]+ (passed|failed|skipped|deselected|errors?)\b.* in [0-9.]+s" "$1" | tail -1 | grep .; }
if [ -z "${SKIP_TESTS:-}" ] && [ "$JOBS" -le 1 ]; then
  $PY -m pytest -m cuda -q -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee "$LOG/pytest_cuda.txt" | tail -40
  test_status=$(summary_line "$LOG/pytest_cuda.txt" || echo "no pytest summary (did it crash? $LOG/pytest_cuda.txt)")
elif [ -z "${SKIP_TESTS:-}" ]; then
  # JOBS pytest processes on the one GPU over disjoint test files (largest files dealt first to the
  # lightest group): most of the suite's time is NVRTC compiles and host work, so this ends sooner.
  # The kernel cache's writes are atomic, so the processes may share it.
  mapfile -t groups < <($PY - "$JOBS" ${TESTS:-tests} <<'PYEOF'
import sys
from pathlib import Path
jobs, files = int(sys.argv[1]), []
for arg in sys.argv[2:]:
    p = Path(arg)
    files += sorted(p.rglob("test_*.py")) if p.is_dir() else [p]
groups = [[0, []] for _ in range(jobs)]
for f in sorted(files, key=lambda f: -f.stat().st_size):
    g = min(groups, key=lambda g: g[0])
    g[0] += f.stat().st_size
    g[1].append(str(f))
print("\n".join(" ".join(g[1]) for g in groups if g[1]))
PYEOF
)
  i=0
  for g in "${groups[@]}"; do
    i=$((i + 1))
    $PY -m pytest -m cuda -q -p no:cacheprovider $g > "$LOG/pytest_cuda.$i.txt" 2>&1 &
  done
  wait
  cat "$LOG"/pytest_cuda.[0-9]*.txt > "$LOG/pytest_cuda.txt"
  grep -E "^(FAILED|ERROR) " "$LOG/pytest_cuda.txt" | head -40
  # each process's summary line, summed; a process without one (it crashed) counts as an error
  test_status=$(for f in "$LOG"/pytest_cuda.[0-9]*.txt; do
      summary_line "$f" || echo "1 error (no pytest summary in $(basename "$f"))"; done | awk '
    { for (k = 2; k <= NF; k++) { w = $k; gsub(/[,=]/, "", w)
        if (w ~ /^(passed|failed|skipped|errors?)$/) n[w] += $(k - 1) } }
    END { printf "%d passed, %d failed, %d skipped, %d errors ('"$JOBS"' processes)",
          n["passed"], n["failed"], n["skipped"], n["error"] + n["errors"] }')
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
