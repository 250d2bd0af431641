"""GPT-2 byte-pair tokenizer: tiktoken's `gpt2` encoding, built offline from the bundled vocabulary.

`tiktoken.get_encoding("gpt2")` downloads its vocabulary on first use, and the
machines gpucore runs on have no internet. The package ships the same 50,256
mergeable ranks as `gpucore/assets/gpt2.tiktoken` (one base64 token and its
rank per line) and builds the identical `tiktoken.Encoding` from it: same
ranks, same pre-tokenizer regex, same special token. The result is cached, so
every caller shares one Encoding.

    >>> from gpucore import tokenizer
    >>> tokenizer.encode("Hello world")
    [15496, 995]
    >>> tokenizer.decode([15496, 995])
    'Hello world'
"""
from __future__ import annotations

import base64
import functools
from pathlib import Path

import numpy as np

from . import runtime

VOCAB_PATH = Path(__file__).resolve().parent / "assets" / "gpt2.tiktoken"

EOT = 50256                 # <|endoftext|>: separates documents, starts every llm.c section
EOT_TEXT = "<|endoftext|>"
VOCAB_SIZE = 50257          # 50,256 BPE ranks + EOT (the model pads its embedding to 50,304)

# GPT-2's pre-tokenizer regex (tiktoken calls it r50k_pat_str): contractions,
# letter runs, digit runs, punctuation runs, each with one optional leading
# space; then whitespace. This is the classic form of the pattern; newer
# tiktoken releases spell it with possessive quantifiers for speed, with the
# same splits, and this form works on every tiktoken version we support.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _load_ranks(path: Path) -> dict[bytes, int]:
    """Parse a .tiktoken file ourselves: tiktoken.load would also copy it into a cache dir."""
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"GPT-2 vocabulary not found at {path}: the package data is missing "
                                "(reinstall gpucore)") from None
    ranks = {}
    for i, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError:
            raise ValueError(f"{path}:{i}: expected '<base64 token> <rank>', got {line[:60]!r}") from None
    if len(ranks) != EOT or sorted(ranks.values()) != list(range(EOT)):
        raise ValueError(f"{path}: expected ranks 0..{EOT - 1} ({EOT} tokens), got {len(ranks)} tokens; "
                         "the vocabulary file is damaged")
    return ranks


@functools.lru_cache(maxsize=1)
def get_tokenizer():
    """The GPT-2 tiktoken.Encoding (50,257 tokens, EOT = 50256), built once from the bundled vocabulary."""
    import tiktoken
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=_load_ranks(VOCAB_PATH),
        special_tokens={EOT_TEXT: EOT},
        explicit_n_vocab=VOCAB_SIZE,
    )


def encode(text: str, *, allow_special: bool = False) -> list[int]:
    """Token ids of `text`.

    By default "<|endoftext|>" inside `text` is encoded as ordinary text (never an
    error: prompts and corpora may contain it literally). With
    allow_special=True it becomes the EOT token 50256.
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected str, got {type(text).__name__}")
    enc = get_tokenizer()
    if allow_special:
        return enc.encode(text, allowed_special="all")
    return enc.encode_ordinary(text)


def encode_batch(texts: list[str], *, allow_special: bool = False) -> list[list[int]]:
    """encode() over many strings at once (tiktoken spreads the work over threads)."""
    enc = get_tokenizer()
    if allow_special:
        return enc.encode_batch(list(texts), allowed_special="all")
    return enc.encode_ordinary_batch(list(texts))


def decode(ids) -> str:
    """Text of token ids (a list, NumPy or CuPy array of ints).

    Byte sequences that are not valid UTF-8 (a sample cut in the middle of a
    multi-byte character) become U+FFFD instead of raising.
    """
    if runtime.is_gpu_array(ids):
        ids = ids.get()
    arr = np.asarray(ids)
    if arr.ndim != 1 and arr.size:
        raise ValueError(f"ids: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"ids: expected integer token ids, got dtype {arr.dtype}")
    flat = [int(i) for i in arr.reshape(-1)]
    bad = [i for i in flat if not 0 <= i < VOCAB_SIZE]
    if bad:
        raise ValueError(f"ids: token id {bad[0]} is outside the GPT-2 vocabulary [0, {VOCAB_SIZE})")
    return get_tokenizer().decode(flat, errors="replace")
