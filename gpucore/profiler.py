"""Per-op timing of a block of code: the recorder behind `gpucore profile`.

The public op functions the model and the optimizers call carry `@profiled(name)`.
Outside a `recording()` block the decorator costs one context-variable lookup and
calls the function. Inside one, each call is timed:

    from gpucore import profiler
    with profiler.recording() as rec:
        train_step(...)
    rec.totals()          # {name: OpTotal(calls, ms, flops, bytes)}; one synchronize, at the end

- on the GPU (any argument a CuPy array) with a pair of CUDA events recorded on the
  current stream before and after the call, read after the block with one
  synchronize (never one per op); side streams join the current stream, so the
  end event covers them;
- on the CPU with time.perf_counter.

Only the outermost profiled call counts: ops call other ops (matmul_backward the
column sum, sfadamw grad_norm), and an op running inside another is part of it.

`recording` is per thread and nests (a ContextVar, like gpucore.settings.using):
the previous recorder (usually none) is back after the block, also when it raises.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from dataclasses import dataclass


@dataclass
class OpTotal:
    calls: int = 0
    ms: float = 0.0
    flops: float = 0.0            # summed over calls (0: not counted for this op)
    bytes: float = 0.0            # summed over calls (0: not counted for this op)


class Recorder:
    """The calls timed inside one `recording()` block."""

    def __init__(self, labeler=None):
        self.labeler = labeler    # labeler(name, args, kwargs) -> row name (e.g. "matmul forward (lm head)")
        self.busy = False         # inside a profiled call: nested ones are part of it
        self._calls = []          # [name, start, end, flops, bytes]; start/end: CUDA events or seconds
        self._ms = None

    def _record(self, name, fn, args, kwargs, flops, nbytes):
        gpu = _any_gpu(args, kwargs)
        if self.labeler is not None:
            name = self.labeler(name, args, kwargs)
        self.busy = True
        try:
            if gpu:
                import cupy
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                result = fn(*args, **kwargs)
                end.record()
            else:
                start = time.perf_counter()
                result = fn(*args, **kwargs)
                end = time.perf_counter()
        finally:
            self.busy = False
        f = float(flops(result, args, kwargs)) if flops is not None else 0.0
        b = float(nbytes(result, args, kwargs)) if nbytes is not None else 0.0
        self._calls.append((name, start, end, f, b))
        self._ms = None
        return result

    def elapsed_ms(self) -> list[tuple[str, float, float, float]]:
        """(name, ms, flops, bytes) per call, in call order (one device synchronize when GPU calls were timed)."""
        if self._ms is None:
            if any(not isinstance(c[1], float) for c in self._calls):
                import cupy
                cupy.cuda.Device().synchronize()
                get = cupy.cuda.get_elapsed_time
            ms = []
            for name, start, end, f, b in self._calls:
                t = (end - start) * 1e3 if isinstance(start, float) else get(start, end)
                ms.append((name, t, f, b))
            self._ms = ms
        return self._ms

    def totals(self) -> dict[str, OpTotal]:
        """Per row name, in order of first call: calls, ms, flops and bytes summed."""
        out: dict[str, OpTotal] = {}
        for name, ms, f, b in self.elapsed_ms():
            t = out.setdefault(name, OpTotal())
            t.calls += 1
            t.ms += ms
            t.flops += f
            t.bytes += b
        return out


_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("gpucore_profiler", default=None)


def active() -> Recorder | None:
    """The recorder of the innermost `recording()` block of this thread (None outside)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def recording(labeler=None, *, recorder: Recorder | None = None):
    """Time every profiled op called in the block; yields the Recorder. Restored on exit.
    recorder: a Recorder (or subclass: probes that replay or skip calls) to use instead of a new one."""
    rec = recorder if recorder is not None else Recorder(labeler)
    token = _ACTIVE.set(rec)
    try:
        yield rec
    finally:
        _ACTIVE.reset(token)


def profiled(name: str, *, flops=None, nbytes=None):
    """Decorate a public op: time its calls inside `recording()` under `name`.

    flops / nbytes: optional functions (result, args, kwargs) -> the call's floating-point
    operations / bytes moved, from shapes only (no device work).
    """
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            rec = _ACTIVE.get()
            if rec is None or rec.busy:
                return fn(*args, **kwargs)
            return rec._record(name, fn, args, kwargs, flops, nbytes)
        wrapper.profiled_name = name
        return wrapper
    return decorate


# ------------------------------------------------------------ counting ----

def _is_array(x) -> bool:
    return hasattr(x, "nbytes") and hasattr(x, "shape") and hasattr(x, "dtype")


def _any_gpu(args, kwargs) -> bool:
    for a in (*args, *kwargs.values()):
        if _is_array(a):
            return type(a).__module__.startswith("cupy")
    return False


def _arg(args, kwargs, i, name, default=None):
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def io_bytes(result, args, kwargs) -> int:
    """Bytes of the arrays passed in and returned, each array once (an approximation of
    bytes moved: an array updated in place counts once, reads of partial rows count whole)."""
    seen, total = set(), 0
    results = result if isinstance(result, (tuple, list)) else (result,)
    for a in (*args, *kwargs.values(), *results):
        if _is_array(a) and id(a) not in seen:
            seen.add(id(a))
            total += int(a.nbytes)
    return total


def matmul_forward_flops(result, args, kwargs) -> float:
    x, w = _arg(args, kwargs, 0, "x"), _arg(args, kwargs, 1, "weight")
    M, K = w.shape
    return 2.0 * (x.size // K) * K * M


def matmul_backward_flops(result, args, kwargs) -> float:
    x, w = _arg(args, kwargs, 1, "x"), _arg(args, kwargs, 2, "weight")
    M, K = w.shape
    gemms = int(bool(_arg(args, kwargs, 6, "need_dx", True))) + int(bool(kwargs.get("need_dweight", True)))
    return 2.0 * (x.size // K) * K * M * gemms


def _attention_forward_flops(qkv) -> float:
    B, T, C3 = qkv.shape[-3:]
    return 4.0 * B * T * T * (C3 // 3) / 2          # causal: half of 4*B*NH*T*T*hd (gpucore/bench/attention.py)


def attention_forward_flops(result, args, kwargs) -> float:
    return _attention_forward_flops(_arg(args, kwargs, 0, "qkv"))


def attention_backward_flops(result, args, kwargs) -> float:
    return 2.5 * _attention_forward_flops(_arg(args, kwargs, 1, "qkv"))
