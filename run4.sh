#!/bin/bash
export PYTHONPATH=.
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
python3 -m pytest -q -m cuda tests/test_layernorm.py 2>&1 | tail -2
python3 tools/probes/layernorm_fp8_rows.py .base 2>&1 | tail -12
OUT=$OUT/d12 timeout 420 python3 tools/ab_train.py --model d12 -B 64 --steps 20 --rounds 2 "base8=.base:HOME=/tmp/hb:--dtype fp8" "new8=.:HOME=/tmp/hn:--dtype fp8" "base=.base:HOME=/tmp/hb" "new=.:HOME=/tmp/hn" 2>&1 | tail -12
