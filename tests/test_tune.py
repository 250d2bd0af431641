"""`gpucore tune` (gpucore/tune.py): cuBLASLt's configuration search over a training step's GEMMs.

- one clear line without a GPU or with an unknown preset;
- plan keys and the report in words;
- whole steps decide between the searched and the heuristic's winners (a margin, then a choice);
- on the GPU: every raced GEMM gets a row, the whole-step check ran and says what it kept, the
  winners land in the given tune cache, and a later step restores them from there without racing
  (searched ones by their bytes).
"""
import json

import pytest
from click.testing import CliRunner

from gpucore import runtime, settings, tune
from gpucore.cli import main


def test_tune_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(runtime, "gpu_available", lambda: False)
    res = CliRunner().invoke(main, ["tune", "--model", "tiny", "-B", "1"])
    assert res.exit_code != 0 and "needs a CUDA GPU" in res.output


def test_tune_rejects_an_unknown_preset_and_a_zero_budget():
    res = CliRunner().invoke(main, ["tune", "--model", "d13"])
    assert res.exit_code != 0 and "unknown preset" in res.output
    res = CliRunner().invoke(main, ["tune", "--budget", "0"])
    assert res.exit_code != 0 and "--budget" in res.output


def test_plan_keys_in_words():
    bf16_key = (0, 0, 1, 65536, 2304, 768, 768, 768, 14, 14, 14, 4, None, 256, (256,) * 4, False)
    assert tune.describe_key(bf16_key) == "65536x2304x768 NT +bias"
    dw_key = (0, 1, 0, 768, 3072, 65536, 768, 3072, 14, 14, 14, 1, None, 0, (256,) * 4, True)
    assert tune.describe_key(dw_key) == "768x3072x65536 TN +="
    fp8_key = (0, "fp8", 65536, 3072, 768, 28, 28, 14, 164, 256, (256,) * 4, 256, False, True)
    assert tune.describe_key(fp8_key) == "fp8 65536x3072x768 e4m3.e4m3 +bias+gelu"


def test_report_rows_and_the_saving_line():
    report = {"seconds": 12.3, "cache": "/x/algos.json", "entries": 2, "rows": [
        {"gemm": "a", "heuristic_ms": 1.0, "gemmex_ms": 0.9, "searched_ms": 0.8, "winner": "searched",
         "winner_ms": 0.8, "config": "id=66 tile=1"},
        {"gemm": "b", "heuristic_ms": 2.0, "gemmex_ms": None, "searched_ms": None, "winner": "lt#1/8",
         "winner_ms": 2.0, "config": ""}]}
    text = tune.format_rows(report)
    lines = text.splitlines()
    assert len(lines) == 5
    assert "11.1%" in lines[1] and "searched" in lines[1]          # 0.8 against gemmEx's 0.9
    assert "0.0%" in lines[2] and " - " in lines[2]
    assert "save 0.1000 ms" in lines[3] and lines[4] == "2 choices merged into /x/algos.json"
    report["check"] = {"heuristic_ms": 310.1, "searched_ms": 318.5, "kept": "heuristic"}
    lines = tune.format_rows(report).splitlines()
    assert lines[4] == "whole steps: heuristic's winners 310.10 ms, searched 318.50 ms (x0.974): kept the heuristic"
    assert lines[5] == "2 choices merged into /x/algos.json"


def test_searched_winners_are_kept_only_when_whole_steps_gain():
    assert tune.keep_searched(100.0, 99.0)                 # 1% faster
    assert not tune.keep_searched(100.0, 99.6)             # 0.4%: inside CHECK_MARGIN
    assert not tune.keep_searched(310.1, 318.5)            # d48 bf16 on an H200: slower
    assert tune.keep_searched(100.0, 99.6, margin=0.0)


def test_tune_rejects_negative_check_steps():
    with pytest.raises(ValueError, match="--check-steps -1"):
        tune.run_tune("tiny", check_steps=-1)
    res = CliRunner().invoke(main, ["tune", "--check-steps", "-1"])
    assert res.exit_code != 0 and "--check-steps" in res.output


@pytest.mark.cuda
def test_gpu_tune_writes_winners_that_a_later_step_restores(tmp_path):
    from gpucore import cublas
    from gpucore.profile import synthetic_training
    cache = tmp_path / "algos.json"
    with settings.using(lt_autotune_min_flops=0, lt_tune_cache=str(cache)):
        report = tune.run_tune("tiny", B=2, T=64, dtype="bfloat16", budget=40, cache_path=cache, check_steps=3)
        assert report["rows"], "no GEMM was raced"
        saved = json.loads(cache.read_text())
        assert len(saved) == report["entries"] >= len(report["rows"])
        check = report["check"]           # whole steps decided which winners were merged
        assert check["heuristic_ms"] > 0 and check["searched_ms"] > 0
        assert check["kept"] == ("searched" if tune.keep_searched(check["heuristic_ms"], check["searched_ms"])
                                 else "heuristic")
        for r in report["rows"]:       # the heuristic's first choice stays unless another is 2% faster
            best = min(v for v in (r["heuristic_ms"], r["gemmex_ms"], r["searched_ms"]) if v is not None)
            assert 0 < r["winner_ms"] <= best / (1 - cublas.LT_TUNE_MARGIN) * 1.0001, r
        # A later run (no plans in memory) takes every choice from the file and races nothing.
        lt = cublas.lt_binding()
        lt.forget()
        loss = float(synthetic_training("tiny", 2, 64, "cuda", "bfloat16").step()[0])
        plans = [p for p in lt.plans.values() if p is not None]
        assert plans and all(p.times is None for p in plans), "a GEMM raced again instead of reading the cache"
        assert loss == loss
        lt.forget()
