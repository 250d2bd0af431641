"""`gpucore bench <name>`: kernel benchmarks against the measured hardware ceilings.

The framework lives here: a timer (CUDA events, warm-up, median of repeats),
the device-to-device copy bandwidth every memory-bound kernel is compared to
(cudaMemcpy D2D, counting bytes read + written), and a registry. Each family's
benchmarks live in their own module of this package (basic.py: add, sum, max,
cast) and register themselves with @benchmark.

Speed targets are printed here ("target" column), never asserted in pytest.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

BENCHES: dict[str, Callable] = {}


def benchmark(name: str):
    """Register `fn(**options) -> list[Result]` as `gpucore bench <name>`."""
    def deco(fn):
        BENCHES[name] = fn
        return fn
    return deco


@dataclass
class Result:
    name: str
    ms: float
    bytes: float = 0.0         # bytes moved through device memory (the minimum)
    flops: float = 0.0
    ref_gbps: float = 0.0      # copy bandwidth to compare with
    ref_tflops: float = 0.0    # e.g. cuBLAS at the same shape
    target: float | None = None  # required fraction of the reference, if any
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self):
        return self.bytes / self.ms / 1e6 if self.bytes else 0.0

    @property
    def tflops(self):
        return self.flops / self.ms / 1e9 if self.flops else 0.0

    @property
    def fraction(self):
        if self.bytes and self.ref_gbps:
            return self.gbps / self.ref_gbps
        if self.flops and self.ref_tflops:
            return self.tflops / self.ref_tflops
        return None

    def line(self) -> str:
        parts = [f"{self.name:<44s} {self.ms:9.4f} ms"]
        if self.bytes:
            parts.append(f"{self.gbps:8.1f} GB/s")
        if self.flops:
            parts.append(f"{self.tflops:8.1f} TFLOP/s")
        if self.fraction is not None:
            parts.append(f"{100 * self.fraction:5.1f}% of {'copy' if self.bytes else 'ref'}")
        if self.target is not None and self.fraction is not None:
            parts.append(f"target {100 * self.target:.0f}%: {'PASS' if self.fraction >= self.target else 'FAIL'}")
        for k, v in self.extra.items():
            parts.append(f"{k}={v}")
        return "  ".join(parts)


def _time_batch(fn: Callable[[], object], repeat: int) -> float:
    """Milliseconds per call of `repeat` calls of fn queued between two CUDA events."""
    import cupy
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeat):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / repeat


def time_ms(fn: Callable[[], object], warmup: int = 3, repeat: int = 10, batches: int = 5) -> float:
    """Milliseconds per fn() call on the current stream, timed with CUDA events.

    Calls are queued back to back (`repeat` per event pair), as a training
    loop queues them, so host launch overhead is hidden unless it exceeds the
    kernel time; the median over `batches` pairs is returned.
    """
    import cupy
    for _ in range(warmup):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    return statistics.median(_time_batch(fn, repeat) for _ in range(batches))


def time_interleaved(fns, rounds: int = 9, repeat: int = 10) -> list[float]:
    """Median milliseconds per call of each fn, timed in alternation.

    For comparisons (our path vs the library it wraps): clocks and the memory
    system drift between back-to-back measurements by more than the few
    percent being compared, so each round times every fn once, and each fn's
    median over the rounds is returned.
    """
    import cupy
    for fn in fns:
        fn()
    cupy.cuda.get_current_stream().synchronize()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            times[i].append(_time_batch(fn, repeat))
    return [statistics.median(t) for t in times]


def time_device_ms(fn, repeat: int = 10, batches: int = 5, lead_fills: int = 48) -> float:
    """Milliseconds of device time per fn() call, host launch overhead excluded.

    time_ms measures host time when a call's Python + launch overhead exceeds its GPU time
    (the encoder backward: ~10 launches, events, a CuPy sort). A training step hides that
    overhead because the host runs ahead of the GPU; this timer reproduces it: each batch
    first queues a head start of large memsets (~3 ms of GPU work), then the start event and
    `repeat` calls, which the host queues while the GPU is still busy with the memsets.
    """
    import cupy
    lead = cupy.empty(256 << 20, dtype=np.uint8)
    for _ in range(3):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(batches):
        for _ in range(lead_fills):
            lead.fill(0)
        times.append(_time_batch(fn, repeat))
    del lead
    return statistics.median(times)


def random_array(shape, dtype, scale=1.0):
    """Standard-normal data * scale on the GPU, in `dtype` (never zeros: they time too well)."""
    import cupy

    from .. import dtypes
    return (cupy.random.standard_normal(shape, dtype=np.float32) * scale).astype(dtypes.normalize(dtype))


def dtype_list(dtype):
    """--dtype all|float32|bfloat16 -> the dtypes to run (default bfloat16)."""
    return ["float32", "bfloat16"] if dtype == "all" else [dtype or "bfloat16"]


def version_list(version, available):
    """--version all|N|N,M -> the integer versions to run among `available`."""
    if version in (None, "all"):
        return list(available)
    return [int(v) for v in str(version).split(",") if int(v) in available]


def available_versions(pick, versions, *args, **kwargs) -> list[int]:
    """The versions among `versions` that an ops module's picker accepts for these arguments:
    pick(version, *args, **kwargs) returns for them and raises ValueError for the others
    (ops.softmax.pick_version, ops.layernorm.pick_version, ops.encoder.pick_version, ...)."""
    out = []
    for v in versions:
        try:
            pick(v, *args, **kwargs)
        except ValueError:
            continue
        out.append(v)
    return out


_COPY_GBPS: dict[int, float] = {}


def copy_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device memcpy bandwidth in GB/s, counting bytes read + written."""
    import cupy
    dev = cupy.cuda.Device().id
    if dev not in _COPY_GBPS:
        src = cupy.random.random(nbytes // 4, dtype=np.float32)
        dst = cupy.empty_like(src)
        ms = time_ms(lambda: cupy.cuda.runtime.memcpyAsync(
            dst.data.ptr, src.data.ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice,
            cupy.cuda.get_current_stream().ptr))
        _COPY_GBPS[dev] = 2 * nbytes / ms / 1e6
        del src, dst
    return _COPY_GBPS[dev]


def device_name() -> str:
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def run(name: str, **options) -> list[Result]:
    if name not in BENCHES:
        raise KeyError(f"unknown benchmark {name!r}; known: {', '.join(sorted(BENCHES))}")
    return BENCHES[name](**options)


from . import basic  # noqa: E402,F401  (registers add, sum, max, cast)
from . import matmul  # noqa: E402,F401  (registers matmul)
from . import optim_loss  # noqa: E402,F401  (registers softmax, classifier, adamw, grad_norm)
from . import attention  # noqa: E402,F401  (registers attention)
from . import transformer  # noqa: E402,F401  (registers encoder, layernorm, gelu)
