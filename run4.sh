#!/usr/bin/env bash
export PYTHONPATH=. PYTHONUNBUFFERED=1
t0=$(date +%s)
OUT=$OUT/gc BENCHES=gelu timeout 420 tools/gpu_check.sh 2>&1 | tail -12
echo "gpu_check done at $(( $(date +%s) - t0 )) s"
left=$(( 585 - ($(date +%s) - t0) ))
OUT=$OUT timeout $left python3 tools/ab_train.py --model d12 -B 64 --steps 12 --rounds 1 \
   "old=.mid:HOME=/tmp/h_old" "new=.:HOME=/tmp/h_new" "old8=.mid:HOME=/tmp/h_old:--dtype fp8" "new8=.:HOME=/tmp/h_new:--dtype fp8" 2>&1 | tail -9
echo "all done at $(( $(date +%s) - t0 )) s"
