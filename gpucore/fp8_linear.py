"""The GPT-2 model's linear layers in FP8 (`--dtype fp8`): scaling slots, FP8 scratch, the calls.

Each layer has four linears (qkv, attproj, fc, fcproj), each three scaled tensors: its input x and
weight W in E4M3, its output gradient in E5M2 (Fp8Scaling slots 12 l + 3 j + {0, 1, 2}). Everything
else -- parameters, activations, attention, layernorm, the LM head, the loss, master weights, AdamW
-- stays as in the bf16 mode.

    forward   x8, x8T = q(x), W8 = q(W);       out = x8 @ W8^T (+ bias)
              (fcproj's x = GELU(fch): q(GELU(fch)) in one pass; the fc GEMM writes only fch)
    backward  g8, g8T = q(dout), W8T = q(W)^T     (the FP8 GEMM wants K-contiguous operands)
              dx = g8 @ W8T^T                  (N, K)
              dW += g8T @ x8T^T                (M, K)

The LM head (settings.fp8_lm_head, on by default: three seeds measured its quality within bf16's
own seed-to-seed spread, tools/notes/fp8.md) runs in FP8
too: logits = lnf8 @ wte8^T per chunk (E4M3, fast accumulation), and the backward's
dlnf = dlogits8 @ wte8T^T, where the fused classifier writes dlogits8 (E5M2, a fixed power-of-two
scale: |dlogits| <= grad_scale). With settings.fp8_lm_head_dwte (on by default) dwte is an FP8
GEMM too: dwte += dlogits8T @ lnf8T^T, both operands turned token-contiguous per chunk by
fp8_transpose into the logits chunk (dead once the classifier has read it, which then writes no bf16
dlogits at all); otherwise the classifier also writes the bf16 dlogits and dwte is a bf16 GEMM. Its
three scaled tensors are slots 12 L + {0, 1, 2}. With the E5M2-only dlogits, settings.fp8_lm_head_sparse
(on) has the classifier thin them without bias below that probability (sparse_tau; the seed is
GPT2.head_seed): ~97% zeros, which the head's two backward GEMMs multiply at a higher clock.

fch, the fc GEMM's output and GELU's input, which the model keeps per layer for the backward: with
adaptive scaling and settings.fp8_fch_e4m3 (on by default) the fc GEMM writes it as E4M3 bytes (cuBLASLt's FP8
D, times a scale of its own) instead of bf16, and the GELU cast before fcproj and the GELU backward
read those bytes back as bf16(e4m3 * scale_inv) (their _x8 kernels): 1 byte a value instead of 2,
written once and read twice (~0.6 GB a d12 B=64 layer). Its scale cannot be checked and redone as
adaptive scaling redoes a cast (the GEMM would have to run again), so it is delayed (Transformer
Engine's recipe): the max of the last fp8_history steps' amax (cuBLASLt's amax of D, the last
micro-batch's), 2^-fp8_fch_margin (4) below E4M3's largest value. A value beyond the range would
saturate for a step (nothing re-runs the GEMM), so fch gets 16x headroom, which costs E4M3 nothing
but range at the bottom (normal values down to amax / 1800). Only the GELU's input rounds to E4M3
here; the bf16 arithmetic after it is the bf16 path's. On by default since the 72nd session: x1.003-1.005 at
d12 and x1.011 at d48 for 2.5 / 5.1 GB less. With warmup, 18 seeds of 1,000 B=64 steps track bf16 as
closely as bf16 fch does. Without warmup (lr 3e-4 from step 1) d12 runs take one-step loss spikes near
steps 6-13 in every mode; over 36 seeds bf16 spiked in 9 (up to +5.8), E4M3 fch in 7 (up to +4.8),
bf16 fch in 2, and seed 1337 (the CLI's default) is one of E4M3 fch's (tools/notes/fp8.md, 52nd-54th,
71st and 72nd sessions). A resume keeps the checkpoint's choice whatever the
setting says now, and says so when they differ (train.fp8_resume_settings): a run saved with fch in
bf16 resumes bit for bit.

x8T is written by the forward's cast of x (one pass writes both orientations) and kept per layer
in the model's activations ("x8t", 1 byte per value), so the backward never reads x again. In
exchange the model keeps no bf16 copy of the layernorm outputs (they exist only as one scratch)
and no bf16 GELU outputs: FP8 training plans less activation memory than bf16. When the GELU
outputs would not be kept in bf16 (resolve_keep_gelu), fcproj's x8T is not kept either: the
backward remakes it from fch inside fc's fused GELU backward, which reads fch anyway (fcproj's
weight-gradient GEMM waits for it: DeferredWeightGrad), where the bf16 path has gelu_backward write
GELU(fch) beside dfch the same way.

Who writes the FP8 bytes: the layernorm before qkv and fc (layernorm_forward_fp8), the GELU
before fcproj (fp8_gelu_quantize, from fch) and the GELU backward before fc's gradient GEMMs
(fp8_gelu_backward) write them themselves, never their bf16 output; the attention forward writes
attproj's beside its bf16 output, which the backward needs (attention_forward(out8=), through
forward(make_x=)); the other gradients (the residual gradients, dqkv) and the weights go through a
standalone cast (gpucore/ops/fp8.py). A producer can write FP8 only when the scale is known
before it runs (adaptive or delayed scaling, Fp8Scaling.can_produce); with current scaling the
bf16 tensor is made, measured and cast. tools/notes/fp8.md has what each costs. The forward
GEMMs and the backward's dx GEMMs (settings.fp8_fast_accum_dgrad) use Hopper's fast FP8
accumulation, the weight gradients (K = tokens, summed over 8k-65k products) exact accumulation.
Transformer Engine keeps the dx GEMMs exact too; here the dx sums are short (K = C or 4C), and three
seeds of 1,000-step d12 runs showed no loss cost (tools/notes/fp8.md) for 1.5% of the step.
"""
from __future__ import annotations

import numpy as np

from . import compressible, settings
from .ops.classifier import dlogits_fp8_scale, sparse_tau_of
from .ops.fp8 import (Fp8Scaling, fp8_gelu_backward, fp8_gelu_backward_gated, fp8_gelu_quantize,
                      fp8_gelu_quantize_gated, fp8_matmul, fp8_requantize_gated, fp8_transpose)
from .ops.gelu import gelu, gelu_backward
from .ops.layernorm import fp8_forward_fits, layernorm_forward_fp8

QKV, ATTPROJ, FC, FCPROJ = range(4)
_X, _W, _G = range(3)


def fch_in_e4m3(fp8) -> bool:
    """Do FP8 linears with this scaling keep fch as E4M3 bytes (module docstring)? fp8: None or
    False (no FP8 linears), True (the default scaling: adaptive) or a scaling mode."""
    if not fp8:
        return False
    return (fp8 is True or fp8 == "adaptive") and settings.current().fp8_fch_e4m3


def linear_shapes(cfg):
    """(out_features, in_features) of the four linears of a layer."""
    C = cfg.channels
    return [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)]


# linear j's transposed FP8 input inside a layer's kept x8t bytes: (offset, rows) in units of C x N
_X8T_PLACE = {QKV: (0, 1), ATTPROJ: (1, 1), FC: (2, 1), FCPROJ: (3, 4)}


def kept_x8t_per_token(cfg, keep_fcproj: bool) -> int:
    """Bytes per token of one layer's kept x8T: qkv, attproj, fc inputs (C each) [+ fcproj's 4C]."""
    return cfg.channels * (7 if keep_fcproj else 3)


def kept_x8t(layer_bytes, j: int, N: int, C: int):
    """(K, N) uint8 view of linear j's kept x8T in one layer's flat x8t bytes (N tokens)."""
    off, rows = _X8T_PLACE[j]
    return layer_bytes[off * C * N:(off + rows) * C * N].reshape(rows * C, N)


def _scratch_sizes(cfg, N: int):
    """Bytes of x8, x8T (a not-kept x8T), g8, g8T (the widest tensor, N x 4C) and W8, W8T (the
    largest weight)."""
    C = cfg.channels
    return [N * 4 * C] * 4 + [4 * C * C] * 2


def _head_sizes(cfg, N: int):
    """Bytes of the FP8 LM head's scratch: lnf8 (N x C), wte8 and wte8T (Vp x C each), dlogits8
    (one logits chunk of rows x Vp)."""
    from .model import head_chunk_rows
    C, Vp = cfg.channels, cfg.padded_vocab_size
    return [N * C, Vp * C, Vp * C, head_chunk_rows(cfg, N, "bfloat16") * Vp]


def scratch_bytes(cfg, B: int, T: int, lm_head: bool = False) -> int:
    """Bytes of FP8 scratch the model must allocate: the linears' none when it fits in the LM
    head's logits chunk, which is idle while the layers run (their forward finishes before the
    LM head starts, and the layers' backward starts after it), else all of it; with lm_head, the
    FP8 LM head's (it runs while the logits chunk is in use)."""
    from .model import head_chunk_rows
    need = sum(_scratch_sizes(cfg, B * T))
    logits = head_chunk_rows(cfg, B * T, "bfloat16") * cfg.padded_vocab_size * 2
    return (0 if need <= logits else need) + (sum(_head_sizes(cfg, B * T)) if lm_head else 0)


class DeferredWeightGrad:
    """A linear's weight-gradient GEMM held back until its transposed FP8 input exists: fcproj's,
    when the forward kept no GELU(fch) and fc's GELU backward remakes it in its own pass (the pass
    reads fch anyway; a cast of its own read it once more). x8t (K, N) is where those bytes go,
    with x_scale (the forward's); run() then does dweight += g8t @ x8t^T."""

    def __init__(self, g8t, x8t, gelu_of, x_scale, g_scale_inv, x_scale_inv, dweight):
        self.g8t, self.x8t, self.gelu_of, self.x_scale = g8t, x8t, gelu_of, x_scale
        self._inv = (g_scale_inv, x_scale_inv)
        self.dweight = dweight

    def run(self):
        fp8_matmul(self.g8t, self.x8t, "e5m2", "e4m3", *self._inv, out=self.dweight, accumulate=True)


class Fp8Linears:
    """FP8 state and scratch for a model's linears; `forward` / `backward` replace matmul_forward /
    matmul_backward for them. `end_step()` after each optimizer step turns this step's amax into
    the next step's scales."""

    def __init__(self, cfg, xp, *, mode: str = "delayed", history: int | None = None, margin: int | None = None,
                 lm_head: bool | None = None):
        s = settings.current()
        self.cfg, self.xp = cfg, xp
        L = cfg.num_layers
        self.lm_head = s.fp8_lm_head if lm_head is None else bool(lm_head)
        n = 12 * L + (3 if self.lm_head else 0)      # the LM head's x, W, dlogits after the layers'
        self.scaling = Fp8Scaling(n, ["e4m3", "e4m3", "e5m2"] * (n // 3), xp, mode=mode,
                                  history=s.fp8_history if history is None else history,
                                  margin=s.fp8_margin if margin is None else margin, window=s.fp8_window)
        # fch as E4M3 (fch_in_e4m3): a delayed scale per layer, apart from the adaptive slots (its
        # GEMM cannot be re-run on the device when the scale was off)
        self.fch8 = fch_in_e4m3(mode)
        self.fch_scaling = (Fp8Scaling(L, ["e4m3"] * L, xp, mode="delayed",
                                       history=s.fp8_history if history is None else history,
                                       margin=s.fp8_fch_margin) if self.fch8 else None)
        self.weights_current = s.fp8_weights_current
        self.predict_scales = mode == "adaptive" and s.fp8_predict_scales
        self.head_dwte = self.lm_head and s.fp8_lm_head_dwte
        self.fast_dgrad = s.fp8_fast_accum_dgrad
        if not s.fp8_lm_head_sparse >= 0:
            raise ValueError(f"fp8_lm_head_sparse: expected a probability >= 0, got {s.fp8_lm_head_sparse!r}")
        # The sparsified E5M2 dlogits need the E5M2-only classifier, i.e. dwte from them too.
        self.head_sparse = float(s.fp8_lm_head_sparse) if self.head_dwte else 0.0
        self.head_sparse_tau = 0.0      # on the scaled dlogits; set by head_begin (the seed: GPT2.head_seed)
        self._scratch = None
        self._n = None
        self._arena = None
        self._head = None               # (N, [lnf8, wte8, wte8T, dlogits8 flat uint8]) of the FP8 LM head

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

    def buffers(self) -> tuple:
        """The FP8 scratch arrays allocated so far (the linears', the LM head's): what a CUDA graph
        of the step must keep alive (GPT2.step_buffers)."""
        return tuple(self._scratch or ()) + tuple(self._head[1] if self._head else ())

    def _slot(self, l, j, t):
        return 12 * l + 3 * j + t

    def _predicted_by(self, l, j) -> tuple:
        """The output-gradient slots whose scales linear j's gradient cast predicts (adaptive
        scaling, settings.fp8_predict_scales): the backward casts the residual stream's gradients in
        the order fcproj, [fc], attproj, [qkv], the layer below's fcproj, and each moves with the one
        before it from step to step far more than with its own last step's amax (tools/notes/fp8.md,
        68th section). qkv's is measured by the attention backward, so it needs no prediction."""
        if not self.predict_scales:
            return ()
        if j == FCPROJ:
            return (self._slot(l, FC, _G), self._slot(l, ATTPROJ, _G))
        if j == ATTPROJ and l > 0:
            return (self._slot(l - 1, FCPROJ, _G),)
        return ()

    def _fch_scale_inv(self, l, fch):
        """Layer l's fch scale_inv when fch (N, 4C) is its E4M3 bytes, else None (bf16 fch)."""
        return self.fch_scaling.tensor(l)[1] if fch is not None and fch.dtype == np.uint8 else None

    def forward(self, l, j, x2d, weight, bias, out2d, gelu_out2d=None, x8t=None, ln=None, gelu_of=None,
                make_x=None, residual=None):
        """out2d (N, M) = x2d (N, K) @ weight (M, K)^T + bias [+ residual (N, M), added in the GEMM's
        epilogue] in FP8; gelu_out2d: also its GELU.
        x8t (K, N) uint8, optional: the same cast pass also writes x's transposed FP8 copy there,
        which the backward's weight gradient then reads instead of casting x again.
        ln (ops.layernorm.LayerNormCall), instead of x2d: x is that layernorm's output; when the
        scaling allows, the layernorm kernel writes x's FP8 bytes itself (its bf16 output is never
        written), else it runs in bf16 and x is cast.
        gelu_of (N, K), optional: x is GELU(gelu_of) (fcproj's input, x2d its bf16 scratch): when
        the scaling allows, one pass casts GELU(gelu_of) (fp8_gelu_quantize) and x2d is never
        written, else GELU runs into x2d and x is cast.
        make_x(out8, out8_t, scale, amax), optional: runs the op that makes x2d (bf16, still written:
        the attention forward); when the scaling allows, that op writes x's FP8 bytes itself too
        (out8, out8_t with scale, amax into amax), and the gated re-cast reads x2d; else it is
        called as make_x(None, None, None, None) and x is cast."""
        N, M, K = out2d.shape[0], weight.shape[0], weight.shape[1]
        x8b, _, _, _, w8b, _ = self._buffers(N)
        x8, w8 = x8b[: N * K].reshape(N, K), w8b[: M * K].reshape(M, K)
        sc, ix, iw = self.scaling, self._slot(l, j, _X), self._slot(l, j, _W)
        if ln is not None and sc.can_produce(ix) and fp8_forward_fits(K):
            again_x = ln.x if ln.b is None else ln.residual     # the re-run normalises what the first wrote
            sc.produce(ix, lambda s, am: layernorm_forward_fp8(
                           ln.x, ln.weight, ln.bias, s, b=ln.b, residual=ln.residual, out8=x8, out8_t=x8t,
                           amax=am, mean=ln.mean, rstd=ln.rstd),
                       lambda s, gate: layernorm_forward_fp8(
                           again_x, ln.weight, ln.bias, s, out8=x8, out8_t=x8t, mean=ln.mean, rstd=ln.rstd,
                           gate=gate))
        elif gelu_of is not None and sc.can_produce(ix):
            fsi = self._fch_scale_inv(l, gelu_of)
            sc.produce(ix, lambda s, am: fp8_gelu_quantize(gelu_of, s, out=x8, out_t=x8t, amax=am, x_scale_inv=fsi),
                       lambda s, gate: fp8_gelu_quantize_gated(gelu_of, s, gate, out=x8, out_t=x8t, x_scale_inv=fsi))
        elif make_x is not None and sc.can_produce(ix):
            sc.produce(ix, lambda s, am: make_x(x8, x8t, s, am),
                       lambda s, gate: fp8_requantize_gated(x2d, "e4m3", s, gate, out=x8, out_t=x8t))
        else:
            if gelu_of is not None and gelu_of.dtype == np.uint8:
                raise RuntimeError("fch in E4M3 needs adaptive scaling (fch_in_e4m3)")
            if make_x is not None:
                make_x(None, None, None, None)
            if ln is not None:
                x2d = ln.run().reshape(N, K)
            elif gelu_of is not None:
                gelu(gelu_of, out=x2d)
            sc.cast(ix, x2d, out=x8, out_t=x8t)
        sc.cast(iw, weight, out=w8, current=self.weights_current)
        fs = famax = None
        if out2d.dtype == np.uint8:     # fch kept as E4M3: cuBLASLt writes the bytes with fch's delayed scale
            fs, _, famax = self.fch_scaling.tensor(l)
        fp8_matmul(x8, w8, "e4m3", "e4m3", sc.tensor(ix)[1], sc.tensor(iw)[1], out=out2d, bias=bias,
                   fast_accum=True, gelu_out=gelu_out2d, residual=residual, out_scale=fs, out_amax=famax)
        return out2d

    def dout_amax(self, l, j):
        """Where the op that writes linear j's output gradient (layer l) may fold its max |dout|,
        for backward(dout_measured=True): Fp8Scaling.measured_amax; None unless adaptive."""
        return self.scaling.measured_amax(self._slot(l, j, _G))

    def backward(self, l, j, dout2d, x2d, weight, dx2d, dweight, dbias=None, x8t=None, gelu_x2d=None,
                 gelu_of=None, defer_dweight=False, then=None, dout_measured=False):
        """dx2d (N, K) = dout2d @ weight [=]; dweight (M, K) += dout2d^T @ x [+=]; dbias (M,) += dout2d's
        column sums (of the bf16 values, as matmul_backward's), summed by the pass that casts dout2d
        (fp8_quantize(dbias=): no pass of its own) or by the fused GELU backward. x: its transposed
        FP8 copy x8t (K, N) from the forward, or (x8t None) x2d (N, K) bf16, cast here with the
        forward's scale.
        gelu_of (N, K), optional, with x8t None: x is GELU(gelu_of) (fcproj), and its bytes are made
        by the next linear's GELU backward, which reads gelu_of anyway: needs defer_dweight=True; only
        dx2d is made here, and the returned DeferredWeightGrad goes to that backward as `then`
        (fc's), which makes x's bytes and then runs this dweight GEMM (x2d is not read). Returns None
        otherwise (defer_dweight with a kept x8t defers nothing).
        gelu_x2d (N, M), optional: dout2d is the gradient of GELU(gelu_x2d) (the fc layer), and the
        output gradient is gelu_backward(dout2d, gelu_x2d): when the scaling allows, its FP8 bytes
        and bias sums come from one fused kernel and the bf16 gradient is never written; else
        gelu_backward runs first, into dout2d (as the bf16 path does).
        then (DeferredWeightGrad of the linear after this one, fcproj's; needs gelu_x2d): made
        right after this layer's GELU backward, before this layer's own GEMMs.
        dout_measured: dout2d's producer folded its max |dout2d| into dout_amax(l, j) (qkv's: the
        attention backward), so its cast runs once with the right scale (Fp8Scaling.cast)."""
        N, M = dout2d.shape
        K = weight.shape[1]
        x8b, xtb, gb, gtb, _, wtb = self._buffers(N)
        deferred = x8t is None and gelu_of is not None
        if deferred and not defer_dweight:
            raise ValueError("gelu_of without a kept x8t: x is remade by the next GELU backward; "
                             "pass defer_dweight=True and hand the result to it as `then`")
        if then is not None and gelu_x2d is None:
            raise ValueError("then: a deferred weight gradient needs the GELU backward (gelu_x2d) that remakes its input")
        if dout_measured and gelu_x2d is not None:    # the slot would stay filled for the next cast's guard
            raise ValueError("dout_measured: not with gelu_x2d (dout is the GELU backward's input, not what is cast)")
        # A deferred dweight GEMM keeps its g8T past the next linear's backward, which writes the g8 /
        # g8T scratch itself: it goes into the x8 scratch instead (the forward's only, idle here).
        g8, g8t = gb[: N * M].reshape(N, M), (x8b if deferred else gtb)[: N * M].reshape(M, N)
        w8t = wtb[: M * K].reshape(K, M)
        sc, ix, iw, ig = self.scaling, self._slot(l, j, _X), self._slot(l, j, _W), self._slot(l, j, _G)
        remade_by_kernel = False
        if gelu_x2d is not None and sc.can_produce(ig):
            db = dbias
            gt, gs = (then.x8t, then.x_scale) if then is not None else (None, None)
            fsi = self._fch_scale_inv(l, gelu_x2d)
            # the gated re-run (a gradient scale that had to change) leaves gelu_t alone: its bytes
            # are made with the forward's scale, right the first time
            sc.produce(ig, lambda s, am: fp8_gelu_backward(dout2d, gelu_x2d, s, out=g8, out_t=g8t, amax=am, dbias=db,
                                                           gelu_t=gt, gelu_scale=gs, x_scale_inv=fsi),
                       lambda s, gate: fp8_gelu_backward_gated(dout2d, gelu_x2d, s, gate, out=g8, out_t=g8t,
                                                               x_scale_inv=fsi))
            dbias = None
            remade_by_kernel = then is not None
        else:
            if gelu_x2d is not None and gelu_x2d.dtype == np.uint8:
                raise RuntimeError("fch in E4M3 needs adaptive scaling (fch_in_e4m3)")
            if gelu_x2d is not None:
                gelu_backward(dout2d, gelu_x2d, dx=dout2d, dbias=dbias)
                dbias = None
            sc.cast(ig, dout2d, out=g8, out_t=g8t, dbias=dbias,    # the bias gradient from the cast's pass
                    measured=dout_measured, predict=self._predicted_by(l, j))
            dbias = None
        if then is not None:
            if not remade_by_kernel:
                fp8_gelu_quantize(then.gelu_of, then.x_scale, out_t=then.x8t,
                                  x_scale_inv=self._fch_scale_inv(l, then.gelu_of))
            then.run()
        sc.cast(iw, weight, out_t=w8t, record=False)    # the forward's scale
        if x8t is None:
            x8t = xtb[: N * K].reshape(K, N)
            if not deferred:            # (deferred: made by the next backward's GELU pass, then.x8t)
                sc.cast(ix, x2d, out_t=x8t, record=False)
        sg, sw, sx = sc.tensor(ig)[1], sc.tensor(iw)[1], sc.tensor(ix)[1]
        fp8_matmul(g8, w8t, "e5m2", "e4m3", sg, sw, out=dx2d, fast_accum=self.fast_dgrad)
        if deferred:
            return DeferredWeightGrad(g8t, x8t, gelu_of, sc.tensor(ix)[0], sg, sx, dweight)
        fp8_matmul(g8t, x8t, "e5m2", "e4m3", sg, sx, out=dweight, accumulate=True)
        return None

    # --------------------------------------------------------------- LM head

    def _head_slots(self):
        """The LM head's scaling slots (x, W, dlogits), after the layers' 12 L."""
        return tuple(12 * self.cfg.num_layers + k for k in range(3))

    def _head_buffers(self, N):
        """[lnf8, wte8, wte8T, dlogits8] flat uint8; the thinned dlogits8 (~97% zero bytes) in
        compressible memory where the GPU grants it (settings.compressible_dlogits)."""
        if self._head is None or self._head[0] != N:
            sizes = _head_sizes(self.cfg, N)
            bufs = [self.xp.empty(n, np.uint8) for n in sizes[:3]]
            if self.xp is not np and self.head_sparse > 0 and settings.current().compressible_dlogits:
                bufs.append(compressible.empty(sizes[3], np.uint8))
            else:
                bufs.append(self.xp.empty(sizes[3], np.uint8))
            self._head = (N, bufs)
        return self._head[1]

    def head_begin(self, lnf, wte, backward: bool, grad_scale: float | None = None):
        """Before the LM head's chunks: lnf (N, C) and wte (Vp, C) cast to E4M3 (wte also transposed
        when the backward follows, and the fixed dlogits scale set). Returns the dlogits8 scale."""
        N, C = lnf.shape
        Vp = wte.shape[0]
        x8, w8, w8t, _ = self._head_buffers(N)
        sc = self.scaling
        hx, hw, hg = self._head_slots()
        sc.cast(hx, lnf, out=x8[: N * C].reshape(N, C))
        sc.cast(hw, wte, out=w8[: Vp * C].reshape(Vp, C), out_t=w8t[: Vp * C].reshape(C, Vp) if backward else None,
                current=self.weights_current)
        if not backward:
            return None
        s = dlogits_fp8_scale(grad_scale)
        sg, sg_inv, _ = sc.tensor(hg)
        sg.fill(np.float32(s))
        sg_inv.fill(np.float32(1.0 / s))
        self.head_sparse_tau = sparse_tau_of(self.head_sparse, grad_scale, s)
        return s

    def head_logits(self, r0, r1, out):
        """out (r1 - r0, Vp) = lnf8[r0:r1] @ wte8^T, dequantized (bf16)."""
        C, Vp = self.cfg.channels, out.shape[1]
        N = self._head[0]
        x8, w8 = self._head[1][0][: N * C].reshape(N, C), self._head[1][1][: Vp * C].reshape(Vp, C)
        hx, hw, _ = self._head_slots()
        fp8_matmul(x8[r0:r1], w8, "e4m3", "e4m3", self.scaling.tensor(hx)[1], self.scaling.tensor(hw)[1],
                   out=out, fast_accum=True)
        return out

    def head_dlogits8(self, rows, Vp):
        """The (rows, Vp) uint8 view the fused classifier writes dlogits' E5M2 bytes to."""
        return self._head[1][3][: rows * Vp].reshape(rows, Vp)

    def head_dx(self, dlogits8, out):
        """out (rows, C) = dlogits8 @ wte8T^T, dequantized: the LM head's dlnf for one chunk [=]."""
        C, Vp = out.shape[1], dlogits8.shape[1]
        w8t = self._head[1][2][: Vp * C].reshape(C, Vp)
        _, hw, hg = self._head_slots()
        fp8_matmul(dlogits8, w8t, "e5m2", "e4m3", self.scaling.tensor(hg)[1], self.scaling.tensor(hw)[1], out=out)
        return out

    def head_dwte_into(self, dlogits8, r0, scratch, dweight):
        """dweight (Vp, C) += dlogits^T @ lnf[r0:r0 + rows] in FP8 (E5M2 x E4M3, exact accumulation):
        the FP8 GEMM wants both operands token-contiguous, so dlogits8 (rows, Vp) and the chunk's
        lnf8 rows (rows, C) are first transposed into `scratch` (any array of >= rows (Vp + C) bytes:
        the logits chunk, which nothing reads once the classifier has)."""
        rows, Vp = dlogits8.shape
        N, C = self._head[0], self.cfg.channels
        flat = scratch.reshape(-1).view(np.uint8)
        if flat.size < rows * (Vp + C):
            raise ValueError(f"scratch: {flat.size} bytes, the transposes need {rows * (Vp + C)}")
        d8t = fp8_transpose(dlogits8, out=flat[: Vp * rows].reshape(Vp, rows))
        x8 = self._head[1][0][: N * C].reshape(N, C)
        x8t = fp8_transpose(x8[r0:r0 + rows], out=flat[Vp * rows: (Vp + C) * rows].reshape(C, rows))
        hx, _, hg = self._head_slots()
        fp8_matmul(d8t, x8t, "e5m2", "e4m3", self.scaling.tensor(hg)[1], self.scaling.tensor(hx)[1],
                   out=dweight, accumulate=True)
        return dweight

    def end_step(self):
        self.scaling.end_step()
        if self.fch_scaling is not None:
            self.fch_scaling.end_step()
