"""gpucore.evaluate on the CPU: loss over shards, HellaSwag (jsonl and llm.c's .bin), llm.c debug state."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from gpucore import evaluate as ev
from gpucore import tokenizer
from gpucore.data import write_shard
from gpucore.model import GPT2, GPT2Config, parameter_specs

EXAMPLES = [
    {"ctx": "A man is sitting on a roof. he", "label": 3,
     "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                 "is holding a rubik's cube.", "starts pulling up roofing on a roof."]},
    {"ctx": "The cat sat on the", "label": 0,
     "endings": ["mat.", "moon, singing loudly to the stars all night", "of", "table and then jumped off"]},
    {"ctx": "She opened the fridge and took out the milk. Then she", "label": 1,
     "endings": ["flew.", "poured a glass.", "ate the fridge whole.", "was"]},
]


@pytest.fixture(scope="module")
def tiny():
    return GPT2(GPT2Config.from_preset("tiny"), seed=7)


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ------------------------------------------------------------------ loss ----

def test_evaluate_loss_equals_mean_of_forward_losses(tiny, tmp_path):
    rng = np.random.default_rng(0)
    val = rng.integers(0, 50257, 16 * 9 + 5).astype(np.uint16)
    write_shard(tmp_path / "d_val.bin", val)
    write_shard(tmp_path / "d_train.bin", rng.integers(0, 50257, 500))
    B, T = 2, 16
    nb = (val.size - 1) // (B * T)                 # llm.c's batches per shard
    ref = []
    for k in range(nb):                            # independent of the DataLoader
        buf = val[k * B * T: k * B * T + B * T + 1].astype(np.int32)
        ref.append(float(tiny.forward(buf[:-1].reshape(B, T), buf[1:].reshape(B, T))))
    r = ev.evaluate_loss(tiny, tmp_path, B, T)     # a directory: its val split
    assert r["batches"] == nb and r["tokens"] == nb * B * T
    assert r["loss"] == pytest.approx(np.mean(ref), rel=1e-6)
    assert r["perplexity"] == pytest.approx(np.exp(np.mean(ref)), rel=1e-6)
    r2 = ev.evaluate_loss(tiny, tmp_path / "d_val.bin", B, T, max_batches=2)
    assert r2["batches"] == 2 and r2["loss"] == pytest.approx(np.mean(ref[:2]), rel=1e-6)


def test_evaluate_loss_errors(tiny, tmp_path):
    with pytest.raises(ev.EvalError, match="not found"):
        ev.evaluate_loss(tiny, tmp_path / "nope.bin", 2, 16)
    with pytest.raises(ev.EvalError, match="max_seq_len"):
        ev.evaluate_loss(tiny, tmp_path / "nope.bin", 2, 65)


# ------------------------------------------------------------- hellaswag ----

def _independent_scores(model, ex):
    """Sum and mean of -log p(ending token) from the unpadded row, log-softmax in float64."""
    ctx = tokenizer.encode(ex["ctx"])
    sums, means = [], []
    for end in ex["endings"]:
        e = tokenizer.encode(" " + end)
        seq = np.asarray(ctx + e, dtype=np.int32)
        _, logits = model.forward(seq[None, :-1], return_logits=True)
        lg = logits[0, :, :model.config.vocab_size].astype(np.float64)
        logp = lg - lg.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        pos = np.arange(len(ctx) - 1, len(seq) - 1)
        nll = -logp[pos, seq[pos + 1]]
        sums.append(nll.sum())
        means.append(nll.mean())
    return np.array(sums), np.array(means)


def test_hellaswag_jsonl_and_bin_agree_and_match_independent_scores(tiny, tmp_path):
    jl = _jsonl(tmp_path / "hs.jsonl", EXAMPLES)
    n = ev.write_hellaswag_bin(tmp_path / "hellaswag_val.bin", EXAMPLES)
    assert n == 3
    exs = ev.read_hellaswag(tmp_path / "hellaswag_val.bin")
    for e, rec in zip(exs, EXAMPLES):
        assert e.label == rec["label"] and e.ctx_tokens == tokenizer.encode(rec["ctx"])
        assert e.ending_tokens == [tokenizer.encode(" " + x) for x in rec["endings"]]
    a = ev.evaluate_hellaswag(tiny, jl, rows_per_batch=5)       # rows of one example split over batches
    b = ev.evaluate_hellaswag(tiny, tmp_path / "hellaswag_val.bin", rows_per_batch=5)
    assert a["per_example"] == b["per_example"]
    assert a["examples"] == 3 and a["skipped"] == 0
    correct = correct_norm = 0
    for p, rec in zip(a["per_example"], EXAMPLES):
        s, m = _independent_scores(tiny, rec)
        np.testing.assert_allclose(p["sum_losses"], s, rtol=1e-5)
        np.testing.assert_allclose(p["mean_losses"], m, rtol=1e-5)
        assert p["pred"] == int(np.argmin(s)) and p["pred_norm"] == int(np.argmin(m))
        correct += p["pred"] == rec["label"]
        correct_norm += p["pred_norm"] == rec["label"]
    assert a["acc"] == correct / 3 and a["acc_norm"] == correct_norm / 3
    # one row per batch gives the same scores (padding and batching do not change them)
    c = ev.evaluate_hellaswag(tiny, jl, rows_per_batch=1)
    for p, q in zip(a["per_example"], c["per_example"]):
        np.testing.assert_allclose(p["mean_losses"], q["mean_losses"], rtol=1e-5)


def test_hellaswag_bin_layout_is_llmc_write_evalfile(tmp_path):
    p = tmp_path / "e.bin"
    ev.write_hellaswag_bin(p, [{"label": 2, "ctx_tokens": [5, 6], "ending_tokens": [[7], [8, 9], [10], [11]]}])
    raw = p.read_bytes()
    h = np.frombuffer(raw[:1024], dtype="<i4")
    s = np.frombuffer(raw[1024:], dtype="<u2").tolist()
    # START, EXAMPLE_BYTES, INDEX, LABEL, NUM_COMPLETIONS, NUM ctx..., (NUM completion...) x 4
    assert s == [65535, 2 * 17, 0, 2, 4, 2, 5, 6, 1, 7, 2, 8, 9, 1, 10, 1, 11]
    assert h[:4].tolist() == [20240522, 1, 1, 34] and not h[4:].any()


def test_hellaswag_skips_examples_longer_than_max_seq_len(tiny, tmp_path):
    long = {"ctx": "word " * 80, "label": 0, "endings": ["a", "b", "c", "d"]}
    r = ev.evaluate_hellaswag(tiny, [ev.render_example(e, i) for i, e in enumerate(EXAMPLES + [long])])
    assert r["examples"] == 3 and r["skipped"] == 1


@pytest.mark.parametrize("damage, msg", [
    (lambda raw: b"\x00\x00\x00\x00" + raw[4:], "bad magic number 0"),
    (lambda raw: raw[:-6], "truncated or corrupt"),
    (lambda raw: raw[:500], "truncated eval file"),
    (lambda raw: raw + b"\x01\x00", "after the last of 3 examples"),
])
def test_hellaswag_bad_bin_is_one_line(tmp_path, damage, msg):
    p = tmp_path / "hellaswag_val.bin"
    ev.write_hellaswag_bin(p, EXAMPLES)
    p.write_bytes(damage(p.read_bytes()))
    with pytest.raises(ev.EvalError, match=msg) as e:
        ev.read_hellaswag(p)
    assert "\n" not in str(e.value) and str(p) in str(e.value)


def test_hellaswag_bad_jsonl(tmp_path):
    p = tmp_path / "h.jsonl"
    p.write_text('{"ctx": "x", "endings": ["a"]}\n')
    with pytest.raises(ev.EvalError, match="missing field 'label'"):
        ev.read_hellaswag(p)


# ------------------------------------------------------------ debug state ----

def _make_state(model, path, B=2, T=12, seed=3):
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    y = rng.integers(0, V, (B, T)).astype(np.int32)
    model.forward(x, y)
    lnf = model.acts.lnf.astype(np.float64)                      # logits recomputed in float64
    logits = lnf @ model.params.wte[:V].astype(np.float64).T
    model.zero_grad()
    loss = model.forward(x, y, for_backward=True, grad_scale=1.0 / (B * T))
    model.backward()
    ev.write_debug_state(path, x, y, logits, loss, model.grads.flat().copy())
    return x, y


def test_debug_state_roundtrip_and_check(tiny, tmp_path):
    p = tmp_path / "gpt2_124M_debug_state.bin"
    x, y = _make_state(tiny, p)
    st = ev.read_debug_state(p)
    assert (st.B, st.T) == (2, 12) and (st.x == x).all() and (st.y == y).all()
    assert st.logits.shape == (2, 12, 50257) and st.grads.size == tiny.num_parameters
    r = ev.check_debug_state(tiny, st)
    assert r["ok"], r["failed"]
    assert r["logits"]["maxdiff"] < 1e-4 and r["loss"]["diff"] < 1e-6
    assert [g["name"] for g in r["grads"]] == [n for n, _, _ in parameter_specs(tiny.config)]
    assert ev.check_debug_state(tiny, st, tolerance="cu")["ok"]
    assert ev.format_debug_report(r)[-1] == "overall: OK"


def test_debug_state_perturbed_grad_is_named(tiny, tmp_path):
    p = tmp_path / "s.bin"
    _make_state(tiny, p)
    st = ev.read_debug_state(p)
    grads = st.grads.copy()
    off = tiny.layout.offsets["qkvb"] // 4
    grads[off + 5] += 0.1
    st.grads = grads
    r = ev.check_debug_state(tiny, st)
    assert not r["ok"] and r["failed"] == ["qkvb"]
    st.loss += 0.5
    assert ev.check_debug_state(tiny, st)["failed"] == ["loss", "qkvb"]


def test_debug_state_unpadded_wte_grads(tiny, tmp_path):
    """The wte gradient may hold any number of padded rows >= V; only the V real rows count."""
    p = tmp_path / "s.bin"
    _make_state(tiny, p)
    st = ev.read_debug_state(p)
    cfg = tiny.config
    C, V, Vp = cfg.channels, cfg.vocab_size, cfg.padded_vocab_size
    st.grads = np.concatenate([st.grads[:V * C], st.grads[Vp * C:]])
    assert ev.check_debug_state(tiny, st)["ok"]


@pytest.mark.parametrize("damage, msg", [
    (lambda raw: b"\x01\x00\x00\x00" + raw[4:], "bad magic number 1"),
    (lambda raw: raw[:4] + b"\x01\x00\x00\x00" + raw[8:], "version 1"),
    (lambda raw: raw[:1024 + 100], "truncated or corrupt"),
    (lambda raw: raw[:1000], "truncated debug state"),
])
def test_debug_state_bad_file_is_one_line(tiny, tmp_path, damage, msg):
    p = tmp_path / "s.bin"
    _make_state(tiny, p, B=1, T=4)
    p.write_bytes(damage(p.read_bytes()))
    with pytest.raises(ev.EvalError, match=msg) as e:
        ev.read_debug_state(p)
    assert "\n" not in str(e.value)


def test_debug_state_wrong_model_size(tiny, tmp_path):
    p = tmp_path / "s.bin"
    _make_state(tiny, p, B=1, T=4)
    st = ev.read_debug_state(p)
    st.grads = st.grads[:-1000]
    with pytest.raises(ev.EvalError, match="do not fit this model"):
        ev.check_debug_state(tiny, st)


# ------------------------------------------------------------------- CLI ----

def test_eval_command_on_a_checkpoint(tiny, tmp_path):
    from gpucore.checkpoint import save_training_checkpoint
    from gpucore.optim import AdamW
    ck = tmp_path / "model.ckpt"
    save_training_checkpoint(ck, tiny, AdamW(tiny), step=5, preset="tiny")
    rng = np.random.default_rng(1)
    write_shard(tmp_path / "data" / "t_val.bin", rng.integers(0, 50257, 300))
    jl = _jsonl(tmp_path / "hs.jsonl", EXAMPLES)
    out = tmp_path / "m.json"
    res = CliRunner().invoke(ev.eval_command, ["--init-from", str(ck), "--data", str(tmp_path / "data"),
                                               "-B", "2", "-T", "16", "--device", "cpu",
                                               "--hellaswag", str(jl), "--json", str(out)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert any(line.startswith("loss ") for line in lines)
    assert any(line.startswith("perplexity ") for line in lines)
    assert any(line.startswith("hellaswag_acc_norm ") for line in lines)
    m = json.loads(out.read_text())
    ref = ev.evaluate_loss(tiny, tmp_path / "data", 2, 16)
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-6) and m["batches"] == 9
    assert m["hellaswag"]["examples"] == 3


def test_eval_command_errors_are_one_line(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(ev, "_load", lambda path, device="auto", dtype="auto": (tiny, "tiny"))
    bad = tmp_path / "hellaswag_val.bin"
    bad.write_bytes(b"\x00" * 2000)
    r = CliRunner().invoke(ev.eval_command, ["--init-from", "x", "--hellaswag", str(bad)])
    assert r.exit_code == 1 and "bad magic number" in r.output
    assert r.output.count("\n") == 2           # the model line + one error line
    r = CliRunner().invoke(ev.eval_command, ["--init-from", "x", "--data", str(tmp_path / "none.bin")])
    assert r.exit_code == 1 and "not found" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(ev.eval_command, ["--init-from", "x"])
    assert r.exit_code == 2 and "--data" in r.output


def test_eval_command_missing_checkpoint(tmp_path):
    r = CliRunner().invoke(ev.eval_command, ["--init-from", str(tmp_path / "none.ckpt"), "--data", "x",
                                             "--device", "cpu"])
    assert r.exit_code == 1 and "Traceback" not in r.output and len(r.output.splitlines()) == 1


def test_check_debug_state_command(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(ev, "_load", lambda path, device="auto", dtype="auto": (tiny, "tiny"))
    p = tmp_path / "gpt2_124M_debug_state.bin"
    _make_state(tiny, p)
    r = CliRunner().invoke(ev.check_debug_state_command, ["--init-from", "x", "--state", str(p)])
    assert r.exit_code == 0, r.output
    assert "dqkvw" in r.output and r.output.splitlines()[-1] == "overall: OK"
    st = ev.read_debug_state(p)
    g = st.grads.copy()
    g[tiny.layout.offsets["fcw"] // 4] += 1.0
    ev.write_debug_state(p, st.x, st.y, st.logits, st.loss, g)
    r = CliRunner().invoke(ev.check_debug_state_command, ["--init-from", "x", "--state", str(p)])
    assert r.exit_code == 1 and "MISMATCH in fcw" in r.output
    p.write_bytes(b"\x00" * 10)
    r = CliRunner().invoke(ev.check_debug_state_command, ["--init-from", "x", "--state", str(p)])
    assert r.exit_code == 1 and "truncated debug state" in r.output and "Traceback" not in r.output


# ------------------------------------------------------------------- GPU ----

@pytest.mark.cuda
def test_gpu_matches_cpu(tiny, tmp_path):
    """fp32 on the GPU: loss, HellaSwag scores and the debug state check agree with the CPU."""
    from gpucore import runtime
    cp = runtime.cupy
    gpu = GPT2(tiny.config, xp=cp, dtype="float32", seed=None)
    gpu.load_flat(tiny.params.flat())
    rng = np.random.default_rng(2)
    write_shard(tmp_path / "v_val.bin", rng.integers(0, 50257, 200))
    a, b = ev.evaluate_loss(tiny, tmp_path, 2, 16), ev.evaluate_loss(gpu, tmp_path, 2, 16)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    h_cpu = ev.evaluate_hellaswag(tiny, [ev.render_example(e, i) for i, e in enumerate(EXAMPLES)])
    h_gpu = ev.evaluate_hellaswag(gpu, [ev.render_example(e, i) for i, e in enumerate(EXAMPLES)])
    for p, q in zip(h_cpu["per_example"], h_gpu["per_example"]):
        np.testing.assert_allclose(q["mean_losses"], p["mean_losses"], rtol=1e-4)
    p = tmp_path / "s.bin"
    _make_state(tiny, p)
    r = ev.check_debug_state(gpu, ev.read_debug_state(p), tolerance="c")
    assert r["ok"], ev.format_debug_report(r)


def test_check_debug_state_command_on_llmc_weights(tiny, tmp_path):
    """The llm.c pair end to end: gpt2_124M.bin-style weights + debug state, no monkeypatching."""
    weights = pytest.importorskip("gpucore.weights")
    if not hasattr(weights, "write_llmc"):
        pytest.skip("gpucore.weights has no write_llmc")
    w = weights.write_llmc(tmp_path / "gpt2_tiny.bin", tiny.config, tiny.params.flat())
    p = tmp_path / "gpt2_tiny_debug_state.bin"
    _make_state(tiny, p)
    r = CliRunner().invoke(ev.check_debug_state_command, ["--init-from", str(w), "--state", str(p),
                                                          "--device", "cpu", "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is True
