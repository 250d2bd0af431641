"""Start-up checks of a training run: the device, the memory, the output paths.

A run should fail in one clear line before it allocates anything or trains a
step, not with a traceback minutes later: each check here raises TrainError
(the CLI prints it and exits 1). gpucore/train.py calls them in its `prepare`
and `check_*` stages; they allocate nothing on the GPU.

    choose_device / resolve_backend   --device auto|cuda|cpu, --dtype -> (device, xp, dtype)
    check_host_memory / check_gpu_memory   the memory plan against the host (CPU) / the free GPU memory
    oom_message, oom_error_types      the one line for a GPU out-of-memory
    check_output_dir / check_metrics_file / trim_metrics   writable paths; resumed metrics
    peak_flops                        for MFU
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from .checkpoint import atomic_write

# Dense bf16 tensor-core peak of the GPUs we know (SXM parts), for MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


class TrainError(Exception):
    """A problem the user can fix, reported as one line."""


# ----------------------------------------------------------------- backend ----

def choose_device(device: str) -> tuple[str, str]:
    """(device, why) for --device auto|cuda|cpu; TrainError for cuda without a GPU."""
    from . import runtime
    if runtime.cupy is None:
        missing = "no NVIDIA GPU: CuPy is not installed"
    elif not runtime.gpu_available():
        missing = "no NVIDIA GPU found"
    else:
        missing = None
    if device == "cuda" and missing:
        raise TrainError(f"--device cuda: {missing}; use --device cpu")
    if device == "auto":
        return ("cpu", missing) if missing else ("cuda", f"found {gpu_name()}")
    return device, "asked for"


def resolve_backend(device: str, dtype: str = "auto"):
    """(device, xp, dtype) from the --device / --dtype choices."""
    from . import dtypes, runtime
    device, _ = choose_device(device)
    xp = runtime.cupy if device == "cuda" else np
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return device, xp, dtypes.normalize(dtype)


def gpu_name() -> str:
    from . import runtime
    name = runtime.device_properties()["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def gpu_memory_info():
    """(free, total) bytes of the current GPU, or None."""
    from . import runtime
    try:
        return runtime.cupy.cuda.runtime.memGetInfo()
    except Exception:
        return None


def available_host_memory() -> int | None:
    """Bytes the host can still give this process (MemAvailable, capped by a cgroup limit), or None."""
    avail = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError):   # a container's limit is below the host's memory
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = left if avail is None else min(avail, left)
    return avail


def oom_error_types():
    """The exception types of a GPU out-of-memory (none without CuPy)."""
    from . import runtime
    return (runtime.cupy.cuda.memory.OutOfMemoryError,) if runtime.cupy is not None else ()


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def format_plan(plan: dict) -> str:
    parts = [f"{k} {v / 2**20:,.1f}" for k, v in plan.items() if v]
    return "memory plan (MiB): " + " | ".join(parts) + f" | total {sum(plan.values()) / 2**30:.2f} GiB"


def oom_message(plan: dict | None) -> str:
    need = (f"about {sum(plan.values()) / 2**30:.1f} GiB for its buffers "
            f"({', '.join(f'{k} {_gib(v)}' for k, v in plan.items() if v)}) plus kernel scratch"
            if plan else "more memory")
    info = gpu_memory_info()
    have = f"; the GPU has {info[1] / 2**30:.1f} GiB ({info[0] / 2**30:.1f} GiB free)" if info else ""
    return (f"out of GPU memory: this run needs {need}{have}. "
            "Use a smaller -B (with --total-batch-size to keep the batch) or a smaller model")


def check_host_memory(plan: dict) -> None:
    """TrainError when the CPU backend's buffers (the memory plan: params, grads, AdamW m/v,
    master, activations, scratch) exceed the host's available memory; no check if unknown."""
    avail = available_host_memory()
    need = sum(plan.values())
    if avail is None or need <= avail:
        return
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in plan.items() if v)
    raise TrainError(f"not enough memory for the CPU backend: this run needs about {need / 2**30:.1f} GiB "
                     f"(GiB: {parts}) and {avail / 2**30:.1f} GiB is available; "
                     "use --model tiny or a smaller -B")


def check_gpu_memory(plan: dict) -> None:
    """TrainError, before anything is allocated, when the model's buffers alone (the memory plan)
    exceed the GPU's free memory: a model larger than the GPU (say d48 at a large -B on an 80 GB
    card). Kernel scratch comes on top, so passing this check does not promise the run fits;
    the out-of-memory message covers the rest."""
    info = gpu_memory_info()
    need = sum(plan.values())
    if info is None or need <= info[0]:
        return
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in plan.items() if v)
    raise TrainError(f"the model does not fit on the GPU: its buffers need about {need / 2**30:.1f} GiB "
                     f"(GiB: {parts}) and the GPU has {info[0] / 2**30:.1f} GiB free of {info[1] / 2**30:.1f}; "
                     "use a smaller -B (with --total-batch-size to keep the batch) or a smaller model")


def peak_flops(device: str, dtype) -> float | None:
    """Dense bf16 peak of the GPU for MFU (None on CPU, for fp32, or for an unknown GPU)."""
    from . import dtypes
    if device != "cuda" or dtype != dtypes.bfloat16:
        return None
    name = gpu_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


# ------------------------------------------------------------------- paths ----

def os_reason(e: OSError) -> str:
    """The short reason of an OSError (its strerror), for one-line messages."""
    return e.strerror or e.__class__.__name__


def check_output_dir(out_dir: Path) -> None:
    """Create out_dir and prove a file can be written there (TrainError otherwise)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:       # a file in the way (File exists / Not a directory), permissions
        raise TrainError(f"--out-dir {out_dir}: cannot create the directory ({os_reason(e)})") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=out_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise TrainError(f"--out-dir {out_dir}: cannot write there ({os_reason(e)})") from None


def check_metrics_file(path: Path) -> None:
    """Prove the metrics file can be opened for appending, without changing it (TrainError otherwise)."""
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as e:
        raise TrainError(f"--metrics {path}: cannot open it for writing ({os_reason(e)})") from None


def trim_metrics(path: Path, step: int) -> int:
    """Drop the rows a run resumed at `step` will write again; returns how many were dropped.

    Those are rows past `step` (steps the interrupted run took after its
    checkpoint) and the val loss at `step` itself (evaluated again at the
    resume point). A torn last line (a kill mid-write) is dropped too. The
    file is rewritten atomically, and only when something changes.
    """
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            s = rec.get("step")
            stale = s is not None and (s > step or (s == step and "val_loss" in rec))
        except (ValueError, AttributeError, TypeError):
            stale = True
        if stale:
            dropped += 1
        else:
            kept.append(line + "\n")
    if dropped:
        with atomic_write(path) as f:
            f.write("".join(kept).encode())
    return dropped
