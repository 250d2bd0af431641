"""The GPT-2 model's linear layers in FP8 (`--dtype fp8`): scaling slots, FP8 scratch, the calls.

Each layer has four linears (qkv, attproj, fc, fcproj), each three scaled tensors: its input x and
weight W in E4M3, its output gradient in E5M2 (Fp8Scaling slots 12 l + 3 j + {0, 1, 2}). Everything
else -- parameters, activations, attention, layernorm, the LM head, the loss, master weights, AdamW
-- stays as in the bf16 mode.

    forward   x8 = q(x), W8 = q(W);            out = x8 @ W8^T (+ bias) [GELU epilogue for fc]
    backward  g8, g8T = q(dout), W8T = q(W)^T, x8T = q(x)^T   (the FP8 GEMM wants K-contiguous operands)
              dx = g8 @ W8T^T                  (N, K)
              dW += g8T @ x8T^T                (M, K)

The casts are standalone passes (gpucore/ops/fp8.py); tools/notes/fp8.md measures what they cost
and which producer kernels should write the FP8 bytes instead. The forward GEMMs use Hopper's fast
FP8 accumulation, the backward ones exact accumulation (Transformer Engine's choice).
"""
from __future__ import annotations

import numpy as np

from . import settings
from .ops.colsum import colsum
from .ops.fp8 import Fp8Scaling, fp8_matmul, fp8_quantize

QKV, ATTPROJ, FC, FCPROJ = range(4)
_X, _W, _G = range(3)


def linear_shapes(cfg):
    """(out_features, in_features) of the four linears of a layer."""
    C = cfg.channels
    return [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)]


def _scratch_sizes(cfg, N: int):
    """Bytes of x8, x8T, g8, g8T (the widest tensor, N x 4C) and W8, W8T (the largest weight)."""
    C = cfg.channels
    return [N * 4 * C] * 4 + [4 * C * C] * 2


def scratch_bytes(cfg, B: int, T: int) -> int:
    """Bytes of FP8 scratch the model must allocate: none when it fits in the LM head's logits
    chunk, which is idle while the layers run (their forward finishes before the LM head starts,
    and the layers' backward starts after it), else all of it."""
    from .model import head_chunk_rows
    need = sum(_scratch_sizes(cfg, B * T))
    logits = head_chunk_rows(cfg, B * T, "bfloat16") * cfg.padded_vocab_size * 2
    return 0 if need <= logits else need


class Fp8Linears:
    """FP8 state and scratch for a model's linears; `forward` / `backward` replace matmul_forward /
    matmul_backward for them. `end_step()` after each optimizer step turns this step's amax into
    the next step's scales."""

    def __init__(self, cfg, xp, *, mode: str = "delayed", history: int | None = None, margin: int | None = None):
        s = settings.current()
        self.cfg, self.xp = cfg, xp
        L = cfg.num_layers
        self.scaling = Fp8Scaling(12 * L, ["e4m3", "e4m3", "e5m2"] * (4 * L), xp, mode=mode,
                                  history=s.fp8_history if history is None else history,
                                  margin=s.fp8_margin if margin is None else margin)
        self.weights_current = s.fp8_weights_current
        self._scratch = None
        self._n = None
        self._arena = None

    def bind_arena(self, arena):
        """Carve the FP8 scratch out of `arena` (a flat uint8 view of the LM-head logits chunk) when
        it is large enough; the next _buffers() call re-carves."""
        self._arena = arena
        self._n = None

    def _buffers(self, N):
        """uint8 views x8, x8T, g8, g8T, w8, w8T (flat): slices of the arena when it holds them all,
        else allocated (once per row count N). Every size is a multiple of 16 bytes (N % 16 == 0,
        C % 8 == 0), so every slice starts 16-byte aligned."""
        if self._n != N:
            sizes = _scratch_sizes(self.cfg, N)
            if self._arena is not None and self._arena.size >= sum(sizes):
                offs = np.cumsum([0] + sizes)
                self._scratch = [self._arena[o:o + n] for o, n in zip(offs, sizes)]
            else:
                self._scratch = [self.xp.empty(n, np.uint8) for n in sizes]
            self._n = N
        return self._scratch

    def _slot(self, l, j, t):
        return 12 * l + 3 * j + t

    def _quantize(self, l, j, t, x2d, *, out=None, out_t=None, record=True):
        i = self._slot(l, j, t)
        if record:   # weights: their own amax each step (small tensors: a cheap pass), unless told otherwise
            self.scaling.prepare(i, x2d, current=t == _W and self.weights_current)
        scale, _, amax = self.scaling.tensor(i)
        fmt = "e5m2" if t == _G else "e4m3"
        fp8_quantize(x2d, fmt, scale, out=out, out_t=out_t, amax=amax if record else None)

    def forward(self, l, j, x2d, weight, bias, out2d, gelu_out2d=None):
        """out2d (N, M) = x2d (N, K) @ weight (M, K)^T + bias in FP8; gelu_out2d: also its GELU."""
        N, K = x2d.shape
        M = weight.shape[0]
        x8b, _, _, _, w8b, _ = self._buffers(N)
        x8, w8 = x8b[: N * K].reshape(N, K), w8b[: M * K].reshape(M, K)
        self._quantize(l, j, _X, x2d, out=x8)
        self._quantize(l, j, _W, weight, out=w8)
        sx, sw = self.scaling.tensor(self._slot(l, j, _X))[1], self.scaling.tensor(self._slot(l, j, _W))[1]
        fp8_matmul(x8, w8, "e4m3", "e4m3", sx, sw, out=out2d, bias=bias, fast_accum=True, gelu_out=gelu_out2d)
        return out2d

    def backward(self, l, j, dout2d, x2d, weight, dx2d, dweight, dbias=None):
        """dx2d (N, K) = dout2d @ weight [=]; dweight (M, K) += dout2d^T @ x2d; dbias (M,) += dout2d's
        column sums (bf16, from dout2d itself: the same rule as matmul_backward)."""
        N, K = x2d.shape
        M = weight.shape[0]
        _, xtb, gb, gtb, _, wtb = self._buffers(N)
        g8, g8t = gb[: N * M].reshape(N, M), gtb[: N * M].reshape(M, N)
        x8t, w8t = xtb[: N * K].reshape(K, N), wtb[: M * K].reshape(K, M)
        self._quantize(l, j, _G, dout2d, out=g8, out_t=g8t)
        self._quantize(l, j, _W, weight, out_t=w8t, record=False)    # the forward's scale
        self._quantize(l, j, _X, x2d, out_t=x8t, record=False)
        sg = self.scaling.tensor(self._slot(l, j, _G))[1]
        sw = self.scaling.tensor(self._slot(l, j, _W))[1]
        sx = self.scaling.tensor(self._slot(l, j, _X))[1]
        fp8_matmul(g8, w8t, "e5m2", "e4m3", sg, sw, out=dx2d)
        fp8_matmul(g8t, x8t, "e5m2", "e4m3", sg, sx, out=dweight, accumulate=True)
        if dbias is not None:
            if self.xp is np:
                dbias[...] = (dbias.astype(np.float64) + dout2d.astype(np.float64).sum(axis=0)).astype(dbias.dtype)
            else:
                colsum(dbias, dout2d)

    def end_step(self):
        self.scaling.end_step()
