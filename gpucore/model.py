"""GPT-2: configuration, parameter/activation specs, forward and manual backward.

The structure is llm.c's (train_gpt2.cu: gpt2_forward / gpt2_backward), in
Python: the model is a flat list of op calls over named views into a few flat
buffers, the backward pass is the same calls in reverse. No tape, no graph.

Bookkeeping (gpucore/tensors.py): ordered (name, shape) specs are the single
source of truth. Parameters, gradients, fp32 master weights, AdamW m and v
share one parameter layout (so element i of every flat buffer is the same
scalar, and AdamW is one kernel over all of them); activations and the
backward pass's gradient scratch are two more flat buffers carved from specs
that depend on (B, T). Per-layer tensors are (L, ...) stacks; layer l is a
view `t.qkvw[l]`.

Backends: the same code runs with xp=numpy (every op calls its NumPy
reference) and xp=cupy (every op launches its CUDA kernel); ops dispatch on
the array type. dtype "float32" runs everything in fp32 (exact comparison with
the reference); "bfloat16" is llm.c-style mixed precision: bf16 parameters,
gradients and activations, fp32 layernorm statistics, attention log-sum-exp
and losses (the fp32 master weights and AdamW state live in gpucore.optim).

Memory (the reason for three choices below, as in llm.c):
- the GELU output is stored per layer only when it fits (keep_gelu, see
  resolve_keep_gelu: L x B x T x 4C values, 4.8 GB at d12 B=64): then the
  backward reads it; otherwise one (B, T, 4C) buffer is reused and the
  backward pass recomputes gelu(fch[l]) into it (llm.c's "recompute=1"),
  inside the GELU backward's pass (gelu_backward(gelu_out=)), which reads
  fch[l] anyway, with fcproj's weight gradient after it;
- the attention/MLP output projections add the residual stream in the GEMM's
  epilogue (cuBLASLt's C matrix) and write the next residual (residual2 /
  residual3) themselves: no projection output is stored, and each layernorm
  reads one stream (a fused residual + layernorm pass read two and wrote the
  sum: one pass more over the stream, tools/notes/profile.md);
- the LM head never materialises (B, T, Vp) logits in training: it runs in
  row chunks of at most ~1 GiB, and with for_backward=True each chunk's
  fused classifier turns the logits into dlogits in place and the chunk's
  matmul backward runs at once (dlnf rows, dwte +=). The rest of the backward
  pass starts from dlnf in backward().
With FP8 linears the layers' matmul inputs are kept as transposed FP8 copies
(activation "x8t"), and ln1 / ln2 / the GELU output are single scratch buffers
(gpucore/fp8_linear.py).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from . import compressible, dtypes, runtime, settings
from .ops.attention import attention_backward, attention_forward
from .ops.classifier import fused_classifier, sparse_tau_of
from .ops.encoder import encoder_backward, encoder_backward_plan, encoder_forward
from .ops.gelu import gelu_backward
from .ops.layernorm import LayerNormCall, layernorm_backward, layernorm_forward
from .ops.matmul import matmul_backward, matmul_forward
from .ops.reduce import reduce_sum as _sum
from .fp8_linear import ATTPROJ, FC, FCPROJ, QKV, Fp8Linears, fch_in_e4m3, kept_x8t
from .tensors import TensorLayout

GPT2_VOCAB = 50257
VOCAB_MULTIPLE = 128               # pad the vocabulary to 50304 = 393 * 128 (tensor-core friendly)
KEEP_GELU_DEVICE_FRACTION = 1 / 3  # keep_gelu=None keeps the GELU outputs while the plan stays under this

# name: (num_layers, num_heads, channels, max_seq_len, vocab_size, padded_vocab_size)
PRESETS = {
    "d12": dict(num_layers=12, num_heads=12, channels=768),     # GPT-2 124M
    "d24": dict(num_layers=24, num_heads=16, channels=1024),    # GPT-2 350M
    "d36": dict(num_layers=36, num_heads=20, channels=1280),    # GPT-2 774M
    "d48": dict(num_layers=48, num_heads=25, channels=1600),    # GPT-2 1558M
    # small presets for tests and the CPU backend; "tiny" keeps the real vocabulary
    "tiny": dict(num_layers=2, num_heads=4, channels=64, max_seq_len=64),
    "small": dict(num_layers=4, num_heads=4, channels=128, max_seq_len=128),
    # "micro" has a toy vocabulary (61, padded to 64): whole-model finite differences
    "micro": dict(num_layers=2, num_heads=2, channels=16, max_seq_len=16, vocab_size=61,
                  padded_vocab_size=64),
}


def head_draw_seed(step: int, micro_batch: int) -> int:
    """The seed of the thinned dlogits' draws (uint32) for an optimizer step's micro_batch-th
    micro-batch over all ranks: the step count itself for micro-batch 0 (so a one-GPU run without
    accumulation draws by its step alone), offset by a golden-ratio multiple for the others. Distinct
    for every (step, micro-batch) pair below 10^6 steps and 10^3 micro-batches a step: the nearest
    of k * 0x9E3779B9 mod 2^32 to 0 for k <= 1000 is 1.9e6 away."""
    return (int(step) + int(micro_batch) * 0x9E3779B9) & 0xFFFFFFFF


def pad_vocab(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class GPT2Config:
    num_layers: int = 12
    num_heads: int = 12
    channels: int = 768
    max_seq_len: int = 1024
    vocab_size: int = GPT2_VOCAB
    padded_vocab_size: int = 0       # 0: vocab_size rounded up to a multiple of 128

    def __post_init__(self):
        if self.padded_vocab_size == 0:
            object.__setattr__(self, "padded_vocab_size", pad_vocab(self.vocab_size))
        for k in ("num_layers", "num_heads", "channels", "max_seq_len", "vocab_size"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"{k}: must be >= 1, got {getattr(self, k)}")
        if self.channels % self.num_heads:
            raise ValueError(f"channels: {self.channels} is not divisible by num_heads={self.num_heads}")
        # Every tensor (and every per-layer slice) must start 16-byte aligned in bf16 AND fp32
        # buffers of the same layout, so element offsets agree: sizes are multiples of 8 elements.
        if self.channels % 8:
            raise ValueError(f"channels: must be a multiple of 8, got {self.channels}")
        if self.padded_vocab_size < self.vocab_size or self.padded_vocab_size % 8:
            raise ValueError(f"padded_vocab_size: must be >= vocab_size ({self.vocab_size}) and a "
                             f"multiple of 8, got {self.padded_vocab_size}")

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPT2Config":
        if name not in PRESETS:
            raise ValueError(f"model: unknown preset {name!r}; known: {', '.join(PRESETS)}")
        kw = {**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}}
        return cls(**kw)

    @classmethod
    def from_dict(cls, d: dict) -> "GPT2Config":
        return cls(**{k: int(d[k]) for k in cls.__dataclass_fields__})

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def head_size(self) -> int:
        return self.channels // self.num_heads

    @property
    def num_parameters(self) -> int:
        return sum(int(np.prod(shape)) for _, shape, _ in parameter_specs(self))

    def flops_per_token(self, T: int) -> int:
        """Training FLOPs per token, 6*N + 6*L*C*T (N with the padded vocabulary)."""
        return 6 * self.num_parameters + 6 * self.num_layers * self.channels * T

    def describe(self) -> str:
        return (f"L={self.num_layers} C={self.channels} NH={self.num_heads} maxT={self.max_seq_len} "
                f"V={self.vocab_size} (padded {self.padded_vocab_size})")


# ------------------------------------------------------------------ specs ----

def parameter_specs(cfg: GPT2Config):
    """[(name, shape, weight_decay?)] in llm.c's order. Matrices decay; biases, LN and nothing else."""
    L, C, V, T = cfg.num_layers, cfg.channels, cfg.padded_vocab_size, cfg.max_seq_len
    return [
        ("wte", (V, C), True),              # token embedding, tied to the LM head
        ("wpe", (T, C), True),              # position embedding
        ("ln1w", (L, C), False), ("ln1b", (L, C), False),
        ("qkvw", (L, 3 * C, C), True), ("qkvb", (L, 3 * C), False),
        ("attprojw", (L, C, C), True), ("attprojb", (L, C), False),
        ("ln2w", (L, C), False), ("ln2b", (L, C), False),
        ("fcw", (L, 4 * C, C), True), ("fcb", (L, 4 * C), False),
        ("fcprojw", (L, C, 4 * C), True), ("fcprojb", (L, C), False),
        ("lnfw", (C,), False), ("lnfb", (C,), False),
    ]


def parameter_layout(cfg: GPT2Config, dtype) -> TensorLayout:
    layout = TensorLayout([(n, s, dtype) for n, s, _ in parameter_specs(cfg)])
    # packed back to back (see GPT2Config checks): element offsets are dtype-independent
    assert layout.nbytes == layout.num_elements * layout.specs[0].dtype.itemsize
    return layout


def head_chunk_rows(cfg: GPT2Config, BT: int, dtype) -> int:
    """Rows of LM-head logits computed at once: the largest power of two within
    settings.lm_head_chunk_bytes (1 GiB: 8192 rows of d12's bf16 logits)."""
    budget = settings.current().lm_head_chunk_bytes
    limit = max(1, budget // (cfg.padded_vocab_size * dtypes.normalize(dtype).itemsize))
    return min(BT, 1 << (limit.bit_length() - 1))


def activation_specs(cfg: GPT2Config, B: int, T: int, dtype, keep_gelu: bool = False, fp8: bool | str = False,
                     fp8_fch: bool | None = None):
    """The forward activations kept for the backward pass (plus scratch), for a (B, T) batch.
    keep_gelu: fch_gelu is stored per layer (L, B, T, 4C) instead of one recomputed (B, T, 4C).
    fp8: the FP8 linears keep their inputs as transposed FP8 copies ("x8t", 1 byte per value;
    gpucore/fp8_linear.py), so ln1, ln2 and fch_gelu are one scratch each, not per layer; with
    keep_gelu the GELU output is kept that way too (4C bytes per token instead of 8C). fp8 may be the
    scaling mode (True: the default, adaptive): with adaptive scaling and settings.fp8_fch_e4m3 fch is
    kept as E4M3 bytes (fp8_linear.fch_in_e4m3). fp8_fch: that choice as a model's Fp8Linears made it
    (GPT2 passes its own, so that a setting changed after the model was built cannot part the
    buffer from the kernels that fill it); None: decided from the settings now."""
    if fp8_fch is None:
        fp8_fch = fch_in_e4m3(fp8)
    L, C, NH, Vp = cfg.num_layers, cfg.channels, cfg.num_heads, cfg.padded_vocab_size
    f32 = dtypes.float32
    per_layer_ln = (B, T, C) if fp8 else (L, B, T, C)
    specs = [
        ("encoded", (B, T, C), dtype),             # wte[tokens] + wpe: the residual stream, layer 0 input
        ("ln1", per_layer_ln, dtype), ("ln1_mean", (L, B, T), f32), ("ln1_rstd", (L, B, T), f32),
        ("qkv", (L, B, T, 3 * C), dtype),
        ("atty", (L, B, T, C), dtype), ("att_lse", (L, B, NH, T), f32),
        ("residual2", (L, B, T, C), dtype),        # residual + attention branch
        ("ln2", per_layer_ln, dtype), ("ln2_mean", (L, B, T), f32), ("ln2_rstd", (L, B, T), f32),
        ("fch", (L, B, T, 4 * C), np.uint8 if fp8_fch else dtype),   # MLP pre-activation (GELU input)
        ("residual3", (L, B, T, C), dtype),        # residual2 + MLP branch: layer output
        ("lnf", (B, T, C), dtype), ("lnf_mean", (B, T), f32), ("lnf_rstd", (B, T), f32),
        ("losses", (B, T), f32),
        # gelu(fch): kept, or scratch recomputed by the backward. FP8 linears keep it as x8t, and the
        # forward's GELU scratch (written only where a cast needs the bf16 values first: current
        # scaling, a tensor's first step) is the backward's idle dbig (GPT2.forward).
        *([] if fp8 else [("fch_gelu", (L, B, T, 4 * C) if keep_gelu else (B, T, 4 * C), dtype)]),
        ("logits", (head_chunk_rows(cfg, B * T, dtype), Vp), dtype),  # scratch: one LM-head chunk
    ]
    if fp8:
        from .fp8_linear import kept_x8t_per_token
        specs.append(("x8t", (L, B, T * kept_x8t_per_token(cfg, keep_gelu)), np.uint8))
    return specs


def grad_activation_specs(cfg: GPT2Config, B: int, T: int, dtype):
    """Backward scratch, reused by every layer (llm.c's trick): 6*C values per token."""
    C = cfg.channels
    return [
        ("dresidual", (B, T, C), dtype),   # gradient of the residual stream (+=)
        ("dsmall", (B, T, C), dtype),      # dlnf, dln2, datty, dln1 in turn
        ("dbig", (B, T, 4 * C), dtype),    # dfch (4C) or dqkv (first 3C of each row-block)
    ]


def memory_plan(cfg: GPT2Config, B: int, T: int, dtype, master_weights: str = "fp32",
                keep_gelu: bool = False, fp8: bool | str = False, fp8_lm_head: bool | None = None,
                fp8_fch: bool | None = None) -> dict[str, int]:
    """Bytes of each flat buffer a training run at (B, T) allocates (nothing is allocated).
    fp8_lm_head, fp8_fch: a model's own choices (None: from the settings now; activation_specs).

    The fp32 master copy exists only when the parameters are not fp32 and master_weights is
    "fp32"; "kahan" adds a bf16 compensation buffer (gpucore.optim.bytes_per_parameter).
    """
    from .optim import bytes_per_parameter
    dtype = dtypes.normalize(dtype)
    if fp8_lm_head is None:
        fp8_lm_head = settings.current().fp8_lm_head
    n = cfg.num_parameters
    per = bytes_per_parameter(dtype, master_weights)
    plan = {
        "params": n * per["params"],
        "grads": n * dtype.itemsize,
        "master": n * per["master"],
        "m": n * per["m"],
        "v": n * per["v"],
        "activations": TensorLayout(activation_specs(cfg, B, T, dtype, keep_gelu, fp8, fp8_fch)).nbytes,
        "grad scratch": TensorLayout(grad_activation_specs(cfg, B, T, dtype)).nbytes,
    }
    if per["kahan"]:
        plan["kahan"] = n * per["kahan"]
    if fp8:
        from .fp8_linear import scratch_bytes
        extra = scratch_bytes(cfg, B, T, lm_head=fp8_lm_head)   # the linears': 0 when it fits in the idle logits chunk
        if extra:
            plan["fp8 scratch"] = extra
    return plan


def resolve_keep_gelu(keep_gelu, cfg: GPT2Config, B: int, T: int, dtype, xp, master_weights: str = "fp32",
                      device_bytes: int | None = None, fp8: bool | str = False) -> bool:
    """keep_gelu as given (True/False), or for None the default: on a GPU, keep the per-layer GELU
    outputs (the backward then skips L recomputations, ~0.28 ms each at d12 B=64 on an H100) when
    the whole plan with them stays within KEEP_GELU_DEVICE_FRACTION of the device's memory (d12
    B=64: 23 GB, kept on an H100; d48 B=16: 65 GB, recomputed, as llm.c does); on the CPU, recompute.
    The choice changes no arithmetic of the forward, and the backward reads the same values
    either way up to the GELU epilogue's bf16 rounding (gpucore/ops/matmul.py)."""
    if keep_gelu is not None:
        return bool(keep_gelu)
    if xp is np:
        return False
    if device_bytes is None:
        device_bytes = runtime.cupy.cuda.Device().mem_info[1]
    plan = memory_plan(cfg, B, T, dtype, master_weights=master_weights, keep_gelu=True, fp8=fp8)
    return sum(plan.values()) <= KEEP_GELU_DEVICE_FRACTION * device_bytes


def allocate(layout: TensorLayout, xp, zero: bool = True):
    """The single allocation point of the model's flat buffers (tests monkeypatch it to fake an OOM)."""
    return layout.allocate(xp, zero=zero)


def _2d(x):
    return x.reshape(-1, x.shape[-1])


# activations stacked per layer: (L, B, ...); the others are (B, ...) or scratch
LAYER_ACTIVATIONS = frozenset({"ln1_mean", "ln1_rstd", "qkv", "atty", "att_lse", "residual2",
                               "ln2_mean", "ln2_rstd", "fch", "residual3", "x8t"})
STACKED_IF_4D = frozenset({"ln1", "ln2", "fch_gelu"})   # per layer unless FP8 / not kept: (B, T, .)


class _BatchViews:
    """Views of the first B batch rows of activation Tensors allocated for a larger B.

    Per-layer stacks are sliced as x[:, :B] (x[:, :B][l] is contiguous); batch tensors as x[:B];
    the LM-head logits scratch is shared whole.
    """

    def __init__(self, tensors, B: int):
        for name, x in tensors:
            per_layer = name in LAYER_ACTIVATIONS or (name in STACKED_IF_4D and x.ndim == 4)
            if name == "logits" or x.shape[1 if per_layer else 0] == B:
                v = x
            else:
                v = x[:, :B] if per_layer else x[:B]
            setattr(self, name, v)


# ------------------------------------------------------------------ model ----

class GPT2:
    """GPT-2 with manual forward/backward over flat buffers.

    model = GPT2(GPT2Config.from_preset("tiny"), xp=numpy, dtype="float32", seed=1337)
    loss = model.forward(tokens, targets, for_backward=True)   # 0-d fp32 array on xp
    model.backward()                                            # grads accumulate (+=) into model.grads

    keep_gelu: store the GELU outputs per layer (True), recompute them in the backward (False), or
    None: decided per batch shape by resolve_keep_gelu (see it); self.keep_gelu is the decision.
    fp8: None, or "current" / "delayed" / "adaptive": the four linears of every layer multiply in FP8
    with that scaling (gpucore/fp8_linear.py; bfloat16 models only); the rest stays bf16.
    """

    def __init__(self, config: GPT2Config, *, xp=np, dtype="float32", seed: int | None = 1337,
                 keep_gelu: bool | None = None, fp8: str | None = None):
        self.config = config
        self.xp = xp
        self.dtype = dtypes.normalize(dtype)
        if self.dtype not in dtypes.FLOAT_DTYPES:
            raise TypeError(f"dtype: must be float32 or bfloat16, got {dtypes.name(self.dtype)}")
        self.layout = parameter_layout(config, self.dtype)
        self.params = allocate(self.layout, xp, zero=seed is None)
        self.grads = None
        self.acts = None            # activation views for the current (B, T) (a _BatchViews)
        self.grad_acts = None       # backward scratch views
        self._acts_full = self._grad_full = None    # the allocated Tensors
        self._logits = None                         # the logits chunk, when allocated on its own (compressible)
        self._shape = None          # (B, T) the buffers were allocated for
        self._backward_ready = None  # tokens of the last forward(..., for_backward=True)
        self._encoder_plan = None    # its token sort for the encoder backward (GPU; made in forward)
        self.keep_gelu_request = keep_gelu
        self.keep_gelu = False       # decided in allocate_activations
        self.fp8 = None
        if fp8 is not None:
            if self.dtype != dtypes.bfloat16:
                raise ValueError(f"fp8: FP8 linears need a bfloat16 model, this one is {dtypes.name(self.dtype)}")
            self.fp8 = Fp8Linears(config, xp, mode=fp8)
        # The LM head's thinned dlogits (settings.bf16_lm_head_sparse / fp8_lm_head_sparse) draw from a
        # hash of this step count and micro-batch (head_draw_seed), kept in device memory: a CUDA
        # graph replays its kernels' arguments as captured, so the seed is written here (set_step,
        # set_micro_batch), outside any graph.
        self.steps_done = 0
        self.head_seed = xp.zeros(1, np.uint32)
        self._head_seed_value = 0    # what head_seed holds (host copy: an unchanged seed costs no fill)
        bf16_sparse = settings.current().bf16_lm_head_sparse
        if not bf16_sparse >= 0:
            raise ValueError(f"bf16_lm_head_sparse: expected a probability >= 0, got {bf16_sparse!r}")
        self.bf16_head_sparse = float(bf16_sparse) if self.dtype == dtypes.bfloat16 else 0.0
        if seed is not None:
            self.init_weights(seed)

    # ---------------------------------------------------------------- setup

    @property
    def num_parameters(self) -> int:
        return self.layout.num_elements

    def decay_spans(self) -> list[tuple[int, int]]:
        """Element ranges [start, stop) of the flat parameter buffer that get weight decay."""
        item = self.dtype.itemsize
        return [(self.layout.offsets[n] // item, self.layout.offsets[n] // item + int(np.prod(s)))
                for n, s, decay in parameter_specs(self.config) if decay]

    def init_weights(self, seed: int):
        """GPT-2 initialisation, generated in fp32 on the CPU (same numbers on every backend).

        N(0, 0.02) for matrices and embeddings, N(0, 0.02/sqrt(2L)) for the two residual
        projections (attprojw, fcprojw), zero biases, LN weights 1; padded wte rows 0.
        """
        cfg = self.config
        rng = np.random.default_rng(seed)
        host = parameter_layout(cfg, np.float32).allocate(np)
        proj_std = 0.02 / math.sqrt(2 * cfg.num_layers)
        for name, shape, _ in parameter_specs(cfg):
            t = host[name]
            if name in ("wte", "wpe", "qkvw", "fcw"):
                t[...] = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            elif name in ("attprojw", "fcprojw"):
                t[...] = rng.standard_normal(shape, dtype=np.float32) * np.float32(proj_std)
            elif name in ("ln1w", "ln2w", "lnfw"):
                t[...] = 1.0
        host.wte[cfg.vocab_size:] = 0.0
        self.load_flat(host.flat())

    def load_flat(self, flat):
        """Set every parameter from one flat array (NumPy or xp; any float dtype, cast here)."""
        dst = self.params.flat()
        if flat.shape != dst.shape:
            raise ValueError(f"params: expected {dst.shape[0]} elements, got {flat.shape}")
        if isinstance(flat, np.ndarray):
            flat = np.ascontiguousarray(flat).astype(self.dtype, copy=False)
            dst[...] = self.xp.asarray(flat)
        else:
            dst[...] = flat.astype(self.dtype, copy=False)

    def allocate_grads(self):
        if self.grads is None:
            self.grads = allocate(self.layout, self.xp)
        return self.grads

    def zero_grad(self):
        self.allocate_grads().zero_()

    def allocate_activations(self, B: int, T: int):
        """Activation views for a (B, T) batch.

        A batch with the allocated T and a smaller B runs in the first B rows of the existing
        buffers (validation with a smaller batch must not allocate a second set); any other
        shape frees the buffers and allocates new ones.
        """
        if self._shape is None or self._shape[1] != T or self._shape[0] < B:
            self.acts = self.grad_acts = self._acts_full = self._grad_full = self._logits = None   # free first
            self._shape = self._backward_ready = None
            self.keep_gelu = resolve_keep_gelu(self.keep_gelu_request, self.config, B, T, self.dtype, self.xp,
                                               fp8=self._fp8_mode())
            specs = activation_specs(self.config, B, T, self.dtype, self.keep_gelu, self._fp8_mode(),
                                     fp8_fch=self._fp8_fch())
            if self._compressible_logits():     # its own allocation, outside the flat buffer
                spec = next(sp for sp in specs if sp[0] == "logits")
                specs = [sp for sp in specs if sp[0] != "logits"]
                self._logits = compressible.empty(spec[1], spec[2])
            self._acts_full = allocate(TensorLayout(specs), self.xp, zero=False)
            self._grad_full = allocate(TensorLayout(grad_activation_specs(self.config, B, T, self.dtype)),
                                       self.xp, zero=False)
            self._shape = (B, T)
        if self.acts is None or self.acts.encoded.shape[0] != B:
            self.acts = _BatchViews(self._acts_full, B)
            if self._logits is not None:
                self.acts.logits = self._logits
            self.grad_acts = _BatchViews(self._grad_full, B)
            if self.fp8 is not None:    # the FP8 scratch lives in the logits chunk when it fits
                self.fp8.bind_arena(self.acts.logits.reshape(-1).view(np.uint8))
        return self.acts

    def step_buffers(self) -> tuple:
        """The buffers a forward + backward writes besides the parameters: activations, backward
        scratch, gradients, FP8 scratch. A CUDA graph of the step keeps them alive, so a later
        reallocation (another batch shape) never frees memory the graph writes (step_graph.py)."""
        fp8 = self.fp8.buffers() if self.fp8 is not None else ()
        logits = (self._logits,) if self._logits is not None else ()     # the chunk, when allocated on its own
        return (self._acts_full, self._grad_full, self.grads) + fp8 + logits

    def _compressible_logits(self) -> bool:
        """Is the LM head's logits chunk its own compressible allocation (compressible.py)? On a GPU,
        with settings.compressible_dlogits, when the head's dlogits are thinned (mostly zeros): FP8's
        transposed dlogits8 and bf16's thinned dlogits are written into the chunk."""
        if self.xp is np or not settings.current().compressible_dlogits:
            return False
        if self.fp8 is not None and self.fp8.lm_head:
            return self.fp8.head_sparse > 0
        return self.bf16_head_sparse > 0

    def _fp8_mode(self):
        """The FP8 linears' scaling mode, or False (what activation_specs and memory_plan take)."""
        return self.fp8.scaling.mode if self.fp8 is not None else False

    def _fp8_fch(self) -> bool:
        """Whether this model's FP8 linears keep fch as E4M3 (decided once, when they were built)."""
        return self.fp8 is not None and self.fp8.fch8

    def memory_plan(self, B: int, T: int) -> dict[str, int]:
        keep = resolve_keep_gelu(self.keep_gelu_request, self.config, B, T, self.dtype, self.xp,
                                 fp8=self._fp8_mode())
        return memory_plan(self.config, B, T, self.dtype, keep_gelu=keep, fp8=self._fp8_mode(),
                           fp8_lm_head=self.fp8.lm_head if self.fp8 is not None else None, fp8_fch=self._fp8_fch())

    # -------------------------------------------------------------- forward

    def _check_tokens(self, name, x, shape=None):
        xp = self.xp
        if not isinstance(x, xp.ndarray):
            raise TypeError(f"{name}: expected a {xp.__name__} array on the model's device, got {type(x).__name__}")
        if x.dtype != np.int32:
            raise TypeError(f"{name}: dtype must be int32, got {x.dtype}")
        if x.ndim != 2:
            raise ValueError(f"{name}: expected shape (B, T), got {tuple(x.shape)}")
        if shape is not None and tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
        if x.shape[1] > self.config.max_seq_len:
            raise ValueError(f"{name}: T={x.shape[1]} exceeds the model's max_seq_len {self.config.max_seq_len}")

    def forward(self, tokens, targets=None, *, return_logits=False, for_backward=False, grad_scale=None,
                check_tokens=True):
        """Run the model on tokens (B, T) int32; return the mean loss as a 0-d fp32 array on xp.

        targets (B, T) int32 (-1 = ignore): the loss; None: loss is None.
        return_logits: also return a fresh (B, T, Vp) logits array -> (loss, logits).
        for_backward: prepare backward() (the LM head's backward runs here, chunk by chunk);
            the gradient is grad_scale * d(sum of losses); grad_scale defaults to 1/#targets
            (the mean; a host sync). Gradient accumulation passes 1/(total tokens).
        check_tokens: check every id is < vocab_size before the embedding lookup (on the GPU a
            device reduction and a host sync); the training loop skips it because its data
            loader validated the shards against the vocabulary already.
        """
        cfg, xp, p = self.config, self.xp, self.params
        self._check_tokens("tokens", tokens)
        B, T = tokens.shape
        if targets is not None:
            self._check_tokens("targets", targets, (B, T))
        if for_backward and targets is None:
            raise ValueError("targets: needed when for_backward=True")
        if for_backward and return_logits:
            raise ValueError("return_logits: not available with for_backward=True (training never "
                             "materialises the full logits)")
        if targets is None and not return_logits:
            raise ValueError("targets: give targets (for the loss) or return_logits=True")
        L, NH, V = cfg.num_layers, cfg.num_heads, cfg.vocab_size
        if check_tokens and tokens.size:
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= V:
                raise ValueError(f"tokens: ids must be in [0, vocab_size={V}), got values from {lo} to {hi}")
        a = self.allocate_activations(B, T)
        self._backward_ready = None

        lin = self._linear_forward
        if self.fp8 is not None and (B * T) % 16:
            raise ValueError(f"tokens: FP8 linears need B*T to be a multiple of 16, got {B}*{T}")
        encoder_forward(tokens, p.wte, p.wpe, out=a.encoded, check_tokens=False)   # checked just above
        self._encoder_plan = (_encoder_plan_beside(tokens, p.wte.shape[0])   # dwte's (padded) rows
                              if for_backward and xp is not np else None)
        ln1, ln2 = self._ln_out(a.ln1), self._ln_out(a.ln2)      # per layer, or one scratch (FP8)
        keep_x8t = self.fp8 is not None and for_backward        # the FP8 backward reads x8t, not x
        # Each layernorm runs in the linear that consumes it (_ln_linear: with FP8 the layernorm may
        # write FP8 itself).
        def ln_call(x, w, b, out, mean, rstd):
            return LayerNormCall(_2d(x), None, w, b, None, _2d(out), mean.reshape(-1), rstd.reshape(-1))

        for l in range(L):
            residual = a.encoded if l == 0 else a.residual3[l - 1]
            x8t = (lambda j: self._kept_x8t(l, j, B * T)) if keep_x8t else (lambda j: None)
            ln1_call = ln_call(residual, p.ln1w[l], p.ln1b[l], ln1(l), a.ln1_mean[l], a.ln1_rstd[l])
            self._ln_linear(l, QKV, ln1_call, p.qkvw[l], p.qkvb[l], _2d(a.qkv[l]), x8t=x8t(QKV))
            # residual2 = residual + attproj(...): the residual added in the GEMM's epilogue
            if self.fp8 is not None:    # the attention forward writes attproj's E4M3 input itself
                attend = (lambda o8, o8t, s8, am, l=l: attention_forward(
                    a.qkv[l], NH, out=a.atty[l], lse=a.att_lse[l], out8=o8, out8_t=o8t, scale8=s8, amax8=am))
                lin(l, ATTPROJ, _2d(a.atty[l]), p.attprojw[l], p.attprojb[l], _2d(a.residual2[l]),
                    x8t=x8t(ATTPROJ), make_x=attend, residual=_2d(residual))
            else:
                attention_forward(a.qkv[l], NH, out=a.atty[l], lse=a.att_lse[l])
                lin(l, ATTPROJ, _2d(a.atty[l]), p.attprojw[l], p.attprojb[l], _2d(a.residual2[l]),
                    residual=_2d(residual))
            ln2_call = ln_call(a.residual2[l], p.ln2w[l], p.ln2b[l], ln2(l), a.ln2_mean[l], a.ln2_rstd[l])
            if self.fp8 is not None:    # GELU scratch: the backward's dbig is idle in the forward
                fch_gelu = self.grad_acts.dbig
            else:
                fch_gelu = a.fch_gelu[l] if a.fch_gelu.ndim == 4 else a.fch_gelu
            # bf16: GELU in the fc GEMM's epilogue. FP8: fcproj's input cast makes GELU(fch) itself.
            fc_gelu = _2d(fch_gelu) if self.fp8 is None else None
            self._ln_linear(l, FC, ln2_call, p.fcw[l], p.fcb[l], _2d(a.fch[l]), fc_gelu, x8t=x8t(FC))
            lin(l, FCPROJ, _2d(fch_gelu), p.fcprojw[l], p.fcprojb[l], _2d(a.residual3[l]), x8t=x8t(FCPROJ),
                gelu_of=_2d(a.fch[l]), residual=_2d(a.residual2[l]))
        layernorm_forward(a.residual3[L - 1], p.lnfw, p.lnfb, out=a.lnf, mean=a.lnf_mean, rstd=a.lnf_rstd)

        lnf = _2d(a.lnf)                                    # (BT, C)
        losses = a.losses.reshape(-1)                      # (BT,)
        tgt = targets.reshape(-1) if targets is not None else None
        logits = None
        if return_logits:
            logits = matmul_forward(lnf, p.wte, None)       # (BT, Vp), a fresh array
            if tgt is not None:   # the classifier overwrites its input with dlogits: use a copy
                fused_classifier(logits.copy(), tgt, vocab_size=V, grad_scale=0.0, losses=losses,
                                 check_targets=check_tokens)
            logits = logits.reshape(B, T, -1)
        else:
            if for_backward:
                if grad_scale is None:
                    grad_scale = 1.0 / max(1, int((tgt != -1).sum()))
                g = self.allocate_grads()
                dlnf = _2d(self.grad_acts.dsmall)
            rows = a.logits.shape[0]
            head8 = self.fp8 is not None and self.fp8.lm_head      # the LM head's GEMMs in FP8 too
            d8_scale = self.fp8.head_begin(lnf, p.wte, for_backward, grad_scale) if head8 else None
            for r0 in range(0, B * T, rows):
                r1 = min(B * T, r0 + rows)
                chunk = a.logits[: r1 - r0]
                if head8:
                    self.fp8.head_logits(r0, r1, chunk)
                else:
                    matmul_forward(lnf[r0:r1], p.wte, None, out=chunk)
                d8 = self.fp8.head_dlogits8(r1 - r0, chunk.shape[1]) if head8 and for_backward else None
                dwte8 = d8 is not None and self.fp8.head_dwte   # dwte from dlogits8 too: no bf16 dlogits
                if head8:                       # settings.fp8_lm_head_sparse: the E5M2 dlogits
                    sparse = self.fp8.head_sparse_tau if dwte8 else 0.0
                else:                           # settings.bf16_lm_head_sparse: the bf16 dlogits
                    sparse = sparse_tau_of(self.bf16_head_sparse, grad_scale) if for_backward else 0.0
                fused_classifier(chunk, tgt[r0:r1], vocab_size=V,
                                 grad_scale=grad_scale if for_backward else 0.0, losses=losses[r0:r1],
                                 check_targets=check_tokens, dlogits8=d8, dlogits8_scale=d8_scale,
                                 write_dlogits=not dwte8, sparse_tau=sparse,
                                 sparse_seed=self.head_seed if sparse else None, sparse_row0=r0)
                # The head has no bias: need_dbias=False, or matmul_backward would sum dlogits'
                # columns into a throwaway vector (a whole extra read of every chunk).
                if for_backward and head8:      # dlnf from the E5M2 dlogits; dwte from them or the bf16 ones
                    self.fp8.head_dx(d8, dlnf[r0:r1])
                    if dwte8:                   # the chunk's logits are dead: the transposes' scratch
                        self.fp8.head_dwte_into(d8, r0, chunk, g.wte)
                    else:
                        matmul_backward(chunk, lnf[r0:r1], p.wte, dweight=g.wte, need_dx=False, need_dbias=False)
                elif for_backward:  # chunk now holds dlogits: the LM head's backward, at once
                    matmul_backward(chunk, lnf[r0:r1], p.wte, dx=dlnf[r0:r1], dweight=g.wte, need_dbias=False)
            if for_backward:
                self._backward_ready = tokens

        loss = None
        if tgt is not None:
            count = (tgt != -1).sum()
            loss = (_sum(a.losses) / xp.maximum(count, 1)).astype(np.float32)
        return (loss, logits) if return_logits else loss

    def _linear_forward(self, l, j, x2d, weight, bias, out2d, gelu_out2d=None, x8t=None, gelu_of=None,
                        make_x=None, residual=None):
        """Linear j (QKV, ATTPROJ, FC, FCPROJ) of layer l: out2d = x2d @ weight^T + bias [gelu_out2d = GELU]
        [+ residual, added in the GEMM's epilogue]. x8t (FP8 only): where to keep x's transposed FP8
        copy for the backward. gelu_of (FP8 only): x2d is GELU(gelu_of), made by x's FP8 cast (x2d is
        then only scratch). make_x (FP8 only): the op that makes x2d, which may write x's FP8 bytes
        too (Fp8Linears.forward)."""
        if self.fp8 is not None:
            return self.fp8.forward(l, j, x2d, weight, bias, out2d, gelu_out2d, x8t=x8t, gelu_of=gelu_of,
                                    make_x=make_x, residual=residual)
        return matmul_forward(x2d, weight, bias, out=out2d, gelu_out=gelu_out2d, residual=residual)

    def _ln_linear(self, l, j, ln, weight, bias, out2d, gelu_out2d=None, x8t=None):
        """Linear j of layer l on the output of the layernorm call `ln` (LayerNormCall): the layernorm,
        then the linear; with FP8 linears both happen in Fp8Linears.forward (which may have the
        layernorm write FP8 bytes instead of its bf16 output)."""
        if self.fp8 is not None:
            return self.fp8.forward(l, j, None, weight, bias, out2d, gelu_out2d, x8t=x8t, ln=ln)
        return matmul_forward(ln.run(), weight, bias, out=out2d, gelu_out=gelu_out2d)

    def _linear_backward(self, l, j, dout2d, x2d, weight, dx2d, dweight, dbias, gelu_of=None, dout_measured=False):
        """Its backward: dx2d = [, dweight +=, dbias += (when not None)]. FP8: x from the kept x8t
        when the forward kept it (then x2d is not read), else from x2d, or recomputed as
        GELU(gelu_of) inside its cast; dout_measured: see Fp8Linears.backward."""
        if self.fp8 is not None:
            return self.fp8.backward(l, j, dout2d, x2d, weight, dx2d, dweight, dbias,
                                     x8t=self._kept_x8t(l, j, dout2d.shape[0]), gelu_of=gelu_of,
                                     dout_measured=dout_measured)
        return matmul_backward(dout2d, x2d, weight, dx=dx2d, dweight=dweight, dbias=dbias,
                               need_dbias=dbias is not None)

    def _ln_out(self, stack):
        """l -> the layernorm output buffer of layer l: stack[l], or with FP8 linears the one scratch."""
        return (lambda l: stack) if self.fp8 is not None else (lambda l: stack[l])

    def _kept_x8t(self, l, j, N):
        """Linear j's kept transposed FP8 input of layer l (K, N), or None when not kept (fcproj's
        without keep_gelu)."""
        if j == FCPROJ and not self.keep_gelu:
            return None
        return kept_x8t(self.acts.x8t[l].reshape(-1), j, N, self.config.channels)

    def end_step(self):
        """After each optimizer step (the training loop calls it): FP8 scales for the next step, and
        the next step's draws for the thinned dlogits."""
        if self.fp8 is not None:
            self.fp8.end_step()
        self.set_step(self.steps_done + 1)

    def set_step(self, step: int):
        """The optimizer steps done (a resumed run sets its checkpoint's): the thinned dlogits'
        seed, for the step's first micro-batch (set_micro_batch for the others)."""
        self.steps_done = int(step)
        self.set_micro_batch(0)

    def set_micro_batch(self, index: int):
        """The thinned dlogits' draws for micro-batch `index` of this optimizer step, counted over all
        data-parallel ranks (train_step: rank * grad_accum + i). Each micro-batch needs draws of its
        own: with one seed a step, the same row of two micro-batches (or ranks) met the same
        thresholds, so their thinning errors added up coherently in the summed gradient instead of
        averaging out. A fill of the device seed only when it changes (index 0 of a one-GPU run
        without accumulation: never within a step)."""
        seed = head_draw_seed(self.steps_done, index)
        if seed != self._head_seed_value:
            self.head_seed.fill(np.uint32(seed))
            self._head_seed_value = seed

    # ------------------------------------------------------------- backward

    def backward(self, on_layer_done=None):
        """Gradients of the last forward(..., for_backward=True) into self.grads (+=).

        on_layer_done(l), if given, is called as soon as layer l's parameter gradients are final
        (data-parallel training starts reducing them while the backward goes on).

        The LM head's backward already ran inside forward (dlnf is in grad_acts.dsmall,
        dwte += from the head); this is the rest of gpt2_backward, in reverse order.
        """
        if self._backward_ready is None:
            raise RuntimeError("backward: call forward(tokens, targets, for_backward=True) first")
        tokens = self._backward_ready
        self._backward_ready = None
        cfg, p, a, g, d = self.config, self.params, self.acts, self.grads, self.grad_acts
        L, C, NH = cfg.num_layers, cfg.channels, cfg.num_heads
        B, T = tokens.shape
        dres = d.dresidual
        dres.fill(0)                                          # residual-stream grads accumulate (+=)
        dsmall = d.dsmall                                     # (B, T, C)
        dfch = d.dbig                                         # (B, T, 4C)
        dqkv = d.dbig.reshape(-1)[: B * T * 3 * C].reshape(B, T, 3 * C)

        # Bias gradients: with settings.fused_bias_grads (read once per call) the kernel that writes
        # their dout also sums its columns (fcproj, attproj: the layernorm backward that updates dres
        # last; fc: the gelu backward; qkv: the attention backward), so matmul_backward never reads
        # dout a second time for them.
        fuse = settings.current().fused_bias_grads
        lin_bwd = self._linear_backward
        ln1, ln2 = self._ln_out(a.ln1), self._ln_out(a.ln2)
        layernorm_backward(dsmall, a.residual3[L - 1], p.lnfw, a.lnf_mean, a.lnf_rstd,
                           dx=dres, dweight=g.lnfw, dbias=g.lnfb, dx_colsum=g.fcprojb[L - 1] if fuse else None)
        for l in reversed(range(L)):
            residual = a.encoded if l == 0 else a.residual3[l - 1]
            # MLP branch: residual3 = residual2 + fcproj(gelu(fc(ln2(residual2))))
            # GELU(fch) not kept (keep_gelu off): the GELU backward that follows fcproj's dx GEMM reads
            # fch anyway, so it writes GELU(fch) again too (bf16; FP8: fcproj's transposed E4M3 input),
            # and fcproj's weight gradient runs after it.
            remake = not self.keep_gelu
            fcproj_b = None if fuse else g.fcprojb[l]
            if self.fp8 is not None:    # the GELU backward runs inside fc's FP8 gradient cast (and sums fcb)
                # a.fch[l] as fcproj's x: a placeholder, not read (x8t was kept, or is remade from GELU(fch))
                later = self.fp8.backward(l, FCPROJ, _2d(dres), _2d(a.fch[l]), p.fcprojw[l], _2d(dfch),
                                          g.fcprojw[l], fcproj_b, x8t=self._kept_x8t(l, FCPROJ, B * T),
                                          gelu_of=_2d(a.fch[l]), defer_dweight=remake)
                self.fp8.backward(l, FC, _2d(dfch), _2d(ln2(l)), p.fcw[l], _2d(dsmall), g.fcw[l], g.fcb[l],
                                  x8t=self._kept_x8t(l, FC, B * T), gelu_x2d=_2d(a.fch[l]), then=later)
            else:
                fch_gelu = a.fch_gelu if remake else a.fch_gelu[l]
                if remake:              # dx now; dW once gelu_backward has remade fch_gelu
                    matmul_backward(_2d(dres), _2d(fch_gelu), p.fcprojw[l], dx=_2d(dfch),
                                    need_dweight=False, need_dbias=False)
                else:
                    lin_bwd(l, FCPROJ, _2d(dres), _2d(fch_gelu), p.fcprojw[l], _2d(dfch), g.fcprojw[l], fcproj_b)
                gelu_backward(dfch, a.fch[l], dx=dfch, dbias=g.fcb[l] if fuse else None,
                              gelu_out=fch_gelu if remake else None)
                if remake:
                    matmul_backward(_2d(dres), _2d(fch_gelu), p.fcprojw[l], dweight=g.fcprojw[l], dbias=fcproj_b,
                                    need_dx=False, need_dbias=fcproj_b is not None)
                lin_bwd(l, FC, _2d(dfch), _2d(ln2(l)), p.fcw[l], _2d(dsmall), g.fcw[l], None if fuse else g.fcb[l])
            layernorm_backward(dsmall, a.residual2[l], p.ln2w[l], a.ln2_mean[l], a.ln2_rstd[l],
                               dx=dres, dweight=g.ln2w[l], dbias=g.ln2b[l],
                               dx_colsum=g.attprojb[l] if fuse else None)
            # attention branch: residual2 = residual + attproj(attention(qkv(ln1(residual))))
            lin_bwd(l, ATTPROJ, _2d(dres), _2d(a.atty[l]), p.attprojw[l], _2d(dsmall), g.attprojw[l],
                    None if fuse else g.attprojb[l])
            # fused: qkv's bias gradient summed by the attention backward as it writes dqkv. FP8 with
            # adaptive scaling: it also takes dqkv's amax, so dqkv's cast (the gradient re-cast most
            # often) is right the first time
            dqkv_amax = self.fp8.dout_amax(l, QKV) if self.fp8 is not None else None
            attention_backward(dsmall, a.qkv[l], a.atty[l], a.att_lse[l], NH, dqkv=dqkv,
                               dbias=g.qkvb[l] if fuse else None, amax=dqkv_amax)
            lin_bwd(l, QKV, _2d(dqkv), _2d(ln1(l)), p.qkvw[l], _2d(dsmall), g.qkvw[l], None if fuse else g.qkvb[l],
                    dout_measured=dqkv_amax is not None)
            layernorm_backward(dsmall, residual, p.ln1w[l], a.ln1_mean[l], a.ln1_rstd[l],
                               dx=dres, dweight=g.ln1w[l], dbias=g.ln1b[l],
                               dx_colsum=g.fcprojb[l - 1] if fuse and l > 0 else None)
            if on_layer_done is not None:       # fcprojb[l] was written by layer l+1 (or lnf) above
                on_layer_done(l)
        plan, self._encoder_plan = self._encoder_plan, None
        encoder_backward(dres, tokens, g.wte, g.wpe, check_tokens=False, plan=plan)   # checked in forward
        return g


def _encoder_plan_beside(tokens, V):
    """The encoder backward's token sort, made on a side stream while the forward runs (it needs
    only the tokens; ~20 us of small latency-bound launches that would otherwise sit at the end of
    the backward). The plan's `ready` event makes encoder_backward's stream wait for it; its
    memory is allocated on the side stream, whose next use waits (fork) for everything queued
    before it on the main stream, including the backward that read these keys."""
    cp = runtime.cupy
    main = cp.cuda.get_current_stream()
    side, forked, _ = runtime.side_stream("encoder plan")
    forked.record(main)
    side.wait_event(forked)
    with side:
        plan = encoder_backward_plan(tokens, V)
        plan.ready = cp.cuda.Event(disable_timing=True)
        plan.ready.record(side)
    return plan
