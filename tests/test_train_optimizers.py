"""`gpucore train --optimizer sfadamw` and `--master-weights sr|kahan`: the optimizers of gpucore.optim
in the training loop.

Schedule-free AdamW: trains, evaluates/samples/exports its averaged weights x (the checkpoint
carries them as "averaged"), resumes bit-identically. bf16 without fp32 master weights (GPU):
trains and resumes bit-identically with stochastic rounding and with Kahan compensation; the
memory plan drops the master copy. Bad combinations are one line each.
"""
import numpy as np
import pytest

from gpucore import optim
from gpucore.checkpoint import load_checkpoint, load_model, model_weights
from gpucore.model import GPT2Config, memory_plan
from gpucore.startup import TrainError
from gpucore.train import TrainArgs, run


def _args(shards, out, **kw):
    base = dict(model="tiny", device="cpu", batch_size=2, seq_len=32, steps=8, lr=1e-3, warmup=2, val_every=0,
                sample_every=0, data=str(shards), out_dir=str(out), optimizer="sfadamw")
    return TrainArgs(**(base | kw))


def test_schedule_free_trains_resumes_bitwise_and_exports_its_average(shards, tmp_path):
    straight = run(_args(shards, tmp_path / "a"), echo=lambda *a: None)
    assert straight["losses"][-1] < straight["losses"][0] - 0.1
    run(_args(shards, tmp_path / "b", steps=5), echo=lambda *a: None)
    resumed = run(_args(shards, tmp_path / "b", resume=str(tmp_path / "b")), echo=lambda *a: None)
    assert resumed["losses"] == straight["losses"][5:]           # bit for bit

    arrays, meta = load_checkpoint(tmp_path / "a" / "ckpt_000008.ckpt")
    assert meta["optimizer"]["optimizer"] == "schedule_free_adamw" and "z" in arrays and "m" not in arrays
    # x = y + (1 - 1/beta1)(z - y): the exported weights are the average, not the gradient point y
    beta1 = meta["optimizer"]["beta1"]
    y, z = arrays["params"].astype(np.float64), arrays["z"].astype(np.float64)
    np.testing.assert_allclose(arrays["averaged"], y + (1 - 1 / beta1) * (z - y), rtol=1e-5, atol=1e-7)
    assert not np.array_equal(arrays["averaged"], arrays["params"])
    model, _ = load_model(tmp_path / "a")
    assert np.array_equal(model.params.flat(), arrays["averaged"])
    assert model_weights({"params": 1, "master": 2}) == 2 and model_weights({"params": 1}) == 1


def test_schedule_free_lr_warms_up_inside_the_optimizer(shards, tmp_path):
    import json
    run(_args(shards, tmp_path, steps=4, warmup=3), echo=lambda *a: None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if "loss" in r]
    np.testing.assert_allclose(lrs, [1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3], rtol=1e-12)


@pytest.mark.parametrize("kw,message", [
    (dict(optimizer="adamw", master_weights="sr"), "--master-weights sr: only bf16 models drop the fp32 master"),
    (dict(final_lr_frac=0.1), "--optimizer sfadamw replaces the lr decay schedule"),
    (dict(optimizer="lion"), "--optimizer lion: expected adamw or sfadamw"),
])
def test_bad_optimizer_choices_are_one_line(shards, tmp_path, kw, message):
    with pytest.raises(TrainError, match=message.replace("(", r"\(")):
        run(_args(shards, tmp_path, **kw), echo=lambda *a: None)


def test_memory_plan_follows_the_master_weights_mode():
    cfg = GPT2Config.from_preset("d12")
    n = cfg.num_parameters
    fp32 = memory_plan(cfg, 4, 64, "bfloat16")
    sr = memory_plan(cfg, 4, 64, "bfloat16", master_weights="sr")
    kahan = memory_plan(cfg, 4, 64, "bfloat16", master_weights="kahan")
    assert fp32["master"] == 4 * n and sr["master"] == 0 and "kahan" not in sr
    assert kahan["master"] == 0 and kahan["kahan"] == 2 * n
    assert sum(fp32.values()) - sum(sr.values()) == 4 * n
    assert optim.bytes_per_parameter("bfloat16", "sr")["total"] == 10


@pytest.mark.cuda
@pytest.mark.parametrize("optimizer", ["adamw", "sfadamw"])
@pytest.mark.parametrize("mode", ["sr", "kahan"])
def test_bf16_without_master_weights_trains_and_resumes_bitwise_on_gpu(shards, tmp_path, optimizer, mode):
    kw = dict(model="small", device="cuda", dtype="bf16", batch_size=4, seq_len=128, lr=1e-3,
              master_weights=mode, optimizer=optimizer)
    straight = run(_args(shards, tmp_path / "a", **kw), echo=lambda *a: None)
    assert np.isfinite(straight["losses"]).all() and straight["losses"][-1] < straight["losses"][0] - 0.3
    run(_args(shards, tmp_path / "b", steps=5, **kw), echo=lambda *a: None)
    resumed = run(_args(shards, tmp_path / "b", resume=str(tmp_path / "b"), **kw), echo=lambda *a: None)
    assert resumed["losses"] == straight["losses"][5:]
    arrays, meta = load_checkpoint(tmp_path / "a" / "ckpt_000008.ckpt")
    assert "master" not in arrays and ("kahan" in arrays) == (mode == "kahan")
    assert meta["optimizer"]["master_weights"] == mode
