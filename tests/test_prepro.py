"""`gpucore prepro` and data.prepro: llm.c's Tiny Shakespeare token counts exactly, and clean CLI errors."""
import re

import numpy as np
import pytest
from click.testing import CliRunner

from gpucore import data, tokenizer
from gpucore.cli import main
from gpucore.data import DataError, DataLoader, read_shard


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    """Tokenize the bundled corpus once for the module (about 0.3 s)."""
    out = tmp_path_factory.mktemp("ts")
    return data.prepro(None, out), out


def test_bundled_counts_match_llmc(shakespeare):
    res, out = shakespeare
    assert res["train"] == (out / "tinyshakespeare_train.bin", 305_260)
    assert res["val"] == (out / "tinyshakespeare_val.bin", 32_768)
    val, train = read_shard(res["val"][0]), read_shard(res["train"][0])
    assert val.size == 32_768 and train.size == 305_260
    assert val[:5].tolist() == [tokenizer.EOT, 5962, 22307, 25, 198]  # <|endoftext|>First Citizen:\n
    assert int(max(val.max(), train.max())) == tokenizer.EOT


def test_tokens_cover_the_whole_text(shakespeare):
    res, _ = shakespeare
    toks = np.concatenate([read_shard(res["val"][0]), read_shard(res["train"][0])])
    text = data.TINYSHAKESPEARE.read_text(encoding="utf-8")
    assert int((toks == tokenizer.EOT).sum()) == len(text.split("\n\n"))  # one EOT per section
    assert tokenizer.decode(toks).replace(tokenizer.EOT_TEXT, "") == text


def test_prepro_output_feeds_the_loader(shakespeare):
    _, out = shakespeare
    train = DataLoader(out, 4, 64, split="train", vocab_size=tokenizer.VOCAB_SIZE)
    val = DataLoader(out, 4, 64, split="val", vocab_size=tokenizer.VOCAB_SIZE)
    assert train.num_tokens == 305_260 and val.num_tokens == 32_768
    x, y = val.next_batch()
    assert x[0, :4].tolist() == [tokenizer.EOT, 5962, 22307, 25] and y[0, :3].tolist() == [5962, 22307, 25]


def test_tokenize_sections():
    toks = data.tokenize_sections("A b.\n\nC d.\n\n\nE")
    # sections "A b.", "C d.", "\nE"; the first two get their "\n\n" back
    assert toks.dtype == np.uint16 and toks[0] == tokenizer.EOT
    assert int((toks == tokenizer.EOT).sum()) == 3
    assert tokenizer.decode(toks) == "<|endoftext|>A b.\n\n<|endoftext|>C d.\n\n<|endoftext|>\nE"


# --------------------------------------------------------------------- CLI ----

def test_cli_default_writes_data_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["prepro"])
    assert res.exit_code == 0, res.output
    assert "train: 305,260 tokens" in res.output and "val: 32,768 tokens" in res.output
    d = tmp_path / "data" / "tinyshakespeare"
    assert read_shard(d / "tinyshakespeare_train.bin").size == 305_260
    assert sorted(p.name for p in d.iterdir()) == ["tinyshakespeare_train.bin", "tinyshakespeare_val.bin"]


def test_cli_custom_input(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = "\n\n".join(f"Section {i}: some words here." for i in range(50))
    (tmp_path / "mytext.txt").write_text(text, encoding="utf-8")
    total = data.tokenize_sections(text).size
    res = CliRunner().invoke(main, ["prepro", "mytext.txt", "--val-tokens", "20"])
    assert res.exit_code == 0, res.output
    assert read_shard(tmp_path / "data" / "mytext" / "mytext_val.bin").size == 20
    assert read_shard(tmp_path / "data" / "mytext" / "mytext_train.bin").size == total - 20
    # --out-dir, and writing again replaces the files
    res = CliRunner().invoke(main, ["prepro", "mytext.txt", "--out-dir", str(tmp_path / "o"), "--val-tokens", "30"])
    assert res.exit_code == 0, res.output
    assert f"val: 30 tokens -> {tmp_path / 'o' / 'mytext_val.bin'}" in res.output
    res = CliRunner().invoke(main, ["prepro", "mytext.txt", "--out-dir", str(tmp_path / "o"), "--val-tokens", "40"])
    assert read_shard(tmp_path / "o" / "mytext_val.bin").size == 40
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["mytext_train.bin", "mytext_val.bin"]


@pytest.mark.parametrize("case, match", [
    ("missing", "input text file not found"),
    ("too_small", "only 3 tokens, not more than --val-tokens 32768"),
    ("binary", "not UTF-8 text"),
    ("out_dir_is_file", "File exists|Not a directory|not a directory"),
])
def test_cli_errors_are_one_line(tmp_path, monkeypatch, case, match):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small.txt").write_text("hi there")
    (tmp_path / "blob.txt").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "afile").write_text("x")
    args = {"missing": ["nope.txt"], "too_small": ["small.txt"], "binary": ["blob.txt"],
            "out_dir_is_file": ["small.txt", "--val-tokens", "1", "--out-dir", "afile/sub"]}
    res = CliRunner().invoke(main, ["prepro", *args[case]])
    assert res.exit_code == 1, res.output
    assert isinstance(res.exception, SystemExit)  # a clean exit, not an escaped exception
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert re.search(match, lines[0]), lines[0]


def test_cli_directory_input_is_a_usage_error(tmp_path):
    res = CliRunner().invoke(main, ["prepro", str(tmp_path)])
    assert res.exit_code == 2 and "is a directory" in res.output and "Traceback" not in res.output


def test_cli_rejects_bad_val_tokens(tmp_path):
    res = CliRunner().invoke(main, ["prepro", "--val-tokens", "0", "--out-dir", str(tmp_path)])
    assert res.exit_code == 2 and "val-tokens" in res.output


def test_prepro_api_errors(tmp_path):
    with pytest.raises(DataError, match="input text file not found"):
        data.prepro(tmp_path / "nope.txt", tmp_path)
    with pytest.raises(ValueError, match="val_tokens"):
        data.prepro(None, tmp_path, val_tokens=-1)
