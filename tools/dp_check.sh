#!/usr/bin/env bash
# dp_check.sh -- data-parallel training measured on this machine's GPUs, then a summary last.
#
# d12, B per GPU, T=1024, bf16, Tiny Shakespeare, in one call:
#   single   one GPU, plain run, gradient accumulation NPROC (the same global batch as NPROC GPUs)
#   dp       --nproc NPROC (gradients all-reduced after the graphed backward; dp_overlap=1: beside it)
#   zero     --nproc NPROC --zero 1 (ZeRO-1)
#   mpi      mpirun -np NPROC (when mpirun and mpi4py are there), ZeRO off
#   dp2      dp again: two data-parallel runs must give bitwise identical losses
#   kill     --nproc NPROC with rank 1 SIGKILLed after the first step: how the job ends, how fast
# and reports ms/step, tokens/s (median of steps 2..), the scaling against one GPU's tokens/s
# without accumulation (run "one"), peak memory per GPU, and whether the losses agree.
# With NPROC=1 the data-parallel runs go through NCCL with one rank and must match "single"
# bit for bit (issue 14); with NPROC=2 on two GPUs this is issue 19's measurement.
#
#   tools/dp_check.sh                 # NPROC = number of GPUs
#   NPROC=1 B=32 STEPS=12 tools/dp_check.sh
#   MODEL=d48 B=16 NPROC=2 tools/dp_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=${PYTHON:-python3}
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
B=${B:-64}
STEPS=${STEPS:-20}
MODEL=${MODEL:-d12}
T=${T:-1024}
DTYPE=${DTYPE:-bf16}
DEVICE=${DEVICE:-cuda}      # DEVICE=cpu MODEL=tiny T=64 DTYPE=fp32 NPROC=2: the script itself, on CPU ranks
LOG=${OUT:-out}/dp_check
if [ "$NPROC" = 1 ]; then RUNS=${RUNS:-single dp zero}; else RUNS=${RUNS:-one single dp zero mpi dp2 kill}; fi
mkdir -p "$LOG"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
[ -f data/tinyshakespeare/tinyshakespeare_train.bin ] || $PY -m gpucore.cli prepro

TOTAL=$((B * T * NPROC))
common=(--model "$MODEL" -B "$B" -T "$T" --steps "$STEPS" --lr 3e-4 --dtype "$DTYPE" --device "$DEVICE"
        --val-every 0 --sample-every 0 --no-checkpoint)
# kill: a long --nproc run; once a step is logged, SIGKILL rank 1 (found by its GPUCORE_RANK) and time
# how long the job takes to end. The launcher should name the dead rank and exit 1 within seconds.
kill_check() {
  local out=$1 job pid rc=0 t0 t1
  rm -rf "$out" "$out.jsonl"
  "$PY" -m gpucore.cli train "${common[@]}" --steps 100000 --nproc "$NPROC" --dist-timeout 30 \
    --out-dir "$out" --metrics "$out.jsonl" > "$out.txt" 2>&1 &
  job=$!
  for _ in $(seq 1200); do grep -qs '"loss"' "$out.jsonl" && break; sleep 0.5; done
  pid=$(grep -lzx 'GPUCORE_RANK=1' /proc/[0-9]*/environ 2>/dev/null | head -1 | cut -d/ -f3 || true)
  if [ -z "$pid" ]; then echo "kill: no rank 1 found" > "$out.result"; kill "$job" || true; return; fi
  t0=$(date +%s.%N); kill -9 "$pid"; wait "$job" || rc=$?; t1=$(date +%s.%N)
  { printf 'kill: rank 1 SIGKILLed after a step: the job exited %s after %.1f s\n' "$rc" "$(awk "BEGIN {print $t1 - $t0}")"
    grep -E "^(gpucore:|Error)" "$out.txt" | tail -3 | sed 's/^/  /'; } > "$out.result"
  cat "$out.result"
}

for run in $RUNS; do
  out="$LOG/$run"
  case $run in
    one)    cmd=($PY -m gpucore.cli train "${common[@]}") ;;
    single) cmd=($PY -m gpucore.cli train "${common[@]}" --total-batch-size "$TOTAL") ;;
    dp|dp2) cmd=($PY -m gpucore.cli train "${common[@]}" --nproc "$NPROC") ;;
    zero)   cmd=($PY -m gpucore.cli train "${common[@]}" --nproc "$NPROC" --zero 1) ;;
    mpi)    if ! command -v mpirun >/dev/null || ! $PY -c "import mpi4py" 2>/dev/null; then
              echo "mpi: skipped (no mpirun or mpi4py)"; continue; fi
            cmd=(mpirun --allow-run-as-root -np "$NPROC" $PY -m gpucore.cli train "${common[@]}") ;;
    kill)   kill_check "$out"; continue ;;
  esac
  echo "== $run: ${cmd[*]}"
  if ! "${cmd[@]}" --out-dir "$out" --metrics "$out.jsonl" > "$out.txt" 2>&1; then
    # MPICH's mpirun has no --allow-run-as-root: retry without it
    if [ "$run" = mpi ]; then
      mpirun -np "$NPROC" $PY -m gpucore.cli train "${common[@]}" --out-dir "$out" --metrics "$out.jsonl" \
        > "$out.txt" 2>&1 || { echo "mpi FAILED"; tail -5 "$out.txt"; }
    else
      echo "$run FAILED"; tail -5 "$out.txt"
    fi
  fi
  grep -E "^(step|data parallel|memory plan|GPU memory)" "$out.txt" | tail -3
done

echo
echo "================ dp_check summary ================"
$PY - "$LOG" "$NPROC" "$RUNS" <<'PY'
import json, statistics, sys
from pathlib import Path
log, nproc, runs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split()
res = {}
for run in runs:
    p = log / f"{run}.jsonl"
    if run == "kill":
        continue
    if not p.exists():
        continue
    recs = [json.loads(l) for l in p.read_text().splitlines()]
    train = [r for r in recs if "loss" in r]
    if len(train) < 2:
        continue
    end = next((r for r in recs if r.get("event") == "end"), {})
    res[run] = dict(ms=statistics.median(r["ms"] for r in train[1:]),
                    tps=statistics.median(r["tokens_per_s"] for r in train[1:]),
                    losses=[r["loss"] for r in train], peak=end.get("peak_gpu_bytes"))
print(f"GPUs {nproc}")
base = (res.get("one") or (res.get("single") if nproc == 1 else None) or {}).get("tps")
for run, r in res.items():
    scale = f" | x{r['tps'] / base:.3f} of one GPU" if base and run not in ("one",) and (nproc > 1 or run != "single") else ""
    peak = f" | peak {r['peak'] / 2**30:.2f} GiB (rank 0 pool)" if r["peak"] else ""
    print(f"{run:>6}: {r['ms']:.1f} ms/step | {r['tps']:,.0f} tok/s{scale}{peak} | final loss {r['losses'][-1]:.6f}")
ref = res.get("single")
for run in ("dp", "zero", "mpi"):
    if ref and run in res:
        a, b = ref["losses"], res[run]["losses"]
        same = a == b
        worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
        print(f"losses {run} vs single: {'bitwise identical' if same else f'max rel diff {worst:.2e}'}")
if "dp" in res and "dp2" in res:
    print(f"losses dp2 vs dp (two runs): {'bitwise identical' if res['dp']['losses'] == res['dp2']['losses'] else 'DIFFER'}")
kill = log / "kill.result"
if "kill" in runs and kill.exists():
    print(kill.read_text().rstrip())
PY
