#!/usr/bin/env bash
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
t0=$(date +%s)
OUT=$OUT timeout 580 python3 tools/ab_train.py --model d48 -B 16 --steps 20 --rounds 2 --json $OUT/ab48f.json \
   "old8=.mid:HOME=/tmp/h_old:--dtype fp8" "new8=.:HOME=/tmp/h_new:--dtype fp8" 2>&1 | tail -10
echo "all done at $(( $(date +%s) - t0 )) s"
