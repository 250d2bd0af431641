#!/usr/bin/env bash
# optimizer_lab.sh -- issue 17's comparison on one GPU, then a summary last:
#   d12, B=16, T=1024, bf16, STEPS (default 1000) steps of the same data and seed with
#     adamw        AdamW, fp32 master weights (the default), warmup + cosine to 10%
#     adamw-order  adamw with the bias gradients summed by separate passes (fused_bias_grads=0): the same
#                  arithmetic in another order, so the run parts from adamw by bf16 rounding alone -- the
#                  control for issue 16's "same seed" comparison (how far rounding noise moves a run)
#     adamw-sparse adamw with the LM head's bf16 dlogits thinned below p = 2^-13 (bf16_lm_head_sparse)
#     sfadamw      schedule-free AdamW, same peak lr and warmup, no decay (evaluates its average x)
#     bf16-sr      AdamW, bf16 weights without the fp32 copy, stochastic rounding
#     bf16-kahan   AdamW, bf16 weights without the fp32 copy, bf16 Kahan compensation
#     fp8          AdamW, --dtype fp8 with the LM head in bf16 (the linears' GEMMs in FP8, adaptive scaling,
#                  exact accumulation in the backward: the fp8* runs below keep it, but fp8-fastdg)
#     fp8-current  the same with current scaling
#     fp8-delayed  the same with delayed scaling (RUNS="adamw fp8 fp8-current fp8-delayed" to compare)
#     fp8-head     fp8 with the LM head's GEMMs in FP8 too (settings.fp8_lm_head and fp8_lm_head_dwte: --dtype fp8's default)
#     fp8-head-bf16dw  the same with the head's dwte GEMM in bf16 (fp8_lm_head_dwte=0)
#     fp8-fastdg   fp8-head with the linears' dx GEMMs on fast FP8 accumulation
#     fp8-sparse   fp8-fastdg with the head's E5M2 dlogits thinned below p = 2^-13 (fp8_lm_head_sparse)
#                  and fch (the GELU input kept for the backward) as E4M3 (fp8_fch_e4m3): --dtype fp8's default
#     fp8-bf16fch  fp8-sparse with fch in bf16 (fp8_fch_e4m3=0): the default of the 68th-71st sessions
#     fp8-sparse-nopred  fp8-bf16fch without the predicted gradient scales (fp8_predict_scales=0): the
#                  arithmetic of the 61st-67th sessions, the control for the 68th session's change
#     fp8-sparse16 fp8-bf16fch thinned below p = 2^-16 only (~88% zeros, ~2.8x less noise on rare tokens)
#     fp8-fch8     the same as fp8-sparse since fch as E4M3 became the default (72nd session; the 71st's study)
#   (every fp8* run above fp8-sparse keeps fch in bf16, as when it was measured)
#   (SEED: the weight-init and sampling seed, default 1337; the data order is the same for every seed,
#   the files' order, unless SHUFFLE=1: then the train batches come in a per-epoch order drawn from SEED)
#   on a corpus larger than Tiny Shakespeare: the Python standard library's .py sources (the
#   first CORPUS_MB megabytes, default 24, files in sorted order; 327,680 val tokens) tokenized by
#   `gpucore prepro`. CORPUS=python adds every installed package's sources (CORPUS_MB 240, 1,310,720
#   val tokens: data/pyall), enough for B=64 runs that do not repeat their data (tools/pycorpus.py).
#   B (default 16) and LR (6e-4) set the batch and the peak learning rate.
# Reports val loss at every evaluation, final train loss, ms/step, and the memory plan against
# the CuPy pool's high-water mark. Metrics land in $OUT/optimizer_lab/<run>.jsonl; draw them with
#   gpucore plot $OUT/optimizer_lab/*.jsonl -o docs/img/optimizers.png
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STEPS=${STEPS:-1000}
B=${B:-16}
LR=${LR:-6e-4}
LOG=${OUT:-out}/optimizer_lab
RUNS=${RUNS:-adamw sfadamw bf16-sr bf16-kahan}
configure() {   # a run's flags and settings into extra and settings
  settings=${GPUCORE_SETTINGS:-}
  case $1 in
    adamw)      extra=(--final-lr-frac 0.1) ;;
    adamw-order) extra=(--final-lr-frac 0.1)
                settings=${settings:+$settings,}fused_bias_grads=0 ;;
    adamw-sparse) extra=(--final-lr-frac 0.1)
                settings=${settings:+$settings,}bf16_lm_head_sparse=0.0001220703125 ;;
    sfadamw)    extra=(--optimizer sfadamw) ;;
    bf16-sr)    extra=(--final-lr-frac 0.1 --master-weights sr) ;;
    bf16-kahan) extra=(--final-lr-frac 0.1 --master-weights kahan) ;;
    fp8)        extra=(--final-lr-frac 0.1 --dtype fp8 --fp8-scaling adaptive)
                settings=${settings:+$settings,}fp8_lm_head=0,fp8_fast_accum_dgrad=0,fp8_fch_e4m3=0 ;;
    fp8-current) extra=(--final-lr-frac 0.1 --dtype fp8 --fp8-scaling current)
                settings=${settings:+$settings,}fp8_lm_head=0,fp8_fast_accum_dgrad=0 ;;
    fp8-delayed) extra=(--final-lr-frac 0.1 --dtype fp8 --fp8-scaling delayed)
                settings=${settings:+$settings,}fp8_lm_head=0,fp8_fast_accum_dgrad=0 ;;
    fp8-head)   extra=(--final-lr-frac 0.1 --dtype fp8 --fp8-scaling adaptive)
                settings=${settings:+$settings,}fp8_lm_head=1,fp8_lm_head_dwte=1,fp8_fast_accum_dgrad=0,fp8_lm_head_sparse=0,fp8_fch_e4m3=0 ;;
    fp8-head-bf16dw) extra=(--final-lr-frac 0.1 --dtype fp8 --fp8-scaling adaptive)
                settings=${settings:+$settings,}fp8_lm_head=1,fp8_lm_head_dwte=0,fp8_fast_accum_dgrad=0,fp8_fch_e4m3=0 ;;
    fp8-fastdg) extra=(--final-lr-frac 0.1 --dtype fp8 --fp8-scaling adaptive)
                settings=${settings:+$settings,}fp8_lm_head=1,fp8_lm_head_dwte=1,fp8_fast_accum_dgrad=1,fp8_lm_head_sparse=0,fp8_fch_e4m3=0 ;;
    fp8-sparse) extra=(--final-lr-frac 0.1 --dtype fp8 --fp8-scaling adaptive)
                settings=${settings:+$settings,}fp8_lm_head=1,fp8_lm_head_dwte=1,fp8_fast_accum_dgrad=1,fp8_lm_head_sparse=0.0001220703125 ;;
    fp8-sparse-nopred) extra=(--final-lr-frac 0.1 --dtype fp8 --fp8-scaling adaptive)
                settings=${settings:+$settings,}fp8_lm_head=1,fp8_lm_head_dwte=1,fp8_fast_accum_dgrad=1,fp8_lm_head_sparse=0.0001220703125,fp8_predict_scales=0,fp8_fch_e4m3=0 ;;
    fp8-sparse16) extra=(--final-lr-frac 0.1 --dtype fp8 --fp8-scaling adaptive)
                settings=${settings:+$settings,}fp8_lm_head=1,fp8_lm_head_dwte=1,fp8_fast_accum_dgrad=1,fp8_lm_head_sparse=0.0000152587890625,fp8_fch_e4m3=0 ;;
    fp8-bf16fch) extra=(--final-lr-frac 0.1 --dtype fp8 --fp8-scaling adaptive)
                settings=${settings:+$settings,}fp8_lm_head=1,fp8_lm_head_dwte=1,fp8_fast_accum_dgrad=1,fp8_lm_head_sparse=0.0001220703125,fp8_fch_e4m3=0 ;;
    fp8-fch8)   extra=(--final-lr-frac 0.1 --dtype fp8 --fp8-scaling adaptive)
                settings=${settings:+$settings,}fp8_lm_head=1,fp8_lm_head_dwte=1,fp8_fast_accum_dgrad=1,fp8_lm_head_sparse=0.0001220703125,fp8_fch_e4m3=1 ;;
    *)          echo "RUNS: unknown run '$1' (the header lists the runs)" >&2; exit 2 ;;
  esac
}
for run in $RUNS; do configure "$run"; done       # a misspelt run stops here, before any work

case ${CORPUS:-stdlib} in       # tools/pycorpus.py builds it once a machine
  stdlib) DATA=data/pystdlib; CORPUS_MB=${CORPUS_MB:-24}; VAL_TOKENS=${VAL_TOKENS:-327680}; corpus_flags=() ;;
  python) DATA=data/pyall; CORPUS_MB=${CORPUS_MB:-240}; VAL_TOKENS=${VAL_TOKENS:-1310720}
          corpus_flags=(--site-packages) ;;
  *) echo "CORPUS=$CORPUS: expected stdlib or python" >&2; exit 2 ;;
esac
mkdir -p "$LOG"
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true

if [ ! -f "$DATA/corpus_train.bin" ]; then
  mkdir -p "$DATA"
  $PY tools/pycorpus.py "$DATA/corpus.txt" --mb "$CORPUS_MB" ${corpus_flags[@]+"${corpus_flags[@]}"}
  $PY -m gpucore.cli prepro "$DATA/corpus.txt" --out-dir "$DATA" --val-tokens "$VAL_TOKENS"
fi

common=(--model d12 -B "$B" -T 1024 --steps "$STEPS" --lr "$LR" --warmup 100 --dtype bf16 --device cuda
        --data "$DATA" --val-every 100 --val-steps 20 --sample-every 0 --no-checkpoint --seed "${SEED:-1337}")
[ "${SHUFFLE:-0}" = 1 ] && common+=(--shuffle)     # train batches in a per-epoch random order (from the seed)
for run in $RUNS; do
  configure "$run"
  echo "== $run"
  GPUCORE_SETTINGS=$settings $PY -m gpucore.cli train "${common[@]}" "${extra[@]}" --out-dir "$LOG/$run" --metrics "$LOG/$run.jsonl" \
    > "$LOG/$run.txt" 2>&1 || { echo "$run FAILED"; tail -5 "$LOG/$run.txt"; }
  grep -E "^memory plan|val loss" "$LOG/$run.txt" | tail -2
done

echo
echo "================ optimizer_lab summary ================"
$PY - "$LOG" "$RUNS" <<'PY'
import json, re, statistics, sys
from pathlib import Path
log, runs = Path(sys.argv[1]), sys.argv[2].split()
vals = {}
for run in runs:
    p = log / f"{run}.jsonl"
    if not p.exists():
        continue
    recs = [json.loads(l) for l in p.read_text().splitlines()]
    train = [r for r in recs if "loss" in r]
    val = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    end = next((r for r in recs if r.get("event") == "end"), {})
    plan_line = next((l for l in (log / f"{run}.txt").read_text().splitlines() if l.startswith("memory plan")), "")
    m = re.search(r"total ([0-9.]+) GiB", plan_line)
    plan = float(m.group(1)) if m else None
    peak = (end.get("peak_gpu_bytes") or 0) / 2**30
    vals[run] = val
    ms = statistics.median(r["ms"] for r in train[1:]) if len(train) > 1 else float("nan")
    bad = sum(1 for r in train if r["loss"] != r["loss"])
    print(f"{run:>11}: final train loss {train[-1]['loss']:.4f} | val {val.get(max(val), float('nan')):.4f} at "
          f"step {max(val) if val else '-'} | {ms:.1f} ms/step | plan {plan} GiB, pool peak {peak:.2f} GiB"
          + (f" ({100 * (peak - plan) / plan:+.1f}%)" if plan else "") + (f" | NaN steps {bad}" if bad else ""))
if "adamw" in vals:
    base = vals["adamw"]
    for run, val in vals.items():
        if run == "adamw":
            continue
        diffs = [100 * (val[s] - base[s]) / base[s] for s in sorted(base) if s in val]
        if diffs:
            print(f"val loss {run} vs adamw: max {max(diffs):+.2f}%, at the end {diffs[-1]:+.2f}%")
# every evaluation, so the whole comparison comes back in a device call's output tail
steps = sorted({s for v in vals.values() for s in v})
print("val loss  step " + "".join(f"{run:>13}" for run in vals))
for s in steps:
    print(f"{s:>15} " + "".join(f"{vals[run][s]:>13.4f}" if s in vals[run] else f"{'-':>13}" for run in vals))
PY
