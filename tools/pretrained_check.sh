#!/usr/bin/env bash
# pretrained_check.sh -- on the GPU machine (which has torch + transformers as test oracles): make a
# random Hugging Face GPT-2 124M (d12) with transformers, fine-tune it with `gpucore train --init-from`
# on Tiny Shakespeare, export the result back to HF and to llm.c, and check that transformers loads
# the export with the same logits as gpucore. Prints a summary last. Logs: $OUT/pretrained.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOG=${OUT:-out}/pretrained
STEPS=${STEPS:-20}
mkdir -p "$LOG"
[ -f data/tinyshakespeare/tinyshakespeare_train.bin ] || $PY -m gpucore.cli prepro >/dev/null
$PY - "$LOG/hf_d12" <<'PY'
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config()).save_pretrained(sys.argv[1], safe_serialization=True)   # GPT-2 124M shape
PY
$PY -m gpucore.cli train --init-from "$LOG/hf_d12" -B 16 -T 1024 --steps "$STEPS" --lr 3e-4 --device cuda \
  --val-every 0 --sample-every 0 --out-dir "$LOG/run" --metrics "$LOG/metrics.jsonl" 2>&1 | tee "$LOG/train.txt" | tail -4
$PY -m gpucore.cli export "$LOG/run" --format hf --out "$LOG/export_hf"
$PY -m gpucore.cli export "$LOG/run" --format llmc --out "$LOG/export.bin"
echo "================ pretrained_check summary ================"
$PY - "$LOG" <<'PY'
import json, sys
import numpy as np, torch, cupy as cp
from pathlib import Path
from transformers import GPT2LMHeadModel
from gpucore.weights import load_gpt2
log = Path(sys.argv[1])
rows = [json.loads(l) for l in (log / "metrics.jsonl").read_text().splitlines()]
losses = [r["loss"] for r in rows if "loss" in r]
print(f"fine-tune from a transformers d12: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps: "
      f"{'PASS falls' if losses[-1] < losses[0] else 'FAIL'}")
tokens = np.random.default_rng(0).integers(0, 50257, (2, 64)).astype(np.int32)
hf = GPT2LMHeadModel.from_pretrained(log / "export_hf").eval()
with torch.no_grad():
    ref = hf(torch.from_numpy(tokens.astype(np.int64))).logits.double().numpy()
for src in ("export_hf", "export.bin"):
    model, _ = load_gpt2(log / src, xp=cp, dtype="float32")
    _, logits = model.forward(cp.asarray(tokens), return_logits=True)
    got = cp.asnumpy(logits)[..., :50257].astype(np.float64)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"gpucore ({src}) vs transformers (export_hf) logits: max rel err {err:.2e} "
          f"{'PASS' if err < 1e-5 else 'FAIL'} (1e-5)")
PY
