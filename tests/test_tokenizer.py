"""GPT-2 tokenizer built offline from the bundled vocabulary: known ids, round trips, errors."""
import numpy as np
import pytest

from gpucore import tokenizer
from gpucore.tokenizer import EOT, VOCAB_SIZE, decode, encode, get_tokenizer


def test_known_ids():
    # ids from OpenAI's GPT-2 encoder.json (the same as tiktoken.get_encoding("gpt2"))
    assert encode("Hello world") == [15496, 995]
    assert encode("hello world") == [31373, 995]
    assert encode(" the") == [262]
    assert encode("First Citizen:\n") == [5962, 22307, 25, 198]
    assert decode([15496, 995]) == "Hello world"


def test_encoding_properties_and_cache():
    enc = get_tokenizer()
    assert enc is get_tokenizer()  # built once
    assert enc.n_vocab == VOCAB_SIZE == 50257
    assert enc.eot_token == EOT == 50256
    assert enc.name == "gpt2"


def test_special_token_handling():
    # by default the literal text is ordinary text (never an error) ...
    ordinary = encode("a<|endoftext|>b")
    assert EOT not in ordinary and decode(ordinary) == "a<|endoftext|>b"
    # ... and becomes the EOT id when asked
    assert encode("a<|endoftext|>b", allow_special=True) == [64, EOT, 65]
    assert decode([EOT]) == "<|endoftext|>"


@pytest.mark.parametrize("text", [
    "", " ", "\n\n\n", "  leading and trailing  ", "tabs\tand\r\nCRLF",
    "It's, they'll, we've, I'd, you're: 12345 678.9 !!!??",
    "ñandú, naïve café, 日本語のテキスト, Ελληνικά, emoji 🙂👍🏽",
    "KING RICHARD III:\nNow is the winter of our discontent\nMade glorious summer by this sun of York;\n",
])
def test_round_trip(text):
    ids = encode(text)
    assert all(isinstance(i, int) and 0 <= i < EOT for i in ids)
    assert decode(ids) == text
    assert decode(np.asarray(ids, dtype=np.int32)) == text  # arrays accepted too


def test_batch_matches_single():
    texts = ["Hello world", "x's 12", "", "<|endoftext|>"]
    assert tokenizer.encode_batch(texts) == [encode(t) for t in texts]
    assert tokenizer.encode_batch(texts, allow_special=True)[3] == [EOT]


def test_decode_partial_utf8_does_not_raise():
    ids = encode("🙂")
    assert len(ids) > 1  # a 4-byte character spans several byte-level tokens
    assert decode(ids[:1]) == "\ufffd"


def test_decode_errors():
    with pytest.raises(ValueError, match="ids: token id 50257"):
        decode([1, VOCAB_SIZE])
    with pytest.raises(ValueError, match="ids: token id -1"):
        decode([-1])
    with pytest.raises(TypeError, match="ids: expected integer"):
        decode(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="1-D"):
        decode(np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(TypeError, match="text: expected str"):
        encode(b"bytes")
    assert decode([]) == ""


def test_vocab_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="package data is missing"):
        tokenizer._load_ranks(tmp_path / "nope.tiktoken")
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(b"IQ== 0\nnot-a-valid-line\n")
    with pytest.raises(ValueError, match="bad.tiktoken:2"):
        tokenizer._load_ranks(bad)
    short = tmp_path / "short.tiktoken"
    short.write_bytes(b"IQ== 0\nIg== 1\n")
    with pytest.raises(ValueError, match="damaged"):
        tokenizer._load_ranks(short)
