"""The one configuration surface: which kernel or library path the ops take.

Every choice the engine makes between correct alternatives (cuBLASLt or plain
gemmEx, attention v3 or v2 by default, a side stream or not, fused bias
gradients or not) is a field of one frozen `Settings` object. Nothing else in
the package reads the environment or keeps a switch in a module global, so a
test or a probe changes a choice in one visible, scoped way:

    from gpucore import settings
    with settings.using(cublaslt=False):       # gemmEx + the bias-fill kernel
        gpucore.matmul_forward(x, w, b)
    settings.current().cublaslt                 # back to what it was

`using` nests and is per thread (a ContextVar), so a changed choice never
leaks out of its `with` block, not even when the block raises.

The defaults are the measured winners (tools/notes/). They can also be set
from the environment, read once when the defaults are first needed (not at
import): GPUCORE_CUBLASLT=0, GPUCORE_LT_AUTOTUNE=0, and any field through
GPUCORE_SETTINGS="name=value,..." (README, "Environment variables"); A/B runs
of whole trainings use the last.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    # ---- matmul (gpucore/cublas.py, gpucore/ops/matmul.py)
    cublaslt: bool = True                 # cuBLASLt with the bias epilogue; False: gemmEx + bias-fill kernel
    lt_autotune: bool = True              # race the heuristic's candidates (and gemmEx) once per shape
    lt_try_gemmex: bool = True            # gemmEx takes part in the race of epilogue-free GEMMs
    lt_autotune_min_flops: float = 2e9    # below: the heuristic's first choice (timing costs more than it saves)
    lt_tune_cache: str | None = None      # the winners' file; None: <kernel cache dir>/cublaslt_algos.json
    lt_search: int = 0                    # > 0: the race also gets the fastest of up to this many configurations
                                          # drawn from cuBLASLt's whole space (gpucore/lt_search.py); 0: heuristic only
    gelu_epilogue: bool = True            # bf16 matmul_forward(gelu_out=): GELU in Lt's epilogue (GELU_AUX_BIAS)
    # ---- attention (gpucore/ops/attention.py)
    attention_v3_forward: bool = True     # version=None forward: v3 (Hopper wgmma) where it applies, else v2
    attention_v3_backward: bool = True    # version=None backward: likewise
    attention_v3_streams: bool = True     # v3 backward: the dQ pass on a side stream beside the dK/dV pass
    attention_head_group: int = 16        # v3 block order: blocks walk groups of this many heads (0: plain order)
    attention_v3_onepass: str = "auto"    # v3 backward, hd 64: the one-pass kernel: auto (for the batch elements
                                          # whose heads fill the SMs' waves, the two passes beside it for the
                                          # rest: ops/attention.py onepass_batches), on, off
    # ---- encoder (gpucore/ops/encoder.py)
    encoder_dwpe_beside: bool = True      # backward v3/v4: dwpe on a side stream beside the sort and dwte
    # ---- model (gpucore/model.py)
    fused_bias_grads: bool = True         # bias grads from the kernels writing dout: gelu / layernorm / attention backward
    lm_head_chunk_bytes: int = 1 << 30    # LM-head logits scratch: rows per chunk = largest power of 2 within
    bf16_lm_head_sparse: float = 0.0      # > 0: the bf16 head's dlogits below ~this probability thinned without
                                          # bias (classifier sparse_tau; fewer toggling bits for its GEMMs); 0: off
    compressible_dlogits: bool = True     # thinned head dlogits (the logits chunk, FP8's dlogits8) in compressible
                                          # device memory where the GPU grants it (gpucore/compressible.py)
    # ---- FP8 linears (gpucore/fp8_linear.py, --dtype fp8): the scaling recipes' knobs
    fp8_history: int = 16                 # steps of amax history behind each scale
    fp8_margin: int = 1                   # scales 2^-margin below the history's amax: headroom for growth
    fp8_weights_current: bool = True      # weights scaled from their own amax every step (not delayed)
    fp8_window: int = 1                   # adaptive scaling: re-cast when the data sits > this many binades low
    fp8_predict_scales: bool = True       # adaptive scaling: the guard of fcproj's output gradient sets fc's and
                                          # attproj's scales from its amax, attproj's the layer below's fcproj's
                                          # (the residual stream's gradients move together): fewer re-casts
                                          # on spiky data (tools/notes/fp8.md, 68th session)
    fp8_lm_head: bool = True              # the LM head's logits and dlnf GEMMs in FP8 too
    fp8_lm_head_dwte: bool = True         # with fp8_lm_head, its dwte GEMM too (dlogits8, lnf8 transposed per chunk)
    fp8_fast_accum_dgrad: bool = True     # the linears' dx GEMMs (K <= 4C) on Hopper's fast FP8 accumulation too
    fp8_lm_head_sparse: float = 2.0 ** -13  # with fp8_lm_head_dwte: E5M2 dlogits below ~this probability thinned
                                          # without bias (fewer toggling bits for the head's GEMMs at the power cap); 0: off
    fp8_fch_e4m3: bool = True             # adaptive scaling: the fc GEMM writes fch (the GELU input kept for the
                                          # backward) as E4M3 with a delayed scale of its own, not bf16: half its bytes
                                          # (d12 B=64 -2.5 GB, d48 B=16 -5.1 GB; x1.003-1.011). On since the 72nd
                                          # session: with warmup as close to bf16 as bf16 fch (18 seeds of 1,000 B=64
                                          # steps); without warmup its one-step spikes are no more frequent or larger
                                          # than bf16's (36 seeds: 7 vs 9, at most +4.8 vs +5.8; bf16 fch 2 of 36;
                                          # tools/notes/fp8.md); False: fch in bf16
    fp8_fch_margin: int = 4               # fch's scales 2^-this below the history's amax: a value beyond saturates
                                          # (nothing re-runs the GEMM): more headroom than the casts' 2^-fp8_margin
    # ---- data parallel (gpucore/distributed/reducer.py)
    dp_overlap: bool = False              # True: reduce each layer's gradients while the backward runs (no CUDA graph)

    def replace(self, **changes) -> "Settings":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown setting(s): {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes)


def from_env(environ=None) -> Settings:
    """The defaults, with the documented environment variables applied.

    GPUCORE_SETTINGS="name=value,name=value" sets any field (for A/B runs of whole trainings,
    tools/ab_train.py): values parse as the field's default type (bool: 0/1/true/false)."""
    env = os.environ if environ is None else environ
    s = Settings(cublaslt=env.get("GPUCORE_CUBLASLT", "1") != "0",
                 lt_autotune=env.get("GPUCORE_LT_AUTOTUNE", "1") != "0")
    changes = {}
    for item in filter(None, (t.strip() for t in env.get("GPUCORE_SETTINGS", "").split(","))):
        name, sep, value = item.partition("=")
        default = getattr(Settings, name.strip(), _MISSING)
        if not sep or default is _MISSING:
            raise ValueError(f"GPUCORE_SETTINGS: {item!r} is not name=value with a known setting; "
                             f"known: {', '.join(f.name for f in dataclasses.fields(Settings))}")
        changes[name.strip()] = _parse(value.strip(), default, item)
    return s.replace(**changes)


_MISSING = object()


def _parse(value: str, default, item: str):
    if isinstance(default, bool):
        if value.lower() not in ("0", "1", "true", "false"):
            raise ValueError(f"GPUCORE_SETTINGS: {item!r}: expected 0, 1, true or false")
        return value.lower() in ("1", "true")
    if default is None:
        return value or None
    try:
        return type(default)(value)
    except ValueError:
        raise ValueError(f"GPUCORE_SETTINGS: {item!r}: expected a {type(default).__name__}") from None


_CURRENT: contextvars.ContextVar[Settings | None] = contextvars.ContextVar("gpucore_settings", default=None)
_DEFAULT: list[Settings] = []          # built once, on first use (the environment is read then, not at import)


def current() -> Settings:
    """The settings in force here (inside `using` blocks: theirs; else the process defaults)."""
    s = _CURRENT.get()
    if s is not None:
        return s
    if not _DEFAULT:
        _DEFAULT.append(from_env())
    return _DEFAULT[0]


@contextlib.contextmanager
def using(settings: Settings | None = None, **changes):
    """Run a block with `settings` (or the current ones) changed by `changes`; restored on exit."""
    new = (settings or current()).replace(**changes)
    token = _CURRENT.set(new)
    try:
        yield new
    finally:
        _CURRENT.reset(token)
