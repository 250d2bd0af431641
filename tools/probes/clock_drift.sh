#!/usr/bin/env bash
# clock_drift.sh CMD... -- run CMD (a training run) while nvidia-smi samples the GPU every 100 ms, then
# print the busy samples in five equal parts of time: median SM clock, power and GPU temperature
# in each. Answers: does a run's step time drift because the clock does, and is that heat (the
# temperature climbs with it) or the data (power at the cap is the same, the clock falls at a steady
# temperature)?      tools/probes/clock_drift.sh python3 -m gpucore.cli train --steps 80 ...
set -uo pipefail
LOG=$(mktemp)
nvidia-smi --query-gpu=power.draw,clocks.sm,temperature.gpu,utilization.gpu \
  --format=csv,noheader,nounits -lms 100 > "$LOG" &
SMI=$!
"$@" > /dev/null 2>&1
rc=$?
kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
python3 - "$LOG" <<'PY'
import statistics, sys
rows = [[c.strip() for c in l.split(",")] for l in open(sys.argv[1]) if l.count(",") >= 3]
busy = [r for r in rows if r[3].isdigit() and int(r[3]) >= 90]
if len(busy) < 10:
    sys.exit(f"only {len(busy)} busy samples")
n = len(busy)
for part in range(5):
    chunk = busy[part * n // 5:(part + 1) * n // 5]
    med = lambda i: statistics.median(float(r[i]) for r in chunk)
    print(f"part {part + 1}/5 ({len(chunk)} samples): SM clock {med(1):.0f} MHz, power {med(0):.0f} W, "
          f"temperature {med(2):.0f} C")
PY
rm -f "$LOG"
exit $rc
