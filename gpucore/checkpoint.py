"""Checkpoints: named arrays + JSON metadata in one self-checking file, written atomically.

A training run saves its whole state (parameters, AdamW moments, step, data
loader position, RNG state, config) with `save_checkpoint` and resumes with
`load_checkpoint`. Two properties matter more than speed:

- an existing checkpoint is never damaged: the new one is written to a
  temporary file in the same directory, fsync'ed, then renamed over the old
  one (os.replace is atomic on POSIX), so a crash or a full disk leaves either
  the old file or the new one, never half of each;
- a damaged file is refused with one clear `CheckpointError` instead of
  silently resuming from garbage: every byte is covered by a length check and
  a SHA-256.

File layout (little-endian; every array starts at a 64-byte aligned offset so
it can be memory-mapped or read straight into an aligned buffer):

    [0, 64)          prefix: magic b"GPUCKPT\\0", version u32, reserved u32,
                     header length u64, SHA-256 of the header (32 bytes), zero pad
    [64, 64+H)       header, UTF-8 JSON:
                     {"meta": {...}, "arrays": [{"name", "dtype", "shape",
                      "offset", "nbytes", "sha256"}, ...], "file_size": N}
    [.., N)          raw C-order array bytes at their "offset"s

The header is written twice: first with zero checksums to reserve its space,
then, after the data was streamed out and hashed, again with the real ones
(same length). Streaming keeps host memory at one array at a time when the
arrays come from the GPU (CuPy arrays are copied to the host with .get()).
bfloat16 arrays (ml_dtypes) are stored as their 2-byte patterns with dtype
"bfloat16" and come back as ml_dtypes.bfloat16.

On top of the format, the training checkpoints of gpucore.train (the end of
this file): `ckpt_<step>.ckpt` files in a run's out-dir holding the flat
parameters, AdamW state, data position and RNG; finding the newest intact one
(a corrupt newest file is skipped, with a note), keeping only the last N, and
removing the temporary files a save killed mid-write leaves behind.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
import tempfile
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from . import runtime

MAGIC = b"GPUCKPT\0"
VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sIIQ32s")     # magic, version, reserved, header length, header sha256
PREFIX_SIZE = ALIGN                      # _PREFIX.size (56) padded to the alignment
_ZERO_SHA = "0" * 64
_CHUNK = 64 << 20                        # bytes hashed/written per call: bounds the temporary copies


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt, or not a gpucore checkpoint."""


# ------------------------------------------------------------ atomic writes ----

_TMP_SUFFIX = ".tmp"     # atomic_write's temporary file for <dir>/<name>: <dir>/.<name>.<random>.tmp


@contextlib.contextmanager
def atomic_write(path):
    """Open a temporary file next to `path` for binary writing; on success, fsync and rename it to `path`.

    On any exception the temporary file is removed and `path` is untouched.
    The temporary file is in the same directory because os.replace is only
    atomic within one file system. Parent directories are created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(f.fileno(), 0o666 & ~umask)  # mkstemp makes 0600; give a new file's usual mode
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def remove_stale_temp_files(directory, name_glob: str, min_age_s: float = 60.0) -> list[Path]:
    """Delete the temporary files atomic_write left in `directory` for files named like `name_glob`.

    A process killed mid-save (SIGKILL, power loss) cannot remove its temporary
    file, and nothing else ever would. Only files untouched for `min_age_s`
    are removed: a save in progress writes to its file continuously, so a
    recent one may belong to a live process. Returns the removed paths.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed, now = [], time.time()
    for p in sorted(directory.glob(f".{name_glob}.*{_TMP_SUFFIX}")):
        try:
            if p.is_file() and now - p.stat().st_mtime >= min_age_s:
                p.unlink()
                removed.append(p)
        except OSError:      # gone already, or not ours to delete: leave it
            pass
    return removed


def _fsync_dir(d: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------ dtypes ----

_BF16 = np.dtype(ml_dtypes.bfloat16)


def _dtype_name(dt: np.dtype) -> str:
    if dt == _BF16:
        return "bfloat16"
    if dt.kind not in "biuf":
        raise TypeError(f"dtype {dt} cannot be stored in a checkpoint (numbers only: bool, int, uint, float, bfloat16)")
    return dt.newbyteorder("<").str  # e.g. '<f4': explicit byte order, portable


def _parse_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        return _BF16
    dt = np.dtype(name)
    if dt.kind not in "biuf":
        raise ValueError(f"unsupported dtype {name!r}")
    return dt


def _to_host(name: str, a) -> np.ndarray:
    """A C-contiguous little-endian NumPy array of `a` (CuPy arrays are copied from the GPU)."""
    if runtime.is_gpu_array(a):
        a = a.get()
    if not isinstance(a, (np.ndarray, np.generic, int, float, bool)):
        raise TypeError(f"arrays[{name!r}]: expected a NumPy or CuPy array, got {type(a).__name__}")
    a = np.asarray(a)
    _dtype_name(a.dtype)  # raises TypeError for object/string/complex arrays
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes 0-d arrays 1-d)


def _json_default(o):
    """Let NumPy scalars/arrays in meta through (a step counter is often np.int64)."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"meta: a {type(o).__name__} is not JSON-serializable")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _byte_view(a: np.ndarray) -> memoryview:
    # reshape(-1) first: a 0-d array cannot change its dtype; uint8 because the
    # buffer protocol does not know ml_dtypes.bfloat16.
    return memoryview(a.reshape(-1).view(np.uint8))


# -------------------------------------------------------------------- save ----

def save_checkpoint(path, arrays: dict, meta: dict | None = None) -> int:
    """Write `arrays` (name -> NumPy/CuPy array) and JSON-able `meta` to `path` atomically.

    Returns the file size in bytes. Raises TypeError for a non-array value, a
    non-numeric dtype or non-JSON-able meta, before anything is written; if
    writing fails midway (disk full, a GPU error in .get()), the previous file
    at `path`, if any, is left intact.
    """
    if not isinstance(arrays, dict):
        raise TypeError(f"arrays: expected a dict of name -> array, got {type(arrays).__name__}")
    meta = {} if meta is None else meta
    if not isinstance(meta, dict):
        raise TypeError(f"meta: expected a dict, got {type(meta).__name__}")
    for name in arrays:
        if not isinstance(name, str):
            raise TypeError(f"arrays: names must be str, got {name!r}")

    # Shapes and dtypes are known without copying anything off the GPU, so the
    # whole layout (and the header size) is fixed before the first byte is written.
    entries, offset = [], 0
    for name, a in arrays.items():
        dt = np.dtype(a.dtype) if hasattr(a, "dtype") else np.asarray(a).dtype
        shape = tuple(int(s) for s in (a.shape if hasattr(a, "shape") else np.shape(a)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        entries.append({"name": name, "dtype": _dtype_name(dt), "shape": list(shape),
                        "offset": offset, "nbytes": nbytes, "sha256": _ZERO_SHA})
        offset = _align(offset + nbytes)
    try:
        meta_json = json.dumps(meta, default=_json_default)
    except (TypeError, ValueError) as e:
        raise TypeError(f"meta must be JSON-serializable: {e}") from None

    def header_bytes(data_start: int) -> bytes:
        for e in entries:
            e["abs_offset"] = data_start + e["offset"]
        doc = {"meta": json.loads(meta_json),
               "arrays": [{k: e[k] for k in ("name", "dtype", "shape", "nbytes", "sha256")}
                          | {"offset": e["abs_offset"]} for e in entries],
               "file_size": data_start + (entries[-1]["offset"] + entries[-1]["nbytes"] if entries else 0)}
        return json.dumps(doc, separators=(",", ":")).encode()

    # Offsets are decimal numbers inside the header, so its length depends on
    # where the data starts: iterate to the fixed point (converges in 1-2 rounds).
    data_start = PREFIX_SIZE
    while True:
        hdr = header_bytes(data_start)
        new_start = _align(PREFIX_SIZE + len(hdr))
        if new_start == data_start:
            break
        data_start = new_start

    with atomic_write(path) as f:
        f.write(b"\0" * data_start)  # prefix + header placeholder, rewritten below
        for e, (name, a) in zip(entries, arrays.items()):
            host = _to_host(name, a)
            if host.dtype != _parse_dtype(e["dtype"]) or list(host.shape) != e["shape"]:
                raise TypeError(f"arrays[{name!r}]: dtype/shape changed while saving")
            f.seek(e["abs_offset"])
            h = hashlib.sha256()
            view = _byte_view(host)
            for i in range(0, len(view), _CHUNK):
                h.update(view[i:i + _CHUNK])
                f.write(view[i:i + _CHUNK])
            e["sha256"] = h.hexdigest()
        end = data_start + (entries[-1]["offset"] + entries[-1]["nbytes"] if entries else 0)
        f.truncate(end)  # the last array may be empty; the file ends where the data ends
        final = header_bytes(data_start)
        assert len(final) == len(hdr)  # fixed-width checksums: same length as the placeholder
        f.seek(0)
        f.write(_PREFIX.pack(MAGIC, VERSION, 0, len(final), hashlib.sha256(final).digest()))
        f.write(b"\0" * (PREFIX_SIZE - _PREFIX.size))
        f.write(final)
    return end


# -------------------------------------------------------------------- load ----

def _read_header(f, path, size: int) -> dict:
    head = f.read(PREFIX_SIZE)
    if len(head) < PREFIX_SIZE:
        if head[:len(MAGIC)] != MAGIC[:len(head)]:
            raise CheckpointError(f"{path}: not a gpucore checkpoint (bad magic, {size} bytes)")
        raise CheckpointError(f"{path}: truncated checkpoint ({size} bytes, the prefix alone is {PREFIX_SIZE})")
    magic, version, _, hlen, hsha = _PREFIX.unpack(head[:_PREFIX.size])
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a gpucore checkpoint (bad magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint version {version} (this gpucore reads {VERSION})")
    if PREFIX_SIZE + hlen > size:
        raise CheckpointError(f"{path}: truncated checkpoint ({size} bytes, its header alone needs "
                              f"{PREFIX_SIZE + hlen})")
    f.seek(PREFIX_SIZE)
    raw = f.read(hlen)
    if hashlib.sha256(raw).digest() != hsha:
        raise CheckpointError(f"{path}: corrupt checkpoint (header checksum mismatch)")
    try:
        doc = json.loads(raw)
        expected = int(doc["file_size"])
        for e in doc["arrays"]:
            e["dtype_np"] = _parse_dtype(e["dtype"])
            e["shape"] = tuple(int(s) for s in e["shape"])
            n = int(np.prod(e["shape"], dtype=np.int64)) * e["dtype_np"].itemsize
            if n != e["nbytes"] or e["offset"] < PREFIX_SIZE + hlen or e["offset"] + n > expected:
                raise ValueError(f"array {e['name']!r} has inconsistent size/offset")
        if not isinstance(doc["meta"], dict):
            raise TypeError("meta is not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: corrupt checkpoint (bad header: {e})") from None
    if size != expected:
        what = "truncated" if size < expected else "corrupt"
        raise CheckpointError(f"{path}: {what} checkpoint (file has {size} bytes, header says {expected})")
    return doc


def _open(path):
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint not found") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, expected a checkpoint file") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open checkpoint ({e.strerror})") from None
    return path, f


def load_checkpoint_meta(path) -> dict:
    """Only the JSON metadata of a checkpoint (cheap: reads the header, not the arrays).

    The header checksum and the file size are still checked.
    """
    path, f = _open(path)
    with f:
        return _read_header(f, path, os.fstat(f.fileno()).st_size)["meta"]


def load_checkpoint(path, verify: bool = True) -> tuple[dict, dict]:
    """Read a checkpoint: (arrays: name -> NumPy array, meta: dict).

    Validates magic, version, header checksum, sizes and (verify=True) every
    array's SHA-256; any failure raises CheckpointError naming the file and
    the problem. Arrays come back as fresh, writable NumPy arrays in their
    saved dtype (bfloat16 as ml_dtypes.bfloat16).
    """
    path, f = _open(path)
    with f:
        doc = _read_header(f, path, os.fstat(f.fileno()).st_size)
        arrays = {}
        for e in doc["arrays"]:
            a = np.empty(e["shape"], dtype=e["dtype_np"])
            view = _byte_view(a)
            f.seek(e["offset"])
            h = hashlib.sha256()
            for i in range(0, len(view), _CHUNK):  # chunks: one read() returns at most ~2 GB on Linux
                chunk = view[i:i + _CHUNK]
                if f.readinto(chunk) != len(chunk):
                    raise CheckpointError(f"{path}: truncated checkpoint (array {e['name']!r} is cut short)")
                if verify:
                    h.update(chunk)
            if verify and h.hexdigest() != e["sha256"]:
                raise CheckpointError(f"{path}: corrupt checkpoint (checksum mismatch in array {e['name']!r})")
            arrays[e["name"]] = a
    return arrays, doc["meta"]


# ------------------------------------------------------ training checkpoints ----

CHECKPOINT_FORMAT = "gpucore-gpt2-train"
CHECKPOINT_GLOB = "ckpt_*.ckpt"
_CHECKPOINT_RE = re.compile(r"ckpt_(\d+)\.ckpt$")


def checkpoint_path(out_dir, step: int) -> Path:
    return Path(out_dir) / f"ckpt_{step:06d}.ckpt"


def list_checkpoints(directory) -> list[tuple[int, Path]]:
    """(step, path) of every ckpt_<step>.ckpt in `directory`, oldest step first.

    Sorted by the parsed step, not the name: past step 999999 the names stop
    sorting by step.
    """
    found = []
    for p in Path(directory).glob(CHECKPOINT_GLOB):
        m = _CHECKPOINT_RE.fullmatch(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def find_checkpoint(path) -> Path:
    """A checkpoint file, or the ckpt_*.ckpt with the highest step in a directory."""
    p = Path(path)
    if p.is_dir():
        found = list_checkpoints(p)
        if not found:
            raise CheckpointError(f"{p}: no checkpoints ({CHECKPOINT_GLOB}) in this directory")
        return found[-1][1]
    return p


def prune_checkpoints(out_dir, keep_last: int, newest_step: int) -> list[Path]:
    """Delete the checkpoints of `out_dir` older than the `keep_last` newest up to `newest_step`.

    Checkpoints past `newest_step` (left by an earlier run that went further
    before this one resumed from an older step) are not this run's to judge
    and stay. keep_last 0 keeps everything. Returns the deleted paths.
    """
    if keep_last <= 0:
        return []
    ours = [p for step, p in list_checkpoints(out_dir) if step <= newest_step]
    doomed = ours[:-keep_last]
    for p in doomed:
        p.unlink(missing_ok=True)
    return doomed


def save_training_checkpoint(path, model, optimizer, *, step, preset, train_loader=None, rng=None,
                             args=None, data_state=None, rng_state=None) -> int:
    """Save a run's whole state to `path` (atomically); returns the file size.

    data_state / rng_state override what train_loader / rng hold now: an
    interrupted step may have moved them past the last completed step.
    `args` (a dataclass or dict) is recorded for reference.
    """
    from . import dtypes
    if data_state is None and train_loader is not None:
        data_state = train_loader.state_dict()
    if rng_state is None and rng is not None:
        rng_state = rng.bit_generator.state
    arrays = {"params": model.params.flat(), **optimizer.state_arrays()}
    if hasattr(optimizer, "eval_params"):     # schedule-free: the weights to evaluate and export are x
        arrays["averaged"] = optimizer.eval_params()
    meta = {"format": CHECKPOINT_FORMAT, "version": 1, "preset": preset, "config": model.config.to_dict(),
            "dtype": dtypes.name(model.dtype), "step": int(step), "optimizer": optimizer.state_meta(),
            "data": data_state, "rng": rng_state,
            "args": asdict(args) if is_dataclass(args) else args}
    fp8 = getattr(model, "fp8", None)
    if fp8 is not None:           # the FP8 scales, so that a resumed run casts as the run would have
        st = fp8.scaling.state()
        arrays["fp8_scale"], arrays["fp8_history"] = st["scale"], st["history"]
        meta["fp8"] = {"mode": fp8.scaling.mode, "started": [bool(b) for b in st["started"]],
                       "step_index": st["step_index"]}
        if getattr(fp8, "fch_scaling", None) is not None:     # fch kept as E4M3: its delayed scales
            st = fp8.fch_scaling.state()
            arrays["fp8_fch_scale"], arrays["fp8_fch_history"] = st["scale"], st["history"]
            meta["fp8"]["fch"] = {"started": [bool(b) for b in st["started"]], "step_index": st["step_index"]}
    return save_checkpoint(path, arrays, meta)


def _read_one_training_checkpoint(path: Path):
    from .model import GPT2Config
    arrays, meta = load_checkpoint(path)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not a gpucore training checkpoint (format {meta.get('format')!r})")
    try:
        cfg = GPT2Config.from_dict(meta["config"])
        n = cfg.num_parameters
        first = "z" if "z" in arrays else "m"          # schedule-free AdamW keeps z where AdamW keeps m
        for name in ("params", first, "v"):
            if arrays[name].shape != (n,):
                raise ValueError(f"array {name!r} has shape {arrays[name].shape}, the config needs ({n},)")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt checkpoint ({e.__class__.__name__}: {e})") from None
    return arrays, meta


def read_training_checkpoint(path, on_skip=None):
    """(arrays, meta, path) of a training checkpoint; CheckpointError on anything wrong.

    `path` is a file, or a directory: its newest intact checkpoint. A newer
    one that cannot be read (a crash, a bad disk) is skipped and reported
    through on_skip(message); when none is intact, the newest one's error is
    raised (and on_skip is not called).
    """
    p = Path(path)
    if not p.is_dir():
        return (*_read_one_training_checkpoint(p), p)
    candidates = [c for _, c in reversed(list_checkpoints(p))]
    if not candidates:
        raise CheckpointError(f"{p}: no checkpoints ({CHECKPOINT_GLOB}) in this directory")
    errors = []
    for c in candidates:
        try:
            arrays, meta = _read_one_training_checkpoint(c)
        except CheckpointError as e:
            errors.append(e)
            continue
        for e in errors:
            if on_skip is not None:
                on_skip(f"skipped {e}; using {c.name}")
        return arrays, meta, c
    older = f" (and the {len(errors) - 1} older ones cannot be read either)" if len(errors) > 1 else ""
    raise CheckpointError(f"{errors[0]}{older}")


def model_weights(arrays: dict):
    """The weights a training checkpoint's model is used with: schedule-free AdamW's average x, else the
    fp32 master copy when there is one, else the parameters."""
    return arrays.get("averaged", arrays.get("master", arrays["params"]))


def load_model(path, xp=np, dtype=None, on_skip=None):
    """A GPT2 from a checkpoint's weights (fp32 master weights when present), in `dtype`
    (default: float32). `path` and `on_skip` as in read_training_checkpoint."""
    from . import dtypes
    from .model import GPT2, GPT2Config
    arrays, meta, path = read_training_checkpoint(path, on_skip=on_skip)
    cfg = GPT2Config.from_dict(meta["config"])
    model = GPT2(cfg, xp=xp, dtype=dtypes.float32 if dtype is None else dtype, seed=None)
    model.load_flat(model_weights(arrays))
    return model, meta
