"""The gpucore command line: info, kernels check (and its cache), bench without a GPU, the train options."""
import dataclasses
import shlex

import pytest
from click.testing import CliRunner

from gpucore import runtime
from gpucore.cli import main, resume_command
from gpucore.cli import train as train_command
from gpucore.train import TrainArgs

needs_nvrtc = pytest.mark.skipif(runtime.cupy is None, reason="needs CuPy + NVRTC (installed in CI)")
TINY_KERNEL = 'extern "C" __global__ void tiny_kernel(float* y) { y[threadIdx.x] = 2.0f * threadIdx.x; }\n'


def test_help_lists_commands():
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0
    for cmd in ("info", "kernels", "bench"):
        assert cmd in res.output


def test_info_runs():
    res = CliRunner().invoke(main, ["info"])
    assert res.exit_code == 0, res.output
    assert "numpy" in res.output


@needs_nvrtc
def test_kernels_check_passes(tmp_path):
    res = CliRunner().invoke(main, ["kernels", "check", "--arch", "90"])
    assert res.exit_code == 0, res.output
    assert "0 failed" in res.output and "reduce_sum_all_stage1_kernel_f32" in res.output


@needs_nvrtc
def test_kernels_check_fails_on_bad_file(tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k() { int x = ; }\n')
    res = CliRunner().invoke(main, ["kernels", "check", "--arch", "90", str(bad)])
    assert res.exit_code == 1
    assert "bad.cu:1" in res.output


@pytest.mark.skipif(runtime.gpu_available(), reason="checks the no-GPU message")
def test_bench_without_gpu_is_one_clear_error():
    res = CliRunner().invoke(main, ["bench", "sum"])
    assert res.exit_code == 1
    assert "needs an NVIDIA GPU" in res.output
    assert "Traceback" not in res.output


@needs_nvrtc
def test_check_kernels_second_call_is_a_cache_hit(tmp_path, monkeypatch):
    """ptxas' report is cached on disk beside the cubin: an unchanged file is not compiled again,
    an edited one is."""
    monkeypatch.setattr(runtime, "CACHE_DIR", tmp_path / "cache")
    src = tmp_path / "tiny.cu"
    src.write_text(TINY_KERNEL)
    first = runtime.check_kernels(("80", "90"), [src])
    assert [(r["kernel"], r["arch"], r["ok"]) for r in first] == [("tiny_kernel", "80", True),
                                                                  ("tiny_kernel", "90", True)]
    cached = sorted(p.name for p in (tmp_path / "cache").iterdir())
    key = runtime.cache_key(src, "90", ())
    assert f"tiny-sm90-{key}.cubin" in cached and f"tiny-sm90-{key}.ptxas.json" in cached and len(cached) == 4

    def no_compiler(*a, **k):
        raise AssertionError("compiled again")
    monkeypatch.setattr(runtime, "compile_cubin", no_compiler)
    assert runtime.check_kernels(("80", "90"), [src]) == first
    src.write_text(TINY_KERNEL + "// edited\n")
    with pytest.raises(AssertionError, match="compiled again"):
        runtime.check_kernels(("90",), [src])


@needs_nvrtc
def test_kernels_check_quiet_prints_failures_and_summary_only(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "CACHE_DIR", tmp_path / "cache")
    good, bad = tmp_path / "good.cu", tmp_path / "bad.cu"
    good.write_text(TINY_KERNEL)
    bad.write_text('extern "C" __global__ void k() { int x = ; }\n')
    res = CliRunner().invoke(main, ["kernels", "check", "--quiet", "--arch", "90", str(good)])
    assert res.exit_code == 0, res.output
    assert res.output == "1 kernels ok, 0 failed, 1 files, archs 90\n"
    res = CliRunner().invoke(main, ["kernels", "check", "-q", "--arch", "90", str(good), str(bad)])
    assert res.exit_code == 1
    lines = res.output.splitlines()
    assert len(lines) == 2 and "bad.cu:1" in lines[0] and "FAIL" in lines[0] and "tiny_kernel" not in res.output
    assert lines[1] == "1 kernels ok, 1 failed, 2 files, archs 90"


# ------------------------------------------------------------------- bench ----

def test_bench_unknown_name_is_checked_before_the_gpu():
    res = CliRunner().invoke(main, ["bench", "sumx"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert res.output.startswith("Error: unknown benchmark 'sumx' (did you mean 'sum'?); known: ")
    assert "needs an NVIDIA GPU" not in res.output


def test_bench_help_lists_the_benchmarks():
    from gpucore import bench   # importing the registry needs no GPU (this test runs without one in CI)
    res = CliRunner().invoke(main, ["bench", "--help"])
    assert res.exit_code == 0, res.output
    listed = res.output.split("Benchmarks: ")[1].replace("\n", " ").split(", ")
    assert [n.strip() for n in listed] == sorted(bench.BENCHES) + ["all"]
    assert {"sum", "matmul", "attention", "layernorm"} <= set(bench.BENCHES)


# ------------------------------------------------------------------- train ----

def test_train_options_take_their_defaults_from_trainargs():
    """One place for the defaults: every option of `gpucore train` is a TrainArgs field with its default."""
    fields = {f.name: f.default for f in dataclasses.fields(TrainArgs)}
    params = {p.name: p.default for p in train_command.params if p.name != "help"}
    assert params == fields


def test_resume_command_repeats_what_differs_from_the_defaults():
    args = TrainArgs(model="d12", dtype="bf16", batch_size=64, seq_len=1024, steps=50, lr=6e-4, checkpoint=True,
                     data="my data", out_dir="out/x", keep_last=2, val_every=0, resume="out/x/ckpt_000010.ckpt")
    cmd = resume_command(args, "out/x/ckpt_000020.ckpt")
    assert shlex.split(cmd) == ["gpucore", "train", "--resume", "out/x/ckpt_000020.ckpt", "--steps", "50",
                                "--batch-size", "64", "--seq-len", "1024", "--lr", "0.0006", "--data", "my data",
                                "--val-every", "0", "--keep-last", "2", "--out-dir", "out/x"]
    assert "--no-checkpoint" in resume_command(TrainArgs(checkpoint=False), "c.ckpt")
    # the command parses: every flag it prints is an option of `gpucore train`
    ctx = train_command.make_context("train", shlex.split(cmd)[2:])
    assert ctx.params["batch_size"] == 64 and ctx.params["data"] == "my data" and ctx.params["keep_last"] == 2


@pytest.mark.cuda
def test_info_compiles_every_kernel_file_on_the_gpu():
    """Kernel files in family folders (kernels_cu/attention/*.cu) load by their relative name."""
    res = CliRunner().invoke(main, ["info"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("  ")]
    assert len(lines) == len(runtime.kernel_files()) and all("compiles (sm_" in ln for ln in lines), res.output
