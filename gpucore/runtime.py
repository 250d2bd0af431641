"""Kernel runtime: device discovery, compiling and caching kernels_cu/*.cu, launching.

Each kernel file (`kernels_cu/<family>.cu`, or `kernels_cu/<family>/<part>.cu` for a
family spread over several files; loaded by the name "<family>" or "<family>/<part>") is compiled by NVRTC (through CuPy's own compiler
entry point and options) into a cubin for one GPU architecture. We compile
ourselves instead of letting `cupy.RawModule(code=...)` do it because:

- CuPy's cache key ignores the content of `#include`d headers; ours hashes the
  source, every header it includes (transitively), the arch, the options and
  the NVRTC version;
- the same function must work on a machine with no GPU (`gpucore kernels
  check`), where CuPy's run-time path fails looking up the current device;
- a compile error should name `kernels_cu/<file>.cu:<line>`.

Compiled modules are cached in memory per (family, arch, options) and on disk
as cubin files under $GPUCORE_CACHE_DIR (default ~/.cache/gpucore/kernels).
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:  # CuPy is optional: without it, only the NumPy reference backend works.
    import cupy
except ImportError:  # pragma: no cover - exercised on machines without cupy
    cupy = None


def _find_kernel_dir() -> Path:
    env = os.environ.get("GPUCORE_KERNEL_DIR")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parent.parent / "kernels_cu"
    if repo.is_dir():  # running from a checkout (PYTHONPATH=. or editable install)
        return repo
    import gpucore.kernels_cu as installed  # wheel install: shipped as package data
    return Path(installed.__file__).parent


KERNEL_DIR = _find_kernel_dir()
CACHE_DIR = Path(os.environ.get("GPUCORE_CACHE_DIR", Path.home() / ".cache" / "gpucore" / "kernels"))

# Options every kernel is compiled with. No fast-math: results must match the
# NumPy reference; kernels call the fast intrinsics (__expf ...) explicitly.
BASE_OPTIONS = ("--std=c++17",)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel file. `.file`/`.line` point at the first error; `.log` is NVRTC's log."""

    def __init__(self, file: str, line: int | None, log: str):
        self.file, self.line, self.log = file, line, log
        where = f"{file}:{line}" if line is not None else file
        first = next((ln for ln in log.splitlines() if "error" in ln), log.strip()[:200])
        super().__init__(f"{where}: CUDA compile error: {first.strip()}\n--- NVRTC log ---\n{log}")


# ---------------------------------------------------------------- devices ----

def gpu_available() -> bool:
    """True when CuPy is importable and a CUDA device answers."""
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def is_gpu_array(x) -> bool:
    return cupy is not None and isinstance(x, cupy.ndarray)


def array_module(*arrays):
    """cupy if any argument is a CuPy array, else numpy. Mixing the two is an error."""
    gpu = [is_gpu_array(a) for a in arrays if a is not None]
    if any(gpu) and not all(gpu):
        raise TypeError("arrays must all be NumPy (CPU reference) or all CuPy (GPU); got a mix")
    return cupy if gpu and gpu[0] else np


def device_arch() -> str:
    """Compute capability of the current device as 'MAJOR MINOR' digits, e.g. '90'."""
    return str(cupy.cuda.Device().compute_capability)


def device_properties() -> dict:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return props


_DEVICE_ATTRS: dict[tuple, int] = {}


def device_attribute(name: str) -> int:
    """A cudaDevAttr* of the current device (name without the prefix), read once per device."""
    dev = cupy.cuda.Device().id
    key = (dev, name)
    if key not in _DEVICE_ATTRS:
        _DEVICE_ATTRS[key] = cupy.cuda.runtime.deviceGetAttribute(getattr(cupy.cuda.runtime, "cudaDevAttr" + name),
                                                                  dev)
    return _DEVICE_ATTRS[key]


def sm_count() -> int:
    """The current device's SM count."""
    return device_attribute("MultiProcessorCount")


BLOCK_RESERVED_BYTES = 1024     # shared memory the driver reserves per block (sm_80+)
# (id(kernel), ...) -> (kernel, blocks): the kernel is kept so that its id cannot be reused by
# another kernel object (a RawModule's get_function makes a new one each call; probes load
# other trees' modules so) while the entry stands.
_RESIDENT: dict[tuple, tuple] = {}


def resident_blocks(kernel, block: int, dynamic_smem: int = 0, sm_shared_bytes: int | None = None) -> int:
    """Blocks of `block` threads one SM holds at once: the least of what its registers, threads and
    shared memory allow (static + `dynamic_smem` + the reserved 1 KB per block). sm_shared_bytes:
    the SM's shared memory, by default the device's (cudaDevAttrMaxSharedMemoryPerMultiprocessor).
    For persistent grids: sm_count() * resident_blocks(...) blocks all run in one wave."""
    smem_sm = device_attribute("MaxSharedMemoryPerMultiprocessor") if sm_shared_bytes is None else sm_shared_bytes
    key = (id(kernel), block, dynamic_smem, smem_sm)
    if key not in _RESIDENT:
        a = kernel_attributes(kernel)
        regs_per_warp = -(-max(a["registers"], 1) * 32 // 256) * 256      # allocated per warp, in 256s
        by_regs = (65536 // regs_per_warp) // (block // 32)
        by_threads = device_attribute("MaxThreadsPerMultiProcessor") // block
        by_smem = smem_sm // (a["shared_bytes"] + dynamic_smem + BLOCK_RESERVED_BYTES)
        _RESIDENT[key] = (kernel, max(1, min(by_regs, by_threads, by_smem, 32)))
    return _RESIDENT[key][1]


# -------------------------------------------------------------- compiling ----

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def kernel_files() -> list[Path]:
    """Every kernel file: kernels_cu/*.cu, the families in folders (kernels_cu/<family>/*.cu)
    and the ladders (kernels_cu/ladder/<family>/*.cu)."""
    return sorted(KERNEL_DIR.rglob("*.cu"))


def _source_path(family_or_path) -> Path:
    p = Path(family_or_path)
    if p.suffix == ".cu" or p.is_absolute() or p.exists():
        return p
    return KERNEL_DIR / f"{family_or_path}.cu"


def _included_headers(src: str, base: Path, seen: dict[Path, str]) -> None:
    for name in _INCLUDE_RE.findall(src):
        for d in (base, KERNEL_DIR):
            h = (d / name).resolve()
            if h.is_file():
                if h not in seen:
                    seen[h] = h.read_text()
                    _included_headers(seen[h], h.parent, seen)
                break


def _nvrtc_version() -> str:
    try:
        return ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
    except Exception:
        return "unknown"


def cache_key(path: Path, arch: str, options: tuple[str, ...]) -> str:
    """Hash of the source, every header it includes, the arch, options and NVRTC version."""
    src = path.read_text()
    headers: dict[Path, str] = {}
    _included_headers(src, path.parent, headers)
    h = hashlib.sha256()
    for part in (src, *[f"{k.name}\0{v}" for k, v in sorted(headers.items())],
                 arch, "\0".join(options), _nvrtc_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _display_name(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(KERNEL_DIR.parent))
    except ValueError:
        return str(path)


def _nvrtc_options(arch: str, options: tuple[str, ...], path: Path) -> tuple[str, ...]:
    from cupy._core import core  # CuPy's include paths (its own headers, CUDA's)
    return core.assemble_cupy_compiler_options(
        BASE_OPTIONS + tuple(options) + (f"-I{KERNEL_DIR}", f"-I{path.parent}", f"-arch=sm_{arch}"))


@dataclass
class CompileResult:
    cubin: bytes
    log: str           # NVRTC log, including ptxas' -v report when asked
    file: str


def compile_cubin(family_or_path, arch: str, options: tuple[str, ...] = (), verbose_ptxas=False) -> CompileResult:
    """Compile one .cu file to a cubin for sm_<arch>. Works without a GPU.

    Raises KernelCompileError naming file:line on a compile error.
    """
    if cupy is None:
        raise RuntimeError("compiling kernels needs CuPy: pip install 'gpucore[cuda12]' (or cuda13)")
    from cupy.cuda import compiler
    path = _source_path(family_or_path)
    name = _display_name(path)
    opts = _nvrtc_options(arch, options, path)
    if verbose_ptxas:
        opts = opts + ("--ptxas-options=-v",)
    prog = compiler._NVRTCProgram(path.read_text(), name, method="cubin")
    log = io.StringIO()
    try:
        cubin, _ = prog.compile(opts, log_stream=log)
    except compiler.CompileException as e:
        text = e.get_message() if hasattr(e, "get_message") else str(e)
        m = re.search(r"^(.*?)\((\d+)\): (?:catastrophic )?error", text, re.MULTILINE)
        file, line = (m.group(1), int(m.group(2))) if m else (name, None)
        raise KernelCompileError(file, line, text) from None
    return CompileResult(cubin, log.getvalue(), name)


_MODULES: dict[tuple, object] = {}


def load_module(family: str, options: tuple[str, ...] = (), arch: str | None = None):
    """The compiled `cupy.RawModule` of kernels_cu/<family>.cu for the current device."""
    arch = arch or device_arch()
    options = tuple(options)
    path = _source_path(family)
    key = cache_key(path, arch, options)
    mem_key = (str(path), arch, options, key)
    mod = _MODULES.get(mem_key)
    if mod is not None:
        return mod
    cubin_path = CACHE_DIR / f"{path.stem}-sm{arch}-{key}.cubin"
    if not cubin_path.is_file():
        result = compile_cubin(path, arch, options)
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=CACHE_DIR, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:   # atomic: never leave a half-written cubin
            f.write(result.cubin)
        os.replace(tmp, cubin_path)
    mod = cupy.RawModule(path=str(cubin_path))
    _MODULES[mem_key] = mod
    return mod


_KERNELS: dict[tuple, object] = {}


def get_kernel(family: str, name: str, options: tuple[str, ...] = (), arch: str | None = None):
    """One `extern "C"` kernel of kernels_cu/<family>.cu (a cupy.RawKernel).

    Memoized per (device, family, name, options, arch): launching must cost
    microseconds of host time, so the source is read and hashed only on the
    first call in a process (edit a .cu file -> restart Python).
    """
    key = (cupy.cuda.runtime.getDevice(), family, name, tuple(options), arch)
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = load_module(family, options, arch).get_function(name)
    return kernel


def kernel_attributes(kernel) -> dict:
    """Registers, local (spilled) memory and static shared memory of a loaded kernel."""
    a = kernel.attributes
    return {"registers": a["num_regs"], "local_bytes": a["local_size_bytes"],
            "shared_bytes": a["shared_size_bytes"], "max_threads": a["max_threads_per_block"]}


_SIDE_STREAMS: dict[tuple, tuple] = {}


def side_stream(name: str):
    """(stream, fork event, join event) for work that runs beside the current stream, made once
    per (device, name). The caller records `fork` on its stream, makes the side stream wait on
    it, launches there, records `join` there and makes its own stream wait on `join`."""
    key = (cupy.cuda.Device().id, name)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Event(disable_timing=True),
                              cupy.cuda.Event(disable_timing=True))
    return _SIDE_STREAMS[key]


def launch(kernel, grid, block, args, shared_mem: int = 0, stream=None):
    """Launch on the current CuPy stream (or `stream`), raising CUDA errors at once."""
    grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,)))
    block = tuple(int(b) for b in (block if isinstance(block, tuple) else (block,)))
    if shared_mem and _DYNAMIC_SMEM_SET.get(id(kernel), 0) < shared_mem:
        # A block's static + dynamic shared memory over 48 KB needs the kernel's opt-in, even when
        # the dynamic part alone is under 48 KB (once per kernel and larger size).
        if shared_mem + kernel_attributes(kernel)["shared_bytes"] > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = int(shared_mem)
        _DYNAMIC_SMEM_SET[id(kernel)] = int(shared_mem)
    kernel(grid, block, args, shared_mem=int(shared_mem), stream=stream)


_DYNAMIC_SMEM_SET: dict[int, int] = {}   # id(kernel) -> the largest dynamic shared memory it was launched with


# -------------------------------------------------- compile check (no GPU) ---

_PTXAS_FN_RE = re.compile(r"Compiling entry function '([^']+)' for 'sm_(\w+)'")
_PTXAS_SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REG_RE = re.compile(r"Used (\d+) registers")


def ptxas_report(log: str) -> list[dict]:
    """Per-kernel registers / stack / spills parsed from ptxas -v output."""
    rows, cur = [], None
    for line in log.splitlines():
        m = _PTXAS_FN_RE.search(line)
        if m:
            cur = {"kernel": m.group(1), "registers": None, "stack": 0, "spill_stores": 0, "spill_loads": 0}
            rows.append(cur)
            continue
        if cur is None:
            continue
        m = _PTXAS_SPILL_RE.search(line)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
        m = _PTXAS_REG_RE.search(line)
        if m:
            cur["registers"] = int(m.group(1))
    return rows


def _cached_compile_paths(path: Path, arch: str) -> tuple[Path, Path]:
    """(cubin, ptxas report) cache files of (file, arch): load_module's cubin name and key (no options)."""
    base = f"{path.stem}-sm{arch}-{cache_key(path, arch, ())}"
    return CACHE_DIR / f"{base}.cubin", CACHE_DIR / f"{base}.ptxas.json"


def _compile_report(path: Path, arch: str) -> list[dict]:
    """ptxas' per-kernel report for one file and arch: from the disk cache, or by compiling once.

    The cubin of that compile is cached too (what load_module would compile),
    so a later run on a GPU of this arch does not compile the file again.
    Raises KernelCompileError (never cached: a broken file is compiled anew).
    """
    import json
    cubin_path, cached = _cached_compile_paths(path, arch)
    try:
        return json.loads(cached.read_text())["kernels"]
    except (OSError, ValueError, KeyError, TypeError):
        pass    # not cached yet, or an unreadable cache file: compile
    res = compile_cubin(path, arch, verbose_ptxas=True)
    report = ptxas_report(res.log)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    for data, target in ((res.cubin, cubin_path),
                         (json.dumps({"kernels": report}).encode(), cached)):
        fd, tmp = tempfile.mkstemp(dir=CACHE_DIR, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:   # atomic: a concurrent check never reads half a file
            f.write(data)
        os.replace(tmp, target)
    return report


def check_kernels(archs=("80", "90"), files=None) -> list[dict]:
    """Compile every kernel file for each arch; return one row per kernel.

    A row has 'ok' False on a compile error (with 'error') or a spill.
    ptxas' report is cached on disk (CACHE_DIR, keyed by cache_key like the
    cubins), so checking an unchanged file again does not compile it.
    """
    rows = []
    for path in (files or kernel_files()):
        path = Path(path)
        for arch in archs:
            try:
                report = _compile_report(path, arch)
            except KernelCompileError as e:
                rows.append({"file": _display_name(path), "arch": arch, "kernel": "-", "ok": False,
                             "error": str(e).splitlines()[0]})
                continue
            for r in report:
                spilled = r["spill_stores"] > 0 or r["spill_loads"] > 0
                rows.append({"file": _display_name(path), "arch": arch, "ok": not spilled,
                             "error": "local-memory spill" if spilled else "", **r})
    return rows
