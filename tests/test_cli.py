"""The gpucore command line: info, kernels check, bench without a GPU."""
import pytest
from click.testing import CliRunner

from gpucore import runtime
from gpucore.cli import main


def test_help_lists_commands():
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0
    for cmd in ("info", "kernels", "bench"):
        assert cmd in res.output


def test_info_runs():
    res = CliRunner().invoke(main, ["info"])
    assert res.exit_code == 0, res.output
    assert "numpy" in res.output


@pytest.mark.skipif(runtime.cupy is None, reason="needs CuPy + NVRTC (installed in CI)")
def test_kernels_check_passes(tmp_path):
    res = CliRunner().invoke(main, ["kernels", "check", "--arch", "90"])
    assert res.exit_code == 0, res.output
    assert "0 failed" in res.output and "reduce_sum_all_stage1_kernel_f32" in res.output


@pytest.mark.skipif(runtime.cupy is None, reason="needs CuPy + NVRTC (installed in CI)")
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
