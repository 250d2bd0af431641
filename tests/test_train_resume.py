"""Stopping and resuming `gpucore train`: Ctrl-C saves the last completed step and prints the resume
command, metrics keep each step once, killed saves leave no temp files, a corrupt newest checkpoint falls
back to the previous one, --keep-last, and resuming a finished run.

All on the NumPy backend with the "tiny" preset (a few steps of B*T = 16 tokens).
"""
import hashlib
import json
import os
import shlex
import signal
import time

import numpy as np
import pytest
from click.testing import CliRunner

from gpucore import optim
from gpucore import startup
from gpucore import train as train_mod
from gpucore.cli import main
from gpucore.train import TrainArgs, TrainInterrupted, run


def _argv(shards, out, steps=6, *extra):
    return ["--model", "tiny", "--device", "cpu", "-B", "1", "-T", "16", "--steps", str(steps), "--lr", "1e-3",
            "--val-every", "0", "--sample-every", "0", "--data", str(shards), "--out-dir", str(out), *map(str, extra)]


def _cli(argv):
    return CliRunner().invoke(main, ["train", *argv])


def _args(shards, out, **kw):
    base = dict(model="tiny", device="cpu", batch_size=1, seq_len=16, steps=6, lr=1e-3, val_every=0,
                sample_every=0, data=str(shards), out_dir=str(out))
    return TrainArgs(**(base | kw))


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _ckpts(d):
    return sorted(p.name for p in d.glob("ckpt_*.ckpt"))


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _interrupt_on_call(monkeypatch, k, how="raise"):
    """Make the k-th train_step call raise KeyboardInterrupt before it starts, or deliver a real SIGINT
    (`how="signal"`: once, the step then runs; `"signal2"`: twice, as a second Ctrl-C)."""
    real, calls = train_mod.train_step, []

    def step(*a, **k_):
        calls.append(1)
        if len(calls) == k:
            if how == "raise":
                raise KeyboardInterrupt
            signal.raise_signal(signal.SIGINT)
            if how == "signal2":
                signal.raise_signal(signal.SIGINT)
        return real(*a, **k_)
    monkeypatch.setattr(train_mod, "train_step", step)
    return calls


def _resume_line(output):
    (line,) = [ln for ln in output.splitlines() if ln.startswith("resume with: ")]
    return shlex.split(line[len("resume with: "):])


# ------------------------------------------------------------------ Ctrl-C ----

def test_ctrl_c_saves_prints_resume_command_and_resume_finishes(shards, tmp_path, monkeypatch):
    """Interrupted in step 3: checkpoint at step 2, exit 130, no traceback; the printed command finishes
    the run with the same losses as an uninterrupted one and metrics hold each step once."""
    straight = run(_args(shards, tmp_path / "straight", steps=4, val_every=2, val_steps=1), echo=lambda s: None)
    out = tmp_path / "run"
    _interrupt_on_call(monkeypatch, 3)
    res = _cli(_argv(shards, out, 4, "--val-every", 2, "--val-steps", 1))
    assert res.exit_code == 130, res.output
    assert "Traceback" not in res.output
    assert f"interrupted after step 2 of 4: saved checkpoint {out / 'ckpt_000002.ckpt'}" in res.output
    assert _ckpts(out) == ["ckpt_000002.ckpt"]
    from gpucore.checkpoint import load_checkpoint_meta
    assert load_checkpoint_meta(out / "ckpt_000002.ckpt")["step"] == 2
    argv = _resume_line(res.output)
    assert argv[:6] == ["gpucore", "train", "--resume", str(out / "ckpt_000002.ckpt"), "--steps", "4"]
    for opt in (["--batch-size", "1"], ["--seq-len", "16"], ["--data", str(shards)], ["--out-dir", str(out)],
                ["--device", "cpu"], ["--val-every", "2"], ["--val-steps", "1"], ["--sample-every", "0"]):
        assert " ".join(opt) in " ".join(argv), opt
    assert "--model" not in argv and "--dtype" not in argv     # the checkpoint knows them

    monkeypatch.undo()
    res = CliRunner().invoke(main, argv[1:])
    assert res.exit_code == 0, res.output
    assert "resumed at step 2" in res.output
    recs = _metrics(out / "metrics.jsonl")
    losses = {r["step"]: r["loss"] for r in recs if "loss" in r}
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4]          # each step once
    assert [r["step"] for r in recs if "val_loss" in r] == [0, 2, 4]
    assert [losses[s] for s in range(1, 5)] == straight["losses"]
    assert [r["val_loss"] for r in recs if "val_loss" in r] == list(straight["val_losses"].values())
    assert [r.get("event") for r in recs if "event" in r] == ["start", "interrupted", "resume", "end"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_interrupt_between_micro_batches_resumes_bit_identically(shards, tmp_path, monkeypatch, device):
    """Gradient accumulation 2, Ctrl-C after step 3 took its first micro-batch: the checkpoint holds the
    data position after step 2 (not the loader's current one), so the resumed run equals a straight one."""
    kw = dict(device=device, steps=5, total_batch_size=2 * 16, sample_every=0)
    straight = run(_args(shards, tmp_path / "a", **kw), echo=lambda s: None)
    real, fetched = train_mod.train_step, []

    def step(model, opt, next_batch, grad_accum, lr, **kw):
        def counted():
            fetched.append(1)
            if len(fetched) == 6:          # step 3's second micro-batch
                raise KeyboardInterrupt
            return next_batch()
        return real(model, opt, counted, grad_accum, lr, **kw)
    monkeypatch.setattr(train_mod, "train_step", step)
    with pytest.raises(TrainInterrupted) as info:
        run(_args(shards, tmp_path / "b", **kw), echo=lambda s: None)
    assert info.value.step == 2 and info.value.checkpoint == tmp_path / "b" / "ckpt_000002.ckpt"
    monkeypatch.undo()
    resumed = run(_args(shards, tmp_path / "b", resume=str(info.value.checkpoint), **kw), echo=lambda s: None)
    assert resumed["losses"] == straight["losses"][2:]
    from gpucore.checkpoint import load_checkpoint
    a, _ = load_checkpoint(tmp_path / "a" / "ckpt_000005.ckpt")
    b, _ = load_checkpoint(tmp_path / "b" / "ckpt_000005.ckpt")
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_real_sigint_to_train_script(shards, tmp_path):
    """The real thing: SIGINT to ./train.py mid-run exits 130 with the resume command, no traceback."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, str(root / "train.py"), *_argv(shards, tmp_path, 10_000)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step     2/"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    out = "".join(seen) + out
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Ctrl-C: stopping after this step" in err
    (ckpt,) = _ckpts(tmp_path)
    step = int(ckpt[5:11])
    assert step >= 2 and f"step {step:>5d}/10000" in out
    assert f"interrupted after step {step} of 10000: saved checkpoint {tmp_path / ckpt}" in err
    assert f"resume with: gpucore train --resume {tmp_path / ckpt} --steps 10000" in err


def test_first_sigint_finishes_the_step_second_stops_at_once(shards, tmp_path, monkeypatch):
    _interrupt_on_call(monkeypatch, 3, how="signal")         # one Ctrl-C during step 3: step 3 completes
    res = _cli(_argv(shards, tmp_path / "a"))
    assert res.exit_code == 130, res.output
    assert "interrupted after step 3 of 6: saved checkpoint" in res.output
    assert _ckpts(tmp_path / "a") == ["ckpt_000003.ckpt"]
    assert [r["step"] for r in _metrics(tmp_path / "a" / "metrics.jsonl") if "loss" in r] == [1, 2, 3]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler      # handler restored

    monkeypatch.undo()
    _interrupt_on_call(monkeypatch, 3, how="signal2")        # two: stop before step 3 changes anything
    res = _cli(_argv(shards, tmp_path / "b"))
    assert res.exit_code == 130, res.output
    assert "interrupted after step 2 of 6: saved checkpoint" in res.output
    assert _ckpts(tmp_path / "b") == ["ckpt_000002.ckpt"]


def test_interrupt_inside_the_weight_update_does_not_save_it(shards, tmp_path, monkeypatch):
    """Weights half-updated by an interrupted AdamW step match no step: keep the last good checkpoint."""
    real, calls = optim.AdamW.step, []

    def step(self, lr):
        norm = real(self, lr)
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return norm
    monkeypatch.setattr(optim.AdamW, "step", step)
    res = _cli(_argv(shards, tmp_path, 6, "--ckpt-every", 2))
    assert res.exit_code == 130, res.output
    assert (f"interrupted after step 3 of 6: the weights were mid-update, not saved; the last checkpoint is "
            f"{tmp_path / 'ckpt_000002.ckpt'}") in res.output
    assert _ckpts(tmp_path) == ["ckpt_000002.ckpt"]
    argv = _resume_line(res.output)
    assert argv[3] == str(tmp_path / "ckpt_000002.ckpt")
    loss_steps = [r["step"] for r in _metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert loss_steps == [1, 2, 3]             # step 3 is logged but not in any checkpoint
    monkeypatch.undo()
    res = CliRunner().invoke(main, argv[1:])
    assert res.exit_code == 0, res.output
    assert [r["step"] for r in _metrics(tmp_path / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("case", ["first step", "no checkpoint"])
def test_interrupt_without_anything_to_save(shards, tmp_path, monkeypatch, case):
    _interrupt_on_call(monkeypatch, 1 if case == "first step" else 2)
    res = _cli(_argv(shards, tmp_path, 6, *(["--no-checkpoint"] if case == "no checkpoint" else [])))
    assert res.exit_code == 130 and "Traceback" not in res.output, res.output
    expect = ("interrupted after step 0 of 6: no step completed since the start" if case == "first step"
              else "interrupted after step 1 of 6: no checkpoint (--no-checkpoint)")
    assert expect in res.output
    assert "resume with" not in res.output and _ckpts(tmp_path) == []


def test_run_api_raises_train_interrupted(shards, tmp_path, monkeypatch):
    _interrupt_on_call(monkeypatch, 2)
    with pytest.raises(TrainInterrupted) as info:
        run(_args(shards, tmp_path), echo=lambda s: None)
    assert isinstance(info.value, KeyboardInterrupt)
    assert info.value.step == 1 and info.value.checkpoint == tmp_path / "ckpt_000001.ckpt"


def test_resume_drops_metrics_rows_past_the_checkpoint(tmp_path):
    """Rows after the checkpoint's step (and a torn last line) go; the file is otherwise unchanged."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"event": "start"}, {"step": 0, "val_loss": 5.0}, {"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0},
            {"step": 2, "val_loss": 3.5}, {"step": 3, "loss": 2.0}, {"event": "interrupted", "step": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    assert startup.trim_metrics(path, 2) == 4
    assert _metrics(path) == rows[:4]
    before = path.read_bytes()
    assert startup.trim_metrics(path, 2) == 0 and path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


# -------------------------------------------------------- damaged leftovers ----

def test_start_up_removes_stale_temp_files_of_killed_saves(shards, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    old = time.time() - 3600
    stale = [out / ".ckpt_000004.ckpt.k9x2ab.tmp", out / ".metrics.jsonl.q1w2e3.tmp"]
    fresh = out / ".ckpt_000006.ckpt.live01.tmp"            # a save that may still be running
    other = out / ".notes.txt.abc.tmp"                      # not a file a run writes
    for p in stale + [fresh, other]:
        p.write_bytes(b"partial")
    for p in stale + [other]:
        os.utime(p, (old, old))
    res = _cli(_argv(shards, out, 1))
    assert res.exit_code == 0, res.output
    for p in stale:
        assert not p.exists() and f"removed {p} (the temporary file of a save that was killed)" in res.output
    assert fresh.exists() and other.exists()


def _corrupt(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_resume_dir_skips_a_corrupt_newest_checkpoint(shards, tmp_path):
    run(_args(shards, tmp_path, steps=4, ckpt_every=2), echo=lambda s: None)
    _corrupt(tmp_path / "ckpt_000004.ckpt")
    res = _cli(["--resume", str(tmp_path), *_argv(shards, tmp_path / "b", 5)[2:]])
    assert res.exit_code == 0, res.output
    skipped = [ln for ln in res.output.splitlines() if ln.startswith("skipped ")]
    assert skipped == [f"skipped {tmp_path / 'ckpt_000004.ckpt'}: corrupt checkpoint (checksum mismatch in "
                       f"array {skipped[0].split('array ')[1].split(')')[0]}); using ckpt_000002.ckpt"]
    assert f"resumed at step 2 from {tmp_path / 'ckpt_000002.ckpt'}" in res.output
    # sample takes the same fallback, with the note on stderr
    res = CliRunner().invoke(main, ["sample", "--checkpoint", str(tmp_path), "--device", "cpu", "--max-tokens", "2"])
    assert res.exit_code == 0 and "skipped" in res.output and "using ckpt_000002.ckpt" in res.output


def test_resume_dir_with_only_corrupt_checkpoints_is_one_line(shards, tmp_path):
    run(_args(shards, tmp_path, steps=4, ckpt_every=2), echo=lambda s: None)
    _corrupt(tmp_path / "ckpt_000004.ckpt")
    (tmp_path / "ckpt_000002.ckpt").write_bytes((tmp_path / "ckpt_000002.ckpt").read_bytes()[:1000])
    res = _cli(["--resume", str(tmp_path), "--device", "cpu", "--data", str(shards)])
    assert res.exit_code == 1 and res.output.count("\n") == 1, res.output
    assert res.output.startswith(f"Error: {tmp_path / 'ckpt_000004.ckpt'}: corrupt checkpoint")
    assert "(and the 1 older ones cannot be read either)" in res.output


# ------------------------------------------------------- retention, finish ----

def test_keep_last_deletes_older_checkpoints(shards, tmp_path):
    res = _cli(_argv(shards, tmp_path / "k2", 4, "--ckpt-every", 1, "--keep-last", 2))
    assert res.exit_code == 0, res.output
    assert _ckpts(tmp_path / "k2") == ["ckpt_000003.ckpt", "ckpt_000004.ckpt"]
    assert "checkpoint " + str(tmp_path / "k2" / "ckpt_000003.ckpt") + " (removed ckpt_000001.ckpt)" in res.output
    res = _cli(_argv(shards, tmp_path / "all", 2, "--ckpt-every", 1))          # default 0: keep all
    assert res.exit_code == 0, res.output
    assert _ckpts(tmp_path / "all") == ["ckpt_000001.ckpt", "ckpt_000002.ckpt"]


def test_resuming_a_finished_run_says_so_and_trains_nothing(shards, tmp_path):
    run(_args(shards, tmp_path, steps=2), echo=lambda s: None)
    before = {p.name: _sha(p) for p in tmp_path.iterdir()}
    for steps in ("2", "1"):
        res = _cli(["--resume", str(tmp_path), "--device", "cpu", "--steps", steps, "--data", str(shards)])
        assert res.exit_code == 0, res.output
        assert res.output == f"already finished: step 2 of {steps}; raise --steps to train longer\n"
    assert {p.name: _sha(p) for p in tmp_path.iterdir()} == before
    more = run(_args(shards, tmp_path, steps=3, resume=str(tmp_path)), echo=lambda s: None)
    assert len(more["losses"]) == 1 and np.isfinite(more["losses"][0]) and not more["already_finished"]
