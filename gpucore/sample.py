"""Text generation from a GPT-2 with a KV cache: each new token costs O(T), not O(T^2).

The model's training forward pass recomputes attention over the whole
sequence; generating n tokens that way costs O(n^2 T) work. Here every layer
keeps the keys and values of the tokens seen so far (the KV cache) and one
decoding step runs the model on ONE token:

- embedding, layernorms, the qkv / projection / MLP matmuls, GELU and the
  residual adds are the same gpucore ops as training (kernels on the GPU,
  NumPy references on the CPU), on (1, C)-shaped arrays;
- the single-query attention step (q against the cached K, softmax, times the
  cached V) uses plain xp (numpy/cupy) operations in float32: it is a
  (NH, t, hd) x (NH, hd) product, too small for a dedicated kernel to matter.

The prompt is fed through the same single-token step (prefill one token at a
time), so there is one code path, checked against the full forward pass in
tests/test_model.py. Sampling (temperature, top-k) runs on the host with a
NumPy Generator, so a seed gives the same text on every backend up to the
logits' rounding.
"""
from __future__ import annotations

import math

import numpy as np

from .ops.add import add
from .ops.cast import astype
from .ops.gelu import gelu
from .ops.layernorm import layernorm_forward
from .ops.matmul import matmul_forward


class KVCache:
    """Per layer: keys and values (NH, max_seq_len, hd) in float32, filled up to `length`."""

    def __init__(self, model):
        cfg, xp = model.config, model.xp
        shape = (cfg.num_layers, cfg.num_heads, cfg.max_seq_len, cfg.head_size)
        self.k = xp.zeros(shape, dtype=np.float32)
        self.v = xp.zeros(shape, dtype=np.float32)
        self.length = 0


def decode_step(model, cache: KVCache, token: int):
    """Logits (Vp,) float32 on the model's device for `token` at position cache.length; appends its K/V."""
    cfg, xp, p = model.config, model.xp, model.params
    C, NH, hd = cfg.channels, cfg.num_heads, cfg.head_size
    pos = cache.length
    if pos >= cfg.max_seq_len:
        raise ValueError(f"decode_step: the KV cache is full ({cfg.max_seq_len} positions)")
    if not 0 <= token < cfg.vocab_size:
        raise ValueError(f"token: {token} is outside the vocabulary [0, {cfg.vocab_size})")
    scale = 1.0 / math.sqrt(hd)
    x = add(p.wte[token:token + 1], p.wpe[pos:pos + 1])                        # (1, C)
    for l in range(cfg.num_layers):
        h, _, _ = layernorm_forward(x, p.ln1w[l], p.ln1b[l])
        qkv = astype(matmul_forward(h, p.qkvw[l], p.qkvb[l]), np.float32)      # (1, 3C)
        q = qkv[0, :C].reshape(NH, hd)
        cache.k[l, :, pos] = qkv[0, C:2 * C].reshape(NH, hd)
        cache.v[l, :, pos] = qkv[0, 2 * C:].reshape(NH, hd)
        keys, values = cache.k[l, :, :pos + 1], cache.v[l, :, :pos + 1]      # (NH, t, hd)
        scores = xp.matmul(keys, q[:, :, None])[:, :, 0] * np.float32(scale)  # (NH, t)
        w = xp.exp(scores - scores.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        y = xp.matmul(w[:, None, :], values)[:, 0, :].reshape(1, C)           # (1, C) fp32
        y = astype(xp.ascontiguousarray(y), model.dtype)
        x = add(x, matmul_forward(y, p.attprojw[l], p.attprojb[l]))
        h, _, _ = layernorm_forward(x, p.ln2w[l], p.ln2b[l])
        h = gelu(matmul_forward(h, p.fcw[l], p.fcb[l]))
        x = add(x, matmul_forward(h, p.fcprojw[l], p.fcprojb[l]))
    h, _, _ = layernorm_forward(x, p.lnfw, p.lnfb)
    cache.length = pos + 1
    return astype(matmul_forward(h, p.wte, None), np.float32)[0]             # (Vp,)


def sample_token(logits: np.ndarray, temperature: float = 1.0, top_k: int | None = None,
                 rng: np.random.Generator | None = None) -> int:
    """One token id from logits (V,): greedy when temperature <= 0, else softmax(logits/temperature)
    restricted to the top_k largest (top_k None or 0: all)."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))
    logits = logits / temperature
    if top_k and top_k < logits.size:
        kth = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - logits.max())
    cdf = np.cumsum(probs)
    rng = rng if rng is not None else np.random.default_rng()
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), logits.size - 1))


def generate(model, prompt, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
             rng: np.random.Generator | None = None, stop_token: int | None = None) -> list[int]:
    """New token ids continuing `prompt` (a list of ids; empty -> the EOT token if the vocab has it).

    At most max_seq_len positions fit the cache: a longer prompt keeps its last tokens, and
    generation stops when the cache is full or at stop_token.
    """
    cfg = model.config
    prompt = [int(t) for t in prompt] or [min(50256, cfg.vocab_size - 1)]
    prompt = prompt[-(cfg.max_seq_len - 1):] if cfg.max_seq_len > 1 else prompt[-1:]
    cache = KVCache(model)
    for tok in prompt:
        logits = decode_step(model, cache, tok)
    out = []
    for _ in range(max(0, int(max_new_tokens))):
        host = logits[: cfg.vocab_size].get() if hasattr(logits, "get") else logits[: cfg.vocab_size]
        tok = sample_token(host, temperature, top_k, rng)
        out.append(tok)
        if tok == stop_token or cache.length >= cfg.max_seq_len:
            break
        logits = decode_step(model, cache, tok)
    return out
