"""gpucore.profiler / `gpucore profile`: per-op timing of training steps.

- outside `recording()` a profiled op is a plain call; inside, only the outermost profiled call counts;
- recording is per block: restored after it, also when the block raises;
- on the CPU backend (the tiny preset) the table has the model's ops with the calls per step the
  model code makes, positive times, and shares that add up with the host gap to the step;
- the CLI prints the table and writes JSON (and a PNG with matplotlib).
"""
import json
import math
import threading

import pytest
from click.testing import CliRunner

from gpucore import profiler, settings
from gpucore.cli import main
from gpucore.model import GPT2Config, head_chunk_rows
from gpucore.profile import format_table, run_profile


@profiler.profiled("inner", nbytes=lambda r, a, k: 8)
def _inner(x):
    """The inner toy op."""
    return x + 1


@profiler.profiled("outer", flops=lambda r, a, k: 100.0)
def _outer(x):
    return _inner(_inner(x)) * 2


def test_decorated_functions_keep_name_and_doc():
    assert _inner.__name__ == "_inner" and _inner.__doc__ == "The inner toy op."
    from gpucore.ops.matmul import matmul_forward
    assert matmul_forward.__name__ == "matmul_forward" and "weight" in matmul_forward.__doc__


def test_nested_calls_count_once():
    with profiler.recording() as rec:
        assert _outer(1) == 6
        assert _inner(1) == 2
    totals = rec.totals()
    assert list(totals) == ["outer", "inner"]
    assert totals["outer"].calls == 1 and totals["outer"].flops == 100.0
    assert totals["inner"].calls == 1 and totals["inner"].bytes == 8     # the two inside outer: not counted
    assert all(t.ms >= 0 for t in totals.values())


def test_recording_is_off_outside_and_restored_after_an_error():
    assert profiler.active() is None
    assert _outer(1) == 6                         # a plain call
    with pytest.raises(RuntimeError):
        with profiler.recording() as rec:
            assert profiler.active() is rec
            with profiler.recording() as inner:
                _inner(0)
            assert profiler.active() is rec       # nested blocks restore the outer one
            raise RuntimeError("boom")
    assert profiler.active() is None
    assert rec.totals() == {} and inner.totals()["inner"].calls == 1


def test_recording_with_a_given_recorder_routes_calls_through_it():
    class Doubling(profiler.Recorder):      # a probe's kind of recorder: it may change what a call does
        def _record(self, name, fn, args, kwargs, flops, nbytes):
            return 2 * super()._record(name, fn, args, kwargs, flops, nbytes)
    mine = Doubling()
    with profiler.recording(recorder=mine) as rec:
        assert rec is mine and profiler.active() is mine
        assert _outer(1) == 12                  # outer's 6, doubled once: inner calls inside it stay plain
    assert profiler.active() is None
    assert mine.totals()["outer"].calls == 1 and "inner" not in mine.totals()


def test_recording_is_per_thread():
    seen = {}
    with profiler.recording() as rec:
        t = threading.Thread(target=lambda: seen.update(other=profiler.active(), out=_inner(1)))
        t.start()
        t.join()
    assert seen == {"other": None, "out": 2}
    assert rec.totals() == {}


def test_an_op_that_raises_leaves_the_recorder_usable():
    @profiler.profiled("bad")
    def bad():
        raise ValueError("no")
    with profiler.recording() as rec:
        with pytest.raises(ValueError):
            bad()
        _inner(1)
    assert list(rec.totals()) == ["inner"]


def _expected_calls(cfg, B, T, keep_gelu=False):
    L = cfg.num_layers
    chunks = math.ceil(B * T / head_chunk_rows(cfg, B * T, "float32"))
    # gpucore/model.py forward + backward, gpucore/optim.py AdamW.step
    calls = {"matmul forward": 4 * L, "matmul forward (lm head)": chunks,
            # without keep_gelu fcproj's backward is two calls (dx; dW once gelu_backward has remade
            # GELU(fch) beside dfch), and no gelu forward is timed: the forward's is inside matmul
            # forward (the outermost op is timed), the recompute inside gelu backward
            "matmul backward": 4 * L + (0 if keep_gelu else L), "matmul backward (lm head)": chunks,
            "attention forward": L, "attention backward": L,
            "gelu backward": L,
            # the residual adds run in the projections' GEMM epilogues: every layernorm is plain
            "layernorm forward": 2 * L + 1,
            "layernorm backward": 2 * L + 1,
            "encoder forward": 1, "encoder backward": 1, "classifier (fused)": chunks,
            "reduce sum": 1, "grad norm": 1, "adamw": 1}
    return {op: n for op, n in calls.items() if n}


def test_cpu_profile_rows_calls_and_shares():
    cfg = GPT2Config.from_preset("tiny")
    # a small LM-head chunk so the head runs in several chunks (4 of 16 rows for B*T = 64)
    B, T = 2, 32
    with settings.using(lm_head_chunk_bytes=16 * cfg.padded_vocab_size * 4):
        report = run_profile("tiny", B, T, steps=2, device="cpu", dtype="auto")
        expected = _expected_calls(cfg, B, T)
    rows = {r["op"]: r for r in report["rows"]}
    assert expected["classifier (fused)"] == 4
    assert {op: rows[op]["calls"] for op in rows} == expected
    assert all(r["ms"] > 0 for r in rows.values())
    assert all(r["tflops"] > 0 for op, r in rows.items() if op.startswith(("matmul", "attention")))
    assert all(r["gbps"] > 0 for op, r in rows.items() if not op.startswith(("matmul", "attention")))
    assert report["device"] == "cpu" and report["dtype"] == "float32" and report["step_ms"] > 0
    assert math.isclose(sum(r["share"] for r in rows.values()) + report["host_gap_share"], 1.0, rel_tol=1e-9)
    assert math.isclose(report["ops_ms"] + report["host_gap_ms"], report["step_ms"], rel_tol=1e-9)
    table = format_table(report)
    for op in ("attention forward", "attention backward", "matmul backward (lm head)", "gelu backward",
               "layernorm backward", "adamw", "host gap", "sum of ops"):
        assert op in table
    assert report["power"] is None and "power:" not in table     # no energy counter on the CPU
    json.dumps(report)                            # JSON-able as is


def test_matmul_and_attention_flops_from_shapes():
    import numpy as np
    x, w = np.zeros((2, 3, 8)), np.zeros((5, 8))
    assert profiler.matmul_forward_flops(None, (x, w), {}) == 2 * 6 * 8 * 5
    assert profiler.matmul_backward_flops(None, (np.zeros((2, 3, 5)), x, w), {}) == 2 * 2 * 6 * 8 * 5
    assert profiler.matmul_backward_flops(None, (np.zeros((2, 3, 5)), x, w), {"need_dx": False}) == 2 * 6 * 8 * 5
    qkv = np.zeros((2, 16, 3 * 8))
    fwd = 4.0 * 2 * 16 * 16 * 8 / 2                # 4*B*NH*T*T*hd / 2 with NH*hd = C = 8
    assert profiler.attention_forward_flops(None, (qkv, 2), {}) == fwd
    assert profiler.attention_backward_flops(None, (None, qkv, None, None, 2), {}) == 2.5 * fwd


def test_cli_profile_on_cpu_writes_json_and_png(tmp_path):
    out, png = tmp_path / "prof.json", tmp_path / "prof.png"
    res = CliRunner().invoke(main, ["profile", "--model", "tiny", "-B", "1", "-T", "16", "--steps", "1",
                                    "--device", "cpu", "--json", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "attention backward" in res.output and "host gap" in res.output
    data = json.loads(out.read_text())
    assert data["model"] == "tiny" and data["steps"] == 1 and data["rows"]
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["--model", "d99"], "--model d99: unknown preset; known: d12, "),
    (["--model", "tiny", "-T", "999"], "-T 999: longer than the model's max_seq_len 64"),
])
def test_cli_profile_errors_are_one_line(args, message):
    res = CliRunner().invoke(main, ["profile", "--device", "cpu", *args])
    assert res.exit_code == 1
    assert res.output.startswith(f"Error: {message}") and res.output.count("\n") == 1, res.output


@pytest.mark.cuda
def test_gpu_profile_small():
    report = run_profile("small", 8, 128, steps=3, device="cuda", dtype="bf16")
    rows = {r["op"]: r for r in report["rows"]}
    assert report["device"] == "cuda" and report["dtype"] == "bfloat16" and report["copy_gbps"] > 0
    cfg = GPT2Config.from_preset("small")
    assert report["keep_gelu"] is True        # auto on a GPU: a small plan keeps them
    assert {op: rows[op]["calls"] for op in rows} == _expected_calls(cfg, 8, 128, keep_gelu=True)
    for op in ("matmul forward", "matmul backward", "attention forward", "attention backward"):
        assert rows[op]["tflops"] > 0 and rows[op]["ms"] > 0
    assert all(r["ms"] > 0 for r in rows.values())
    # Event-timed ops lie inside the steps they were recorded in. (Not the plain steps: at this size
    # the step is host-bound, and an op's events also time the launches the GPU waits for inside it,
    # so the ops' sum has exceeded the plain step by 17% on a device machine with a slower host.)
    assert report["ops_ms"] <= 1.02 * report["recorded_step_ms"], format_table(report)
    p = report["power"]                       # NVML comes with the driver
    assert p is not None and p["seconds"] >= 1.0 and p["calls"] >= 1
    assert 0 < p["joules_per_call"] and 20 < p["watts"] <= 1.3 * p["limit_w"]
    assert 0 < p["sm_mhz"] <= p["max_sm_mhz"]
    assert "power:" in format_table(report)
