"""`gpucore memory`: the plan per buffer (the training banner's), the largest activations, ZeRO-1's
per-rank plan, bad input as one line; on a GPU the measured pool after one step against the plan."""
import pytest
from click.testing import CliRunner

from gpucore.cli import main
from gpucore.memory import format_report, plan_run
from gpucore.model import GPT2Config, memory_plan


def test_plan_is_the_training_plan_with_activations_largest_first():
    cfg, T, dt, report = plan_run("d12", 8, None)
    assert T == 1024 and str(dt) == "bfloat16"
    assert report.plan == memory_plan(GPT2Config.from_preset("d12"), 8, 1024, "bfloat16")
    sizes = [b for _, b in report.activations]
    assert sizes == sorted(sizes, reverse=True)
    L, C = 12, 768
    acts = dict(report.activations)
    assert acts["fch"] == L * 8 * 1024 * 4 * C * 2          # the MLP pre-activations, bf16
    assert report.activations[0][0] == "logits"             # the LM head's 1 GiB-bounded chunk at B=8
    text = format_report(report)
    assert f"{report.planned / 2**20:,.1f}" in text and "largest activations: logits 786.0 MiB, fch 576.0 MiB" in text


def test_zero_plan_is_per_rank_and_modes_drop_the_master():
    _, _, _, one = plan_run("d48", 16, 1024)
    _, _, _, eight = plan_run("d48", 16, 1024, zero=1, ranks=8)
    assert eight.plan["m"] == -(-one.plan["m"] // 8) and eight.plan["activations"] == one.plan["activations"]
    _, _, _, sr = plan_run("d48", 16, 1024, master_weights="sr")
    assert sr.planned == one.planned - one.plan["master"]


@pytest.mark.parametrize("argv,message", [
    (["--model", "d99"], "unknown preset 'd99'"),
    (["--dtype", "fp32", "--master-weights", "kahan"], "only bf16 models drop the fp32 master copy"),
    (["--model", "tiny", "-T", "65"], "longer than the model's max_seq_len 64"),
])
def test_bad_input_is_one_line(argv, message):
    res = CliRunner().invoke(main, ["memory", "--no-measure", *argv])
    assert res.exit_code == 1 and message in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("keep", ["on", "off"])
def test_fp8_plan(keep):
    """--dtype fp8: the FP8 linears' plan (kept FP8 inputs instead of bf16 ln/GELU outputs), as the
    training run plans it, and less than bf16's."""
    res = CliRunner().invoke(main, ["memory", "--model", "d12", "-B", "64", "--no-measure", "--dtype", "fp8",
                                    "--keep-gelu", keep])
    assert res.exit_code == 0, res.output
    assert "bfloat16 + FP8 linears" in res.output and "x8t" in res.output
    _, _, _, fp8 = plan_run("d12", 64, 1024, "fp8", keep_gelu=keep == "on")
    _, _, _, bf16 = plan_run("d12", 64, 1024, "bf16", keep_gelu=keep == "on")
    d12 = GPT2Config.from_preset("d12")
    assert fp8.plan == memory_plan(d12, 64, 1024, "bfloat16", keep_gelu=keep == "on", fp8=True)
    assert fp8.planned < bf16.planned and dict(fp8.activations)["x8t"] > 0


def test_cli_prints_the_plan():
    res = CliRunner().invoke(main, ["memory", "--model", "d12", "-B", "8", "--no-measure", "--zero", "1",
                                    "--ranks", "4"])
    assert res.exit_code == 0, res.output
    assert "4 ranks, ZeRO-1 (per rank)" in res.output and "grad shard" in res.output


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["fp32", "kahan"])
def test_measured_peak_is_close_to_the_plan(mode):
    from gpucore.memory import measure_one_step
    cfg, T, dt, report = plan_run("d12", 8, 1024, master_weights=mode)
    measured = measure_one_step(cfg, 8, T, dt, master_weights=mode)
    print(f"d12 B=8 {mode}: plan {report.planned / 2**30:.3f} GiB, measured {measured / 2**30:.3f} GiB")
    # every planned buffer exists (measured >= plan); the rest is cuBLAS workspace and per-op temporaries
    assert report.planned <= measured <= 1.10 * report.planned
