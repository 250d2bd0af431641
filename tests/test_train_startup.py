"""`gpucore train` start-up checks: the device it chose and why, host memory on the CPU backend, and an
out-dir / metrics path that cannot be written, each one line before any model is built.
"""
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpucore import runtime
from gpucore import startup
from gpucore import train as train_mod
from gpucore.cli import main


def _cli(*args):
    return CliRunner().invoke(main, ["train", *map(str, args)])


def _tiny(shards, out, *extra):
    return _cli("--model", "tiny", "--device", "cpu", "-B", 1, "-T", 16, "--steps", 1, "--val-every", 0,
                "--sample-every", 0, "--data", shards, "--out-dir", out, *extra)


def _error_line(res):
    """The single line of a failed run: exit 1, no traceback, 'Error: ...' last."""
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("Error: "), res.output
    return last


@pytest.fixture
def no_model_built(monkeypatch):
    """Fails the test if the run gets as far as building the model."""
    def refuse(*a, **k):
        raise AssertionError("the model was built before the start-up check failed")
    monkeypatch.setattr(train_mod, "build_model", refuse)


# ------------------------------------------------------------------ device ----

def test_device_auto_says_what_it_chose_and_why(shards, tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "gpu_available", lambda: False)
    res = _cli("--model", "tiny", "-B", 1, "-T", 16, "--steps", 1, "--val-every", 0, "--sample-every", 0,
               "--data", shards, "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    first = res.output.splitlines()[0]
    why = "no NVIDIA GPU: CuPy is not installed" if runtime.cupy is None else "no NVIDIA GPU found"
    assert first == f"device auto -> cpu ({why})"


def test_device_cpu_prints_no_auto_line(shards, tmp_path):
    res = _tiny(shards, tmp_path)
    assert res.exit_code == 0, res.output
    assert "device auto" not in res.output


# ------------------------------------------------------------------ memory ----

def test_cpu_run_bigger_than_host_memory_is_one_line(shards, tmp_path, monkeypatch, no_model_built):
    """d12 -B 64 on the CPU needs ~32 GiB: refused up front, naming need, available and the way out."""
    monkeypatch.setattr(startup, "available_host_memory", lambda: 2 << 30)
    res = _cli("--model", "d12", "-B", 64, "--device", "cpu", "--data", shards, "--out-dir", tmp_path)
    line = _error_line(res)
    assert res.output.count("\n") == 1, res.output
    assert "not enough memory for the CPU backend: this run needs about 31.9 GiB" in line
    assert "activations 28.94" in line and "m 0.46" in line and "v 0.46" in line
    assert "2.0 GiB is available" in line and "--model tiny" in line and "smaller -B" in line
    assert not (tmp_path / "metrics.jsonl").exists()


def test_memory_check_counts_the_master_copy_and_optimizer_state(monkeypatch):
    """bf16 on the CPU: params + grads in bf16, fp32 master, m and v: 16 bytes a parameter plus activations."""
    from gpucore.model import GPT2Config, memory_plan
    plan = memory_plan(GPT2Config.from_preset("tiny"), 2, 32, "bfloat16")
    n = GPT2Config.from_preset("tiny").num_parameters
    assert plan["master"] == plan["m"] == plan["v"] == 4 * n and plan["params"] == plan["grads"] == 2 * n
    monkeypatch.setattr(startup, "available_host_memory", lambda: sum(plan.values()) - 1)
    with pytest.raises(startup.TrainError, match="master"):
        startup.check_host_memory(plan)
    monkeypatch.setattr(startup, "available_host_memory", lambda: sum(plan.values()))
    startup.check_host_memory(plan)                # fits exactly
    monkeypatch.setattr(startup, "available_host_memory", lambda: None)
    startup.check_host_memory({"activations": 1 << 60})   # unknown: no check


def test_available_host_memory_reads_meminfo():
    avail = startup.available_host_memory()
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc/meminfo on this system")
    assert avail is not None and 0 < avail < 1 << 50


# ------------------------------------------------------------------- paths ----

def test_out_dir_is_a_file(shards, tmp_path, no_model_built):
    f = tmp_path / "afile"
    f.write_text("x")
    line = _error_line(_tiny(shards, f))
    assert f"--out-dir {f}: cannot create the directory (File exists)" in line
    assert f.read_text() == "x"


def test_out_dir_under_a_file(shards, tmp_path, no_model_built):
    f = tmp_path / "afile"
    f.write_text("x")
    line = _error_line(_tiny(shards, f / "sub"))
    assert f"--out-dir {f / 'sub'}: cannot create the directory (Not a directory)" in line


def test_out_dir_read_only(shards, tmp_path, monkeypatch, no_model_built):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.geteuid() == 0:   # root writes anyway: make the write probe fail the way the OS would
        def denied(*a, dir=None, **k):
            raise PermissionError(13, "Permission denied", str(dir))
        monkeypatch.setattr(startup.tempfile, "mkstemp", denied)
    try:
        line = _error_line(_tiny(shards, ro))
    finally:
        ro.chmod(stat.S_IRWXU)
    assert f"--out-dir {ro}: cannot write there (Permission denied)" in line
    assert os.listdir(ro) == []


def test_metrics_path_unwritable(shards, tmp_path, no_model_built):
    f = tmp_path / "afile"
    f.write_text("x")
    line = _error_line(_tiny(shards, tmp_path / "out", "--metrics", f / "metrics.jsonl"))
    assert f"--metrics {f / 'metrics.jsonl'}: cannot open it for writing (" in line
    assert "File exists" in line or "Not a directory" in line     # mkdir of its parent finds the file


def test_metrics_check_changes_nothing(tmp_path):
    existing = tmp_path / "m.jsonl"
    existing.write_text('{"step": 1}\n')
    startup.check_metrics_file(existing)
    assert existing.read_text() == '{"step": 1}\n'
    fresh = tmp_path / "sub" / "new.jsonl"
    startup.check_metrics_file(fresh)
    assert not fresh.exists()


def test_write_failure_mid_run_is_one_line(shards, tmp_path, monkeypatch):
    """A disk that fills up while the final checkpoint is written: one line, not a traceback."""
    def full(*a, **k):
        raise OSError(28, "No space left on device", str(tmp_path / "ckpt_000001.ckpt"))
    monkeypatch.setattr(train_mod, "save_training_checkpoint", full)
    line = _error_line(_tiny(shards, tmp_path))
    assert line == f"Error: {tmp_path / 'ckpt_000001.ckpt'}: No space left on device"


def test_model_larger_than_the_gpu_is_refused_before_allocation(monkeypatch):
    """The memory plan against the GPU's free memory (issue 13: a model larger than the GPU)."""
    from gpucore.model import GPT2Config, memory_plan
    plan = memory_plan(GPT2Config.from_preset("d48"), 16, 1024, "bfloat16")
    need = sum(plan.values())
    monkeypatch.setattr(startup, "gpu_memory_info", lambda: (need - 1, 80 << 30))
    with pytest.raises(startup.TrainError, match=r"does not fit on the GPU: .* GiB free of 80.0; use a smaller -B"):
        startup.check_gpu_memory(plan)
    monkeypatch.setattr(startup, "gpu_memory_info", lambda: (need, 80 << 30))
    startup.check_gpu_memory(plan)                       # fits exactly
    monkeypatch.setattr(startup, "gpu_memory_info", lambda: None)
    startup.check_gpu_memory(plan)                       # unknown: no check
