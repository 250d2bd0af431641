#!/usr/bin/env bash
# mem_peak.sh CMD... -- run CMD while nvidia-smi samples the GPU's memory.used every 100 ms; print
# the peak as nvidia-smi reports it (MiB) and in GB / GiB. The issues compare memory "by nvidia-smi"
# (llm.c: 25.3 GB at d12 B=64, 55.4 GB at d48 B=16); the CuPy pool's high-water mark that
# `gpucore memory` and ab_train print leaves out the CUDA context, cuBLAS's handles and the modules.
#   tools/probes/mem_peak.sh python3 tools/ab_train.py --model d48 -B 16 --steps 6 --rounds 1 new=.
set -uo pipefail
LOG=$(mktemp)
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$LOG" &
SMI=$!
"$@" > /dev/null 2>&1
rc=$?
kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
python3 - "$LOG" "$rc" <<'PY'
import sys
mib = [int(l) for l in open(sys.argv[1]) if l.strip().isdigit()]
if not mib:
    sys.exit("mem_peak: no samples")
peak = max(mib)
print(f"peak memory.used {peak} MiB = {peak * 2**20 / 1e9:.2f} GB = {peak / 1024:.2f} GiB "
      f"({len(mib)} samples, command exit {sys.argv[2]})")
PY
rm -f "$LOG"
exit $rc
