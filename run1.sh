#!/usr/bin/env bash
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
mkdir -p $OUT
t0=$(date +%s)
python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_gelu.py tests/test_fp8.py tests/test_model.py 2>&1 | tail -12
echo "tests took $(( $(date +%s) - t0 )) s"
python3 tools/probes/gelu_remake.py 2>&1 | tail -6
echo "probe done at $(( $(date +%s) - t0 )) s"
OUT=$OUT timeout $(( 590 - ($(date +%s) - t0) )) python3 tools/ab_train.py --model d48 -B 16 --steps 12 --rounds 2 --json $OUT/ab48.json \
   "old=.mid:HOME=/tmp/h_old" "new=.:HOME=/tmp/h_new" 2>&1 | tail -14
echo "all done at $(( $(date +%s) - t0 )) s"
