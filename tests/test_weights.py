"""gpucore.weights: GPT-2 weights in and out (Hugging Face safetensors, llm.c model files), the
`gpucore export` command and `gpucore train --init-from`.

CPU tests: bitwise round trips on the "tiny" preset with random weights, the llm.c header against
the format, one clear WeightsError for every kind of bad file (and nothing written), and a 2-step
--init-from run whose first loss is the loaded model's forward loss. GPU tests (pytest -m cuda)
compare against transformers' GPT2LMHeadModel (torch on the CPU as the oracle) both ways.
"""
import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from gpucore.cli import main
from gpucore.model import GPT2, GPT2Config
from gpucore.train import TrainArgs, run
from gpucore.weights import (LLMC_MAGIC, WeightsError, hf_config_dict, load_gpt2, read_weights, write_hf,
                             write_llmc)

safetensors_numpy = pytest.importorskip("safetensors.numpy")

TINY = GPT2Config.from_preset("tiny")


def _bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


@pytest.fixture
def tiny_flat():
    """Random tiny-model weights (seeded init, every value perturbed so no tensor is trivial; the padded
    wte rows stay zero, as in every model: the Hugging Face format has no room for them)."""
    m = GPT2(TINY, seed=7)
    flat = m.params.flat().copy()
    flat += np.random.default_rng(3).standard_normal(flat.shape, dtype=np.float32) * np.float32(0.01)
    flat[TINY.vocab_size * TINY.channels:TINY.padded_vocab_size * TINY.channels] = 0   # padded wte rows
    return flat


@pytest.fixture
def hf_dir(tmp_path, tiny_flat):
    return write_hf(tmp_path / "hf", TINY, tiny_flat)


def _one_line(exc, *needles):
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*"))


# ------------------------------------------------------------ round trips ----

def test_hf_round_trip_is_bitwise(hf_dir, tiny_flat):
    cfg, flat, desc = read_weights(hf_dir)
    assert cfg == TINY and "safetensors" in desc
    assert np.array_equal(_bits(flat), _bits(tiny_flat))
    # a bare .safetensors file with config.json beside it, and the same file moved away from it
    cfg2, flat2, _ = read_weights(hf_dir / "model.safetensors")
    assert cfg2 == TINY and np.array_equal(_bits(flat2), _bits(tiny_flat))


def test_hf_file_layout_matches_transformers(hf_dir, tiny_flat):
    C, L, V, T = TINY.channels, TINY.num_layers, TINY.vocab_size, TINY.max_seq_len
    t = safetensors_numpy.load_file(str(hf_dir / "model.safetensors"))
    expected = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C),
                "transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,)}
    for l in range(L):
        p = f"transformer.h.{l}."
        expected.update({p + "ln_1.weight": (C,), p + "ln_1.bias": (C,), p + "ln_2.weight": (C,),
                         p + "ln_2.bias": (C,), p + "attn.c_attn.weight": (C, 3 * C),
                         p + "attn.c_attn.bias": (3 * C,), p + "attn.c_proj.weight": (C, C),
                         p + "attn.c_proj.bias": (C,), p + "mlp.c_fc.weight": (C, 4 * C),
                         p + "mlp.c_fc.bias": (4 * C,), p + "mlp.c_proj.weight": (4 * C, C),
                         p + "mlp.c_proj.bias": (C,)})
    assert {k: v.shape for k, v in t.items()} == expected
    assert all(v.dtype == np.float32 and v.flags.c_contiguous for v in t.values())
    from gpucore.model import parameter_layout
    host = parameter_layout(TINY, np.float32).allocate(np)
    host.flat()[...] = tiny_flat
    assert np.array_equal(t["transformer.h.1.attn.c_attn.weight"], host.qkvw[1].T)
    assert np.array_equal(t["transformer.h.0.mlp.c_proj.weight"], host.fcprojw[0].T)
    assert np.array_equal(t["transformer.wte.weight"], host.wte[:V])
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg == hf_config_dict(TINY)
    assert (cfg["model_type"], cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["n_positions"],
            cfg["vocab_size"], cfg["tie_word_embeddings"], cfg["n_inner"]) == ("gpt2", 2, 4, 64, 64, 50257,
                                                                                  True, None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llmc_round_trip_is_bitwise(tmp_path, tiny_flat, dtype):
    path = write_llmc(tmp_path / "model.bin", TINY, tiny_flat, dtype)
    cfg, flat, desc = read_weights(path)
    assert cfg == TINY and "llm.c" in desc
    want = tiny_flat if dtype == "float32" else tiny_flat.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(_bits(flat), _bits(want))
    if dtype == "bfloat16":
        assert not np.array_equal(flat, tiny_flat)      # it really was rounded


@pytest.mark.parametrize("dtype,version,item", [("float32", 3, 4), ("bfloat16", 5, 2)])
def test_llmc_header_follows_the_format(tmp_path, tiny_flat, dtype, version, item):
    path = write_llmc(tmp_path / "model.bin", TINY, tiny_flat, dtype)
    raw = path.read_bytes()
    hdr = np.frombuffer(raw[:1024], dtype="<i4")
    assert list(hdr[:8]) == [20240326, version, 64, 50257, 2, 4, 64, 50304]
    assert not hdr[8:].any()
    assert len(raw) == 1024 + TINY.num_parameters * item
    # parameters in llm.c order: wte (Vp rows, the padded ones as in the flat buffer) first
    data = np.frombuffer(raw[1024:], dtype="<f4" if item == 4 else "<u2")
    first = data[:TINY.padded_vocab_size * TINY.channels]
    if item == 2:
        first = first.view(ml_dtypes.bfloat16).astype(np.float32)
        ref = tiny_flat[:first.size].astype(ml_dtypes.bfloat16).astype(np.float32)
    else:
        ref = tiny_flat[:first.size]
    assert np.array_equal(first, ref)
    assert not first.reshape(TINY.padded_vocab_size, -1)[TINY.vocab_size:].any()   # padded rows: zero


def test_gpucore_checkpoint_and_export_cli(tmp_path, tiny_flat):
    from gpucore.checkpoint import save_checkpoint
    ckpt = tmp_path / "run" / "ckpt_000005.ckpt"
    zeros = np.zeros_like(tiny_flat)
    save_checkpoint(ckpt, {"params": tiny_flat, "m": zeros, "v": zeros},
                    {"format": "gpucore-gpt2-train", "version": 1, "preset": "tiny", "config": TINY.to_dict(),
                     "dtype": "float32", "step": 5, "optimizer": {}})
    for src in (ckpt, ckpt.parent):
        cfg, flat, desc = read_weights(src)
        assert cfg == TINY and "gpucore checkpoint" in desc and np.array_equal(flat, tiny_flat)
        model, desc = load_gpt2(src)
        assert np.array_equal(model.params.flat(), tiny_flat)
    r = CliRunner().invoke(main, ["export", str(ckpt.parent), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["export", str(tmp_path / "hf"), "--format", "llmc", "--dtype", "bfloat16",
                                  "--out", str(tmp_path / "m.bin")])
    assert r.exit_code == 0, r.output
    cfg, flat, _ = read_weights(tmp_path / "m.bin")
    assert np.array_equal(flat, tiny_flat.astype(ml_dtypes.bfloat16).astype(np.float32))
    r = CliRunner().invoke(main, ["export", str(tmp_path / "nothing.bin"), "--format", "llmc",
                                  "--out", str(tmp_path / "x.bin")])
    assert r.exit_code == 1 and "no such file" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "x.bin").exists()


def test_load_gpt2_forward_matches(hf_dir, tiny_flat):
    model, _ = load_gpt2(hf_dir)
    ref = GPT2(TINY, seed=None)
    ref.load_flat(tiny_flat)
    x = np.random.default_rng(0).integers(0, 50257, (2, 16), dtype=np.int32)
    assert float(model.forward(x, x)) == float(ref.forward(x, x))


def _hf_numpy_forward(t: dict, cfg: dict, tokens):
    """GPT2LMHeadModel's forward written from transformers' modeling_gpt2 (Conv1D: x @ W + b with W
    stored (in, out)), in float64 NumPy, straight from the safetensors tensors: an oracle for the
    layout conventions that needs no torch."""
    g = {k.removeprefix("transformer."): v.astype(np.float64) for k, v in t.items()}
    C, NH = cfg["n_embd"], cfg["n_head"]
    hs = C // NH
    B, T = tokens.shape

    def ln(x, w, b):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + cfg["layer_norm_epsilon"]) * w + b

    def gelu_new(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    h = g["wte.weight"][tokens] + g["wpe.weight"][np.arange(T)]
    mask = np.tril(np.ones((T, T), bool))
    for l in range(cfg["n_layer"]):
        p = f"h.{l}."
        a = ln(h, g[p + "ln_1.weight"], g[p + "ln_1.bias"]) @ g[p + "attn.c_attn.weight"] + g[p + "attn.c_attn.bias"]
        q, k, v = (x.reshape(B, T, NH, hs).transpose(0, 2, 1, 3) for x in np.split(a, 3, axis=-1))
        att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hs)
        att = np.where(mask, att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        h = h + y @ g[p + "attn.c_proj.weight"] + g[p + "attn.c_proj.bias"]
        m = ln(h, g[p + "ln_2.weight"], g[p + "ln_2.bias"]) @ g[p + "mlp.c_fc.weight"] + g[p + "mlp.c_fc.bias"]
        h = h + gelu_new(m) @ g[p + "mlp.c_proj.weight"] + g[p + "mlp.c_proj.bias"]
    h = ln(h, g["ln_f.weight"], g["ln_f.bias"])
    return h @ g["wte.weight"].T


def test_exported_hf_matches_a_numpy_transformers_forward(hf_dir, tiny_flat):
    t = safetensors_numpy.load_file(str(hf_dir / "model.safetensors"))
    cfg = json.loads((hf_dir / "config.json").read_text())
    tokens = np.random.default_rng(5).integers(0, 50257, (2, 16), dtype=np.int32)
    ref = _hf_numpy_forward(t, cfg, tokens)
    model = GPT2(TINY, seed=None)
    model.load_flat(tiny_flat)
    _, logits = model.forward(tokens, return_logits=True)
    logits = np.asarray(logits[..., :TINY.vocab_size], np.float64)
    assert np.abs(logits - ref).max() / np.abs(ref).max() < 1e-5


def test_bare_safetensors_infers_n_head(tmp_path, hf_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    os.replace(hf_dir / "model.safetensors", bare / "weights.safetensors")
    cfg, _, desc = read_weights(bare / "weights.safetensors")
    assert cfg.num_heads == 1 and "n_head inferred" in desc        # C=64 -> 64 // 64


def test_keys_without_prefix_and_tied_lm_head_and_buffers(tmp_path, hf_dir, tiny_flat):
    t = safetensors_numpy.load_file(str(hf_dir / "model.safetensors"))
    t = {k[len("transformer."):]: v for k, v in t.items()}
    t["lm_head.weight"] = t["wte.weight"].copy()
    t["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    t["h.1.attn.masked_bias"] = np.array(-1e4, np.float32)
    d = tmp_path / "noprefix"
    d.mkdir()
    safetensors_numpy.save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text((hf_dir / "config.json").read_text())
    cfg, flat, _ = read_weights(d)
    assert cfg == TINY and np.array_equal(_bits(flat), _bits(tiny_flat))


# -------------------------------------------------------------- bad files ----

def _hf_variant(tmp_path, hf_dir, edit_tensors=None, edit_config=None):
    t = safetensors_numpy.load_file(str(hf_dir / "model.safetensors"))
    cfg = json.loads((hf_dir / "config.json").read_text())
    if edit_tensors:
        edit_tensors(t)
    if edit_config:
        edit_config(cfg)
    d = tmp_path / "variant"
    d.mkdir(exist_ok=True)
    safetensors_numpy.save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _vocab(n):
    def edit(t):
        w = t["transformer.wte.weight"]
        t["transformer.wte.weight"] = np.concatenate([w, w[:1]])[:n].copy()
    return edit


BAD_HF = {
    "missing": (lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"), None, ["missing tensor", "h.1.mlp.c_fc.bias"]),
    "extra": (lambda t: t.update({"transformer.h.0.attn.extra": np.zeros(3, np.float32)}), None,
              ["unexpected tensor", "h.0.attn.extra"]),
    "misshaped": (lambda t: t.update({"transformer.h.0.attn.c_attn.weight":
                                      np.ascontiguousarray(t["transformer.h.0.attn.c_attn.weight"].T)}), None,
                  ["h.0.attn.c_attn.weight", "(192, 64)", "expected (64, 192)"]),
    "config_n_embd": (None, lambda c: c.update(n_embd=128), ["n_embd 128", "does not match"]),
    "config_n_layer": (None, lambda c: c.update(n_layer=3), ["n_layer 3", "does not match"]),
    "config_n_positions": (None, lambda c: c.update(n_positions=1024), ["n_positions 1024"]),
    "config_n_head": (None, lambda c: c.update(n_head=5), ["n_head 5 does not divide"]),
    "vocab_50256": (_vocab(50256), lambda c: c.update(vocab_size=50256), ["50256", "50257"]),
    "vocab_50258": (_vocab(50258), lambda c: c.update(vocab_size=50258), ["50258", "50257"]),
    "lm_head_untied": (lambda t: t.update({"lm_head.weight": t["transformer.wte.weight"] + 1}), None,
                       ["lm_head.weight", "untied"]),
}


@pytest.mark.parametrize("case", sorted(BAD_HF))
def test_bad_safetensors_is_one_clear_error(tmp_path, hf_dir, case):
    et, ec, needles = BAD_HF[case]
    d = _hf_variant(tmp_path, hf_dir, et, ec)
    before = _tree(tmp_path)
    with pytest.raises(WeightsError) as exc:
        read_weights(d)
    _one_line(exc, *needles)
    with pytest.raises(WeightsError):
        load_gpt2(d)
    out = tmp_path / "exported"
    r = CliRunner().invoke(main, ["export", str(d), "--format", "llmc", "--out", str(out)])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert _tree(tmp_path) == before                        # nothing written


def _llmc_bad(tmp_path, tiny_flat, edit):
    path = write_llmc(tmp_path / "model.bin", TINY, tiny_flat)
    raw = bytearray(path.read_bytes())
    raw = edit(raw)
    bad = tmp_path / "bad.bin"
    bad.write_bytes(bytes(raw))
    return bad


def _set_int(i, v):
    def edit(raw):
        raw[4 * i:4 * i + 4] = int(v).to_bytes(4, "little", signed=True)
        return raw
    return edit


BAD_LLMC = {
    "truncated": (lambda raw: raw[:-4], ["truncated llm.c model file"]),
    "truncated_header": (lambda raw: raw[:100], ["truncated llm.c model file", "header"]),
    "one_byte_more": (lambda raw: raw + b"\0", ["corrupt llm.c model file"]),
    "magic": (_set_int(0, 20240327), ["bad magic 20240327", str(LLMC_MAGIC)]),
    "version": (_set_int(1, 4), ["unsupported llm.c model file version 4"]),
    "header_shape": (_set_int(4, 3), ["truncated llm.c model file"]),          # L=3: the file is too short
    "header_bad_config": (_set_int(5, 5), ["bad llm.c header", "num_heads"]),  # NH=5 does not divide C=64
}


@pytest.mark.parametrize("case", sorted(BAD_LLMC))
def test_bad_llmc_file_is_one_clear_error(tmp_path, tiny_flat, case):
    edit, needles = BAD_LLMC[case]
    bad = _llmc_bad(tmp_path, tiny_flat, edit)
    before = _tree(tmp_path)
    with pytest.raises(WeightsError) as exc:
        read_weights(bad)
    _one_line(exc, str(bad), *needles)
    assert _tree(tmp_path) == before


def test_missing_path_and_hub_name_without_huggingface_hub(tmp_path, monkeypatch):
    with pytest.raises(WeightsError) as exc:
        read_weights(tmp_path / "nothing.bin")
    _one_line(exc, "no such file or directory")
    import builtins
    real_import = builtins.__import__

    def no_hub(name, *a, **k):
        if name == "huggingface_hub":
            raise ImportError("no")
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_hub)
    monkeypatch.chdir(tmp_path)
    for name in ("gpt2", "openai-community/gpt2-medium"):
        with pytest.raises(WeightsError) as exc:
            read_weights(name)
        _one_line(exc, "pip install huggingface_hub", f"https://huggingface.co/{name}")


def test_hub_name_goes_through_snapshot_download(tmp_path, hf_dir, tiny_flat, monkeypatch):
    import sys
    import types
    calls = []

    def snapshot_download(name, allow_patterns=None):
        calls.append((name, allow_patterns))
        if name == "nobody/nothing":
            raise RuntimeError("Repository Not Found\nmore detail")
        return str(hf_dir)
    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download))
    monkeypatch.chdir(tmp_path)
    model, desc = load_gpt2("gpt2")
    assert calls == [("gpt2", ["config.json", "model.safetensors"])]
    assert np.array_equal(model.params.flat(), tiny_flat)
    with pytest.raises(WeightsError) as exc:
        read_weights("nobody/nothing")
    _one_line(exc, "nobody/nothing", "Hugging Face hub", "Repository Not Found")
    with pytest.raises(WeightsError) as exc:          # an existing path is never taken for a hub name
        (tmp_path / "gpt2").mkdir()
        read_weights("gpt2")
    _one_line(exc, "no model.safetensors")
    assert len(calls) == 2


def test_write_refuses_non_gpt2_vocab_and_bad_sizes(tmp_path, tiny_flat):
    micro = GPT2Config.from_preset("micro")
    with pytest.raises(WeightsError, match="50257"):
        write_hf(tmp_path / "hf", micro, np.zeros(micro.num_parameters, np.float32))
    with pytest.raises(WeightsError, match="expected"):
        write_llmc(tmp_path / "m.bin", TINY, tiny_flat[:-1])
    with pytest.raises(WeightsError, match="float32 or bfloat16"):
        write_llmc(tmp_path / "m.bin", TINY, tiny_flat, "float16")
    assert _tree(tmp_path) == []


def test_write_hf_over_existing_dir_keeps_other_files(tmp_path, tiny_flat):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "tokenizer.json").write_text("{}")
    write_hf(d, TINY, tiny_flat)
    assert _tree(tmp_path / "hf") == ["config.json", "model.safetensors", "tokenizer.json"]
    write_hf(d, TINY, tiny_flat * 2)
    assert np.array_equal(read_weights(d)[1], tiny_flat * 2)
    assert _tree(tmp_path / "hf") == ["config.json", "model.safetensors", "tokenizer.json"]


# ------------------------------------------------------- train --init-from ----

@pytest.mark.parametrize("fmt", ["hf", "llmc"])
def test_train_init_from_starts_from_the_weights(shards, tmp_path, tiny_flat, fmt):
    from gpucore.data import DataLoader
    src = write_hf(tmp_path / "w", TINY, tiny_flat) if fmt == "hf" else \
        write_llmc(tmp_path / "w.bin", TINY, tiny_flat)
    model, _ = load_gpt2(src)
    x, y = DataLoader(str(shards), 2, 32, split="train").next_batch()
    expected = float(model.forward(x, y))
    lines = []
    args = TrainArgs(device="cpu", batch_size=2, seq_len=32, steps=2, lr=1e-3, val_every=0, sample_every=0,
                     data=str(shards), out_dir=str(tmp_path / "out"), init_from=str(src))
    res = run(args, echo=lines.append)
    assert len(res["losses"]) == 2 and res["losses"][0] == expected
    assert any("initialised from" in line for line in lines)
    assert any("model tiny" in line for line in lines)         # the weights' config is the tiny preset
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["event"] == "start" and rows[0]["init_from"] == str(src) and rows[0]["init_source"]
    # a different seed does not matter: the weights come from the file
    args2 = TrainArgs(**{**args.__dict__, "seed": 99, "out_dir": str(tmp_path / "out2"), "model": "tiny"})
    assert run(args2, echo=lambda s: None)["losses"][0] == expected


def _cli_train(args):
    return CliRunner().invoke(main, ["train", *map(str, args)])


def test_train_init_from_refusals(shards, tmp_path, tiny_flat):
    src = write_llmc(tmp_path / "w.bin", TINY, tiny_flat)
    common = ["--device", "cpu", "--data", shards, "--out-dir", tmp_path / "out", "--steps", 1]
    r = _cli_train(["--init-from", src, "--resume", tmp_path / "out", *common])
    assert r.exit_code == 1 and "--init-from and --resume" in r.output
    assert len(r.output.strip().splitlines()) == 1
    r = _cli_train(["--init-from", src, "--model", "small", *common])
    assert r.exit_code == 1 and "does not match the weights" in r.output
    r = _cli_train(["--init-from", tmp_path / "missing.bin", *common])
    assert r.exit_code == 1 and "--init-from" in r.output and "no such file" in r.output
    assert not (tmp_path / "out").exists()


# -------------------------------------------------------------------- GPU ----

def _hf_oracle_model(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=50257)
    hf = transformers.GPT2LMHeadModel(cfg).float().eval()
    # a fresh model has zero biases and unit LN weights: perturb everything so each tensor matters
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return torch, hf


def _hf_logits_and_loss(torch, hf, tokens, targets):
    with torch.no_grad():
        logits = hf(torch.from_numpy(tokens.astype(np.int64))).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.from_numpy(targets.astype(np.int64)).reshape(-1))
    return logits.numpy(), float(loss)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.cuda
def test_gpu_load_hf_matches_transformers(tmp_path):
    import cupy
    torch, hf = _hf_oracle_model(tmp_path)
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    model, desc = load_gpt2(tmp_path / "hf", xp=cupy, dtype="float32")
    assert model.config == GPT2Config(num_layers=2, num_heads=4, channels=64, max_seq_len=64)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, (2, 16), dtype=np.int32)
    targets = rng.integers(0, 50257, (2, 16), dtype=np.int32)
    ref_logits, ref_loss = _hf_logits_and_loss(torch, hf, tokens, targets)
    loss, logits = model.forward(cupy.asarray(tokens), cupy.asarray(targets), return_logits=True)
    logits = cupy.asnumpy(logits)[..., :50257]
    assert _rel(logits, ref_logits) < 1e-5
    assert abs(float(loss) - ref_loss) / abs(ref_loss) < 1e-5


@pytest.mark.cuda
def test_gpu_write_hf_loads_in_transformers(tmp_path, tiny_flat):
    import cupy
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = GPT2(TINY, xp=cupy, dtype="float32", seed=None)
    model.load_flat(tiny_flat)
    write_hf(tmp_path / "hf", TINY, model.params.flat())
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).float().eval()
    tokens = np.random.default_rng(1).integers(0, 50257, (2, 16), dtype=np.int32)
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()
    _, logits = model.forward(cupy.asarray(tokens), return_logits=True)
    assert _rel(cupy.asnumpy(logits)[..., :50257], ref) < 1e-5


def test_resume_command_leaves_init_from_out():
    from gpucore.cli import resume_command
    cmd = resume_command(TrainArgs(init_from="w.bin", steps=10, model="tiny"), "out/tiny/ckpt_000005.ckpt")
    assert "--init-from" not in cmd and "--resume out/tiny/ckpt_000005.ckpt" in cmd
