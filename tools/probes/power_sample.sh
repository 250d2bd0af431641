#!/usr/bin/env bash
# power_sample.sh CMD... -- run CMD while nvidia-smi samples the GPU every 100 ms; print the median
# power draw, SM clock and the throttle reasons seen during the busiest half of the samples.
# Answers: is a training step power-limited (clocks falling under load), so that a memory-bound
# kernel made faster gives back less than its own time?   tools/probes/power_sample.sh gpucore train ...
#
# PARTS=N also splits the busy samples into N equal parts of time and prints each part's median SM
# clock, power and temperature. Answers: does a run's step time drift because the clock does, and
# is that heat (the temperature climbs with it) or the data (power at the cap, the clock falling at
# a steady temperature)? tools/notes/profile.md, forty-first session:
#   PARTS=5 tools/probes/power_sample.sh python3 -m gpucore.cli train --steps 80 ...
set -uo pipefail
LOG=$(mktemp)
nvidia-smi --query-gpu=power.draw,power.limit,clocks.sm,clocks.max.sm,clocks_throttle_reasons.active,utilization.gpu,temperature.gpu \
  --format=csv,noheader,nounits -lms 100 > "$LOG" &
SMI=$!
"$@" > /dev/null 2>&1
rc=$?
kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
python3 - "$LOG" "${PARTS:-0}" <<'PY'
import statistics, sys
rows = [[c.strip() for c in l.split(",")] for l in open(sys.argv[1]) if l.count(",") >= 6]
busy = [r for r in rows if r[5].isdigit() and int(r[5]) >= 90]
if not busy:
    sys.exit("no busy samples")
pw = [float(r[0]) for r in busy]
clk = [float(r[2]) for r in busy]
reasons = sorted({r[4] for r in busy})
print(f"{len(busy)} busy samples: power {statistics.median(pw):.0f} W median (limit {busy[0][1]} W), "
      f"SM clock {statistics.median(clk):.0f} MHz median (max {busy[0][3]}), min {min(clk):.0f}; throttle reasons {reasons}")
parts, n = int(sys.argv[2]), len(busy)
for part in range(parts if n >= parts else 0):
    chunk = busy[part * n // parts:(part + 1) * n // parts]
    med = lambda i: statistics.median(float(r[i]) for r in chunk)
    print(f"part {part + 1}/{parts} ({len(chunk)} samples): SM clock {med(2):.0f} MHz, power {med(0):.0f} W, "
          f"temperature {med(6):.0f} C")
PY
rm -f "$LOG"
exit $rc
