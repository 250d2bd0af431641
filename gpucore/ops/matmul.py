"""Matrix multiplication: the cuBLAS path of training, and our own GEMM kernel ladder.

Training path (cuBLASLt when it loads, else cuBLAS `gemmEx`; batched: `gemmStridedBatchedEx`):
  matmul_forward   out (N, M) = x (N, K) @ weight (M, K)^T + bias (M,)
  matmul_backward  dx = dout @ weight [=], dweight += dout^T @ x [+=], dbias += dout.sum(0) [+=]
                   (dbias: a deterministic column-sum kernel; opt-in: the dW GEMM's epilogue)
  batched_matmul   (Bt, M, N) = alpha * op(a) @ op(b) + beta * out   (attention baseline)
  matmul           numpy-like 2-D / 3-D a @ b
Our own kernels (kernels_cu/gemm_simt.cu, gemm_tc.cu, gemm_tc2.cu, gemm_wgmma.cu):
  gemm(a, b, out=None, version=N)   C (M, N) = A (M, K) @ B (K, N), all row-major

Precision: bf16 inputs multiply on tensor cores with float32 accumulation
(CUBLAS_COMPUTE_32F) and write bf16 or float32; float32 inputs use plain FP32
arithmetic (CUBLAS_COMPUTE_32F, never TF32), so they match the float64 NumPy
reference to ~1e-6.

Layout: cuBLAS is column-major. A row-major (r, c) array is, byte for byte, the
column-major (c, r) matrix -- its transpose. So row-major C = op(A) @ op(B) is
computed as column-major C^T = op(B)^T @ op(A)^T: pass B first, then A, swap
M and N, and keep each operand's transpose flag (a row-major array's leading
dimension is its row length, shape[-1]).

Bias in the forward: fused into the GEMM by cuBLASLt's CUBLASLT_EPILOGUE_BIAS
(called through ctypes: CuPy binds no cuBLASLt), so it costs no extra pass.
Fallback (no libcublasLt, GPUCORE_CUBLASLT=0, or a bf16 bias into a float32
out): a small kernel writes the broadcast bias into `out`, then gemmEx runs
with beta = 1 -- one pure-write pass over out plus the epilogue's read of it,
about +30% time at 65536 x 768 x 2304 (tools/notes/matmul.md has the numbers).
The Lt path also works under CUDA-graph capture; CuPy's cuBLAS wrappers don't
(so a GEMM whose timing race plain gemmEx won -- see the cuBLASLt section --
is not capturable; GPUCORE_LT_AUTOTUNE=0 or LT_TRY_GEMMEX = False avoids that).

Bias gradient in the backward: a deterministic two-stage column-sum kernel
that reads dout once more, after the GEMMs (or beside them: DBIAS_STREAM).
GPUCORE_LT_BGRAD=1 fuses it into the dW GEMM instead, by cuBLASLt's
CUBLASLT_EPILOGUE_BGRADB (column sums into a float32 scratch vector, then a
one-pass kernel does dbias += scratch, keeping the += rule); measured slower
as often as faster, so it is off by default (tools/notes/matmul.md).

Algorithms: each cuBLASLt plan times the heuristic's candidates (and gemmEx)
once, on first use, and remembers the winner on disk, so that every process
on the same GPU and library runs the same algorithms (bitwise-reproducible
training runs).

Every argument is validated before any launch. Arrays bigger than 2^31
elements are allowed on the cuBLAS path (the logits are 65536 x 50304); the
kernels of matmul.cu index with 64-bit where that matters.
"""
from __future__ import annotations

import ctypes
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from .. import dtypes, runtime

F32, BF16 = dtypes.float32, dtypes.bfloat16

# Rows per stage-1 chunk of the bias-backward reduction: fixed, so the
# reduction order depends on the shape only (determinism across calls).
BIAS_BWD_ROWS_PER_CHUNK = 256
BIAS_BWD_ROWS = 8          # BB_ROWS in matmul.cu: warps per stage-1 block


# ------------------------------------------------------------------ checks ----

def _check(name, x, *, dtypes_=dtypes.FLOAT_DTYPES, ndim=None, shape=None):
    """Like _common.check_array, without its 2^31-element limit (cuBLAS takes 64-bit sizes)."""
    if not isinstance(x, np.ndarray) and not runtime.is_gpu_array(x):
        raise TypeError(f"{name}: expected a NumPy or CuPy array, got {type(x).__name__}")
    if x.dtype not in dtypes_:
        want = " or ".join(dtypes.name(d) for d in dtypes_)
        raise TypeError(f"{name}: dtype must be {want}, got {dtypes.name(x.dtype)}")
    if ndim is not None and x.ndim not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: array must be C-contiguous (use .copy() or ascontiguousarray)")
    return x


def _same_dtype(**arrays):
    items = [(k, v) for k, v in arrays.items() if v is not None]
    k0, v0 = items[0]
    for k, v in items[1:]:
        if v.dtype != v0.dtype:
            raise TypeError(f"{k}: dtype {dtypes.name(v.dtype)} differs from {k0}'s {dtypes.name(v0.dtype)}")


def _out_dtypes(in_dtype):
    """Output dtypes cuBLAS supports for this input dtype with float32 compute."""
    return (F32, BF16) if in_dtype == BF16 else (F32,)


def _output(name, out, xp, shape, dtype, in_dtype):
    """`out` checked (shape, an allowed dtype, device), or a fresh array of `dtype`."""
    if out is None:
        return xp.empty(shape, dtype=dtype)
    _check(name, out, dtypes_=_out_dtypes(in_dtype), shape=shape)
    if (xp is np) != isinstance(out, np.ndarray):
        raise TypeError(f"{name}: must live on the same device as the inputs")
    return out


def _device(xp, name, arr):
    if arr is not None and (xp is np) != isinstance(arr, np.ndarray):
        raise TypeError(f"{name}: must live on the same device as the inputs")


# --------------------------------------------------------------- references ----

def _f64(x):
    return np.asarray(x, dtype=np.float64)


def batched_matmul_reference(a, b, out=None, transpose_a=False, transpose_b=False, alpha=1.0, beta=0.0,
                             out_dtype=None):
    """alpha * op(a) @ op(b) + beta * out in float64, rounded once to the output dtype."""
    A = _f64(a).swapaxes(-1, -2) if transpose_a else _f64(a)
    B = _f64(b).swapaxes(-1, -2) if transpose_b else _f64(b)
    r = alpha * (A @ B)
    if beta != 0.0:
        r = r + beta * _f64(out)
    return r.astype(out_dtype or (out.dtype if out is not None else a.dtype))


def matmul_forward_reference(x, weight, bias=None, out_dtype=None):
    r = _f64(x) @ _f64(weight).T
    if bias is not None:
        r = r + _f64(bias)
    return r.astype(out_dtype or x.dtype)


def matmul_backward_reference(dout, x, weight):
    """(dx, dweight, dbias) in float64, without accumulation."""
    d = _f64(dout).reshape(-1, dout.shape[-1])
    xx = _f64(x).reshape(-1, x.shape[-1])
    return (d @ _f64(weight)).reshape(x.shape), d.T @ xx, d.sum(axis=0)


def gemm_reference(a, b, out_dtype=None):
    return (_f64(a) @ _f64(b)).astype(out_dtype or a.dtype)


# ----------------------------------------------------------------- cuBLAS ----

def _cublas():
    # Imported lazily: the module needs libcublas, absent on CPU-only machines.
    from cupy_backends.cuda.libs import cublas
    return cublas


def _cuda_type(dtype) -> int:
    rt = runtime.cupy.cuda.runtime
    return rt.CUDA_R_16BF if dtype == BF16 else rt.CUDA_R_32F


def _gemm_rowmajor(a, b, out, M, N, K, transpose_a=False, transpose_b=False, alpha=1.0, beta=0.0, batch=1):
    """Row-major out (batch, M, N) = alpha * op(a) @ op(b) + beta * out on the current CuPy stream.

    a is (M, K) or, transposed, (K, M); b is (K, N) or (N, K); one matrix per
    batch entry, densely packed. Shapes are trusted: callers validate.
    """
    cublas = _cublas()
    cp = runtime.cupy
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    # Host scalars: cuBLAS reads them before the call returns (host pointer mode).
    al = np.array(alpha, dtype=np.float32)
    be = np.array(beta, dtype=np.float32)
    op_a = cublas.CUBLAS_OP_T if transpose_a else cublas.CUBLAS_OP_N
    op_b = cublas.CUBLAS_OP_T if transpose_b else cublas.CUBLAS_OP_N
    lda, ldb, ldc = a.shape[-1], b.shape[-1], N
    ta, tb, tc = _cuda_type(a.dtype), _cuda_type(b.dtype), _cuda_type(out.dtype)
    pa, pb, pc = a.data.ptr, b.data.ptr, out.data.ptr
    # Column-major C^T (N, M) = op(B)^T (N, K) @ op(A)^T (K, M).
    if batch == 1:
        cublas.gemmEx(handle, op_b, op_a, N, M, K, al.ctypes.data, pb, tb, ldb, pa, ta, lda,
                      be.ctypes.data, pc, tc, ldc, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    else:
        cublas.gemmStridedBatchedEx(handle, op_b, op_a, N, M, K, al.ctypes.data,
                                    pb, tb, ldb, K * N, pa, ta, lda, M * K,
                                    be.ctypes.data, pc, tc, ldc, M * N, batch,
                                    cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)


def _scale_inplace(out, beta):
    """The K = 0 case: out = beta * out (a GEMM with an empty sum)."""
    if beta == 0.0:
        out.fill(0)
    elif beta != 1.0:
        out[...] = (out.astype(np.float32) * np.float32(beta)).astype(out.dtype)


# -------------------------------------------------------------- cuBLASLt ----
# CuPy binds cuBLAS but not cuBLASLt, whose matmul takes fused epilogues
# (CUBLASLT_EPILOGUE_BIAS: the forward bias costs nothing; CUBLASLT_EPILOGUE_BGRADB:
# the bias gradient comes out of the dW GEMM, which reads dout anyway) and,
# unlike CuPy's cuBLAS wrappers, can be captured into a CUDA graph. We call the
# handful of functions we need through ctypes from the libcublasLt that CuPy has
# already loaded. Enum values and the heuristic-result layout are from
# cublasLt.h (CUDA 12.x; the ABI is unchanged since 11.0).
#
# Plans: descriptors + up to LT_ALGO_CANDIDATES algorithms from the heuristic,
# built once per (shape, dtypes, alignments, epilogue) and cached; a call then
# costs two ctypes calls. The algorithm (autotuning): the heuristic's first
# choice is not always the fastest (measured: no-bias forward 65536x3072x768,
# 0.457 ms vs gemmEx 0.428 ms), so on the first call of a plan big enough to
# matter, every candidate -- and plain gemmEx when there is no epilogue -- is
# timed a few times on the real operands and the fastest wins (the heuristic's
# first choice keeps its place unless another is LT_TUNE_MARGIN faster). The
# choice is stored on disk (LT_TUNE_CACHE, keyed by GPU, cuBLASLt version and
# plan key) so that the next process runs the *same* algorithms: different
# algorithms round differently, and two training runs must agree bit for bit.
# Inside a CUDA-graph capture nothing is timed (the first candidate is used).
# If the library is missing or a shape has no Lt algorithm, the training path
# falls back to gemmEx (+ the bias-fill kernel / the dbias kernel).
# GPUCORE_CUBLASLT=0 turns the Lt path off, GPUCORE_LT_AUTOTUNE=0 the timing,
# GPUCORE_LT_BGRAD=1 turns on the fused bias gradient (BGRADB epilogue). It is
# off by default: on an H200 the dW GEMM with the epilogue plus the small +=
# kernel measured slower than the plain dW GEMM plus our dbias kernel at the
# GPT-2 shapes (65536x768x2304, bf16 grads: 93.1% vs 97.4% of raw dx+dW;
# 65536x768x3072: 94.1% vs 96.1%), and no configuration of the ~5000 cuBLASLt accepts does
# better than the kernel (tools/probes/lt_bgrad_search.py; tools/notes/matmul.md).

USE_CUBLASLT = os.environ.get("GPUCORE_CUBLASLT", "1") != "0"
LT_AUTOTUNE = os.environ.get("GPUCORE_LT_AUTOTUNE", "1") != "0"
LT_BGRAD = os.environ.get("GPUCORE_LT_BGRAD", "0") == "1"
# Where the dbias kernel runs relative to the two backward GEMMs (when the BGRADB epilogue is off):
#   "" (default) -- after them on the caller's stream (one more pass over dout, ~10% of the GEMMs'
#         time at 65536 x 768 x 3072);
#   "first" / "last" -- on a side stream, launched before / after the GEMMs: it reads dout while
#         the GEMMs leave multiprocessors idle (the dW GEMM's tails); the caller's stream waits for
#         it before returning. Same bits either way (its own output). Alone, "last" gains 2-4
#         points over "" (`gpucore bench matmul`); inside the d12 step with every dbias on this
#         path it measured 122.0 vs 117.0 ms (tools/probes/model_step_ab.py, H200), so it is opt-in.
#         (The model computes three of its four bias gradients elsewhere: model.FUSED_BIAS_GRADS.)
DBIAS_STREAM = os.environ.get("GPUCORE_DBIAS_STREAM", "")
LT_TRY_GEMMEX = True                    # gemmEx races the Lt algorithms of epilogue-free GEMMs
LT_ALGO_CANDIDATES = 8                  # heuristic results requested per plan
LT_AUTOTUNE_MIN_FLOPS = 2e9             # below: the heuristic's first choice (timing costs more than it saves)
LT_TUNE_MARGIN = 0.02                   # another algorithm must be 2% faster to replace the first choice
LT_TUNE_CACHE = runtime.CACHE_DIR / "cublaslt_algos.json"   # next to the compiled kernels
LT_WORKSPACE_BYTES = 32 << 20           # cuBLAS' recommendation for Hopper
_LT_DESC_TRANSA, _LT_DESC_TRANSB, _LT_DESC_EPILOGUE, _LT_DESC_BIAS_POINTER = 3, 4, 7, 8
_LT_DESC_BIAS_DATA_TYPE = 26
_LT_EPILOGUE_DEFAULT, _LT_EPILOGUE_BIAS, _LT_EPILOGUE_BGRADB = 1, 4, 512
_LT_PREF_MAX_WORKSPACE_BYTES = 1
_LT_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)   # A, B, C, D
_LT_HEURISTIC_BYTES = 96                # cublasLtMatmulHeuristicResult_t: algo[64] ws(8) state(4) waves(4) int[4]
_LT_ALGO_BYTES = 64
_CUBLAS_COMPUTE_32F = 68
GEMMEX = "gemmex"                       # a plan's choice when plain gemmEx won the race


class _Plan:
    """Descriptors, the heuristic's candidate algorithms and (once decided) the choice."""

    def __init__(self, desc, lay_b, lay_a, lay_c, results, candidates):
        self.desc, self.lay_b, self.lay_a, self.lay_c = desc, lay_b, lay_a, lay_c
        self.results = results          # the heuristic-result array (kept alive: algos point into it)
        self.candidates = candidates    # indices of the usable results, heuristic order
        self.choice = None              # an index into results, GEMMEX, or None (not decided yet)
        self.times = None               # ms per candidate (+ gemmEx) when it was timed

    def algo_ptr(self, i):
        return ctypes.addressof(self.results) + i * _LT_HEURISTIC_BYTES

    def algo_hex(self, i):
        return bytes(self.results[i * _LT_HEURISTIC_BYTES:i * _LT_HEURISTIC_BYTES + _LT_ALGO_BYTES]).hex()


class _CublasLt:
    """The cuBLASLt library, one handle and one workspace per device, and the plan cache."""

    def __init__(self):
        lib = None
        for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            raise OSError("libcublasLt.so.13/.12 not found")
        vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        pvp = ctypes.POINTER(vp)
        for fname, args in {
                "cublasLtCreate": [pvp],
                "cublasLtMatmulDescCreate": [pvp, i32, i32],
                "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
                "cublasLtMatrixLayoutCreate": [pvp, i32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
                "cublasLtMatmulPreferenceCreate": [pvp],
                "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
                "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, vp, ctypes.POINTER(i32)],
                "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]}.items():
            f = getattr(lib, fname)
            f.argtypes, f.restype = args, i32
        lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], sz
        self.lib = lib
        self.version = int(lib.cublasLtGetVersion())
        self.handles, self.workspaces, self.plans = {}, {}, {}

    def _ok(self, status, what):
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what} failed with status {status}")

    def _create(self, fn, *args):
        h = ctypes.c_void_p()
        self._ok(fn(ctypes.byref(h), *args), fn.__name__)
        return h

    def _set(self, fn, obj, attr, value):
        self._ok(fn(obj, attr, ctypes.addressof(value), ctypes.sizeof(value)), f"{fn.__name__}({attr})")

    def device_state(self):
        dev = runtime.cupy.cuda.Device().id
        if dev not in self.handles:
            self.handles[dev] = self._create(self.lib.cublasLtCreate)
            self.workspaces[dev] = runtime.cupy.empty(LT_WORKSPACE_BYTES, dtype=np.uint8)
        return dev, self.handles[dev], self.workspaces[dev]

    def plan(self, key, handle, op_b, op_a, N, M, K, ldb, lda, tb, ta, tc, epilogue, bias_ptr, bias_type, aligns):
        """The _Plan for C^T = op(B)^T op(A)^T (+ epilogue), or None if Lt has no algorithm."""
        if key in self.plans:
            return self.plans[key]
        lib = self.lib
        desc = self._create(lib.cublasLtMatmulDescCreate, _CUBLAS_COMPUTE_32F, runtime.cupy.cuda.runtime.CUDA_R_32F)
        self._set(lib.cublasLtMatmulDescSetAttribute, desc, _LT_DESC_TRANSA, ctypes.c_int32(op_b))
        self._set(lib.cublasLtMatmulDescSetAttribute, desc, _LT_DESC_TRANSB, ctypes.c_int32(op_a))
        self._set(lib.cublasLtMatmulDescSetAttribute, desc, _LT_DESC_EPILOGUE, ctypes.c_uint32(epilogue))
        if epilogue != _LT_EPILOGUE_DEFAULT:    # the heuristic reads the pointer's alignment
            self._set(lib.cublasLtMatmulDescSetAttribute, desc, _LT_DESC_BIAS_POINTER, ctypes.c_void_p(bias_ptr))
        if bias_type is not None:
            self._set(lib.cublasLtMatmulDescSetAttribute, desc, _LT_DESC_BIAS_DATA_TYPE, ctypes.c_int32(bias_type))
        # Column-major layouts of the stored matrices: (rows, cols, ld) = (row length, row count, row length).
        lay_b = self._create(lib.cublasLtMatrixLayoutCreate, tb, *((N, K) if op_b == 0 else (K, N)), ldb)
        lay_a = self._create(lib.cublasLtMatrixLayoutCreate, ta, *((K, M) if op_a == 0 else (M, K)), lda)
        lay_c = self._create(lib.cublasLtMatrixLayoutCreate, tc, N, M, N)
        pref = self._create(lib.cublasLtMatmulPreferenceCreate)
        self._set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _LT_PREF_MAX_WORKSPACE_BYTES,
                  ctypes.c_uint64(LT_WORKSPACE_BYTES))
        for attr, al in zip(_LT_PREF_MIN_ALIGNMENT, aligns):
            self._set(lib.cublasLtMatmulPreferenceSetAttribute, pref, attr, ctypes.c_uint32(al))
        n_req = max(1, LT_ALGO_CANDIDATES)
        results = (ctypes.c_ubyte * (n_req * _LT_HEURISTIC_BYTES))()
        count = ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, lay_b, lay_a, lay_c, lay_c, pref, n_req,
                                                    ctypes.addressof(results), ctypes.byref(count))
        candidates = []
        if status == 0:
            for i in range(min(count.value, n_req)):
                off = i * _LT_HEURISTIC_BYTES
                state = int.from_bytes(bytes(results[off + 72:off + 76]), "little", signed=True)
                ws = int.from_bytes(bytes(results[off + 64:off + 72]), "little")
                if state == 0 and ws <= LT_WORKSPACE_BYTES:
                    candidates.append(i)
        plan = _Plan(desc, lay_b, lay_a, lay_c, results, candidates) if candidates else None
        self.plans[key] = plan
        return plan


_LT = None
LT_STATUS = "not tried"


def _lt():
    """The cuBLASLt binding, or None (and LT_STATUS says why)."""
    global _LT, LT_STATUS
    if _LT is None and USE_CUBLASLT and LT_STATUS == "not tried":
        try:
            _cublas()                   # makes CuPy load libcublas and libcublasLt
            _LT = _CublasLt()
            LT_STATUS = "ok"
        except Exception as e:  # noqa: BLE001 - any failure means: use gemmEx
            LT_STATUS = f"unavailable: {e}"
    return _LT if USE_CUBLASLT else None


def _alignment(ptr: int) -> int:
    return min(256, ptr & -ptr) if ptr else 256


# ---- autotuning: pick, time, remember ----

def _pick(times, margin=None):
    """Index of the candidate to use: the fastest, unless it beats candidate 0 by less than `margin`."""
    margin = LT_TUNE_MARGIN if margin is None else margin
    best = min(range(len(times)), key=lambda i: (times[i], i))
    return best if times[best] < times[0] * (1.0 - margin) else 0


_TUNE_CACHE = None


def _tune_cache() -> dict:
    global _TUNE_CACHE
    if _TUNE_CACHE is None:
        _TUNE_CACHE = _read_json_dict(Path(LT_TUNE_CACHE))
    return _TUNE_CACHE


def _read_json_dict(path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _tune_cache_put(key: str, value: str) -> None:
    """Remember a choice in memory and on disk (merged with what other processes wrote; atomic)."""
    cache = _tune_cache()
    cache[key] = value
    path = Path(LT_TUNE_CACHE)
    try:
        merged = _read_json_dict(path)
        merged.update(cache)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(merged, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass                            # a read-only cache dir: the choice still holds for this process


def _tune_key(lt, key) -> str:
    """The plan key without the device index, with what makes timings and algorithms differ."""
    name = runtime.device_properties()["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return f"{name}|sm{runtime.sm_count()}|lt{lt.version}|{key[1:]}".replace(" ", "")


def _capturing() -> bool:
    try:
        return bool(runtime.cupy.cuda.get_current_stream().is_capturing())
    except Exception:  # noqa: BLE001 - the legacy stream under a global capture raises: treat as capturing
        return True


def _time_each(fns, rounds=3, reps=3):
    """ms per call of each fn: one warm-up call each, then `rounds` interleaved rounds of `reps`; min.
    A candidate whose warm-up call raises (an algorithm Lt offered but then refuses) gets inf."""
    cp = runtime.cupy
    best = [float("inf")] * len(fns)
    ok = []
    for i, fn in enumerate(fns):
        try:
            fn()
            ok.append(i)
        except RuntimeError:
            pass
    for _ in range(rounds):
        for i in ok:
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(reps):
                fns[i]()
            stop.record()
            stop.synchronize()
            best[i] = min(best[i], cp.cuda.get_elapsed_time(start, stop) / reps)
    return best


def _choose(lt, plan, key, launch, out, beta, flops, gemmex):
    """Decide plan.choice (see the section comment). launch(i, c_ptr) runs candidate i into c_ptr;
    gemmex(c) runs plain gemmEx into array c, or is None when gemmEx is no candidate."""
    if flops < LT_AUTOTUNE_MIN_FLOPS or (len(plan.candidates) == 1 and gemmex is None):
        plan.choice = plan.candidates[0]
        return
    tkey = _tune_key(lt, key)
    saved = _tune_cache().get(tkey)
    if saved == GEMMEX and gemmex is not None:
        plan.choice = GEMMEX
        return
    for i in plan.candidates:
        if saved == plan.algo_hex(i):
            plan.choice = i
            return
    if _capturing():
        return                          # undecided: candidate 0 now, timed on a later call outside capture
    # beta == 0: the output is only written, and the chosen algorithm rewrites it last -> time in place.
    # beta != 0: out is read (+=); time on a scratch copy of its shape so out is untouched.
    target = out if beta == 0.0 else runtime.cupy.empty_like(out)
    fns = [lambda i=i: launch(i, target.data.ptr) for i in plan.candidates]
    if gemmex is not None:
        fns.append(lambda: gemmex(target))
    times = _time_each(fns)
    best = _pick(times)
    plan.times = times
    plan.choice = GEMMEX if best == len(plan.candidates) else plan.candidates[best]
    _tune_cache_put(tkey, GEMMEX if plan.choice == GEMMEX else plan.algo_hex(plan.choice))
    del target


def _lt_gemm_rowmajor(a, b, out, M, N, K, transpose_a=False, transpose_b=False, alpha=1.0, beta=0.0, bias=None,
                      bgrad=None):
    """Row-major out = alpha * op(a) @ op(b) + beta * out [+ bias over rows] by cublasLtMatmul.

    bgrad (instead of bias): a float32 or bf16 (N,) array that receives, for
    the dW GEMM of a linear layer (a = dout (rows, M') with transpose_a=True,
    out = dW (M', K')), the column sums of dout: bgrad[j] = sum_r dout[r, j].
    That is Lt's CUBLASLT_EPILOGUE_BGRADB (Lt computes C^T = op(B)^T op(A)^T
    with our a as its B); it is written, not added.
    Returns False (nothing launched) when cuBLASLt is unavailable, has no
    algorithm for this case, or plain gemmEx won the timing race; the caller
    then uses gemmEx (or, for bgrad, the dbias kernel).
    """
    lt = _lt()
    if lt is None:
        return False
    dev, handle, ws = lt.device_state()
    op_a, op_b = int(transpose_a), int(transpose_b)          # CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
    ta, tb, tc = _cuda_type(a.dtype), _cuda_type(b.dtype), _cuda_type(out.dtype)
    if bgrad is not None:
        epilogue, vec, vec_type = _LT_EPILOGUE_BGRADB, bgrad, _cuda_type(bgrad.dtype)
    elif bias is not None:
        epilogue, vec, vec_type = _LT_EPILOGUE_BIAS, bias, None      # Lt's bias has D's type
    else:
        epilogue, vec, vec_type = _LT_EPILOGUE_DEFAULT, None, None
    vec_ptr = vec.data.ptr if vec is not None else 0
    aligns = tuple(_alignment(p) for p in (b.data.ptr, a.data.ptr, out.data.ptr, out.data.ptr))
    key = (dev, op_a, op_b, M, N, K, a.shape[-1], b.shape[-1], ta, tb, tc, epilogue, vec_type,
           _alignment(vec_ptr) if vec is not None else 0, aligns, beta != 0.0)
    plan = lt.plan(key, handle, op_b, op_a, N, M, K, b.shape[-1], a.shape[-1], tb, ta, tc,
                   epilogue, vec_ptr, vec_type, aligns)
    if plan is None:
        return False
    if vec is not None:
        lt._set(lt.lib.cublasLtMatmulDescSetAttribute, plan.desc, _LT_DESC_BIAS_POINTER, ctypes.c_void_p(vec_ptr))
    al, be = ctypes.c_float(alpha), ctypes.c_float(beta)
    stream = runtime.cupy.cuda.get_current_stream().ptr
    pa, pb = a.data.ptr, b.data.ptr

    def launch(i, c_ptr):
        lt._ok(lt.lib.cublasLtMatmul(handle, plan.desc, ctypes.addressof(al), pb, plan.lay_b, pa, plan.lay_a,
                                     ctypes.addressof(be), c_ptr, plan.lay_c, c_ptr, plan.lay_c,
                                     plan.algo_ptr(i), ws.data.ptr, LT_WORKSPACE_BYTES, stream),
               "cublasLtMatmul")

    if not LT_AUTOTUNE:
        choice = plan.candidates[0]
    else:
        if plan.choice is None:
            gemmex = None
            if epilogue == _LT_EPILOGUE_DEFAULT and LT_TRY_GEMMEX:
                def gemmex(c):
                    _gemm_rowmajor(a, b, c, M, N, K, transpose_a, transpose_b, alpha, beta)
            _choose(lt, plan, key, launch, out, beta, 2.0 * M * N * K, gemmex)
        choice = plan.choice if plan.choice is not None else plan.candidates[0]
    if choice == GEMMEX:
        return False
    launch(choice, out.data.ptr)
    return True


def _train_gemm(a, b, out, M, N, K, transpose_a=False, transpose_b=False, beta=0.0, bias=None):
    """The training path's GEMM: cuBLASLt (bias fused) when it can, else gemmEx (+ bias-fill kernel)."""
    if bias is not None and bias.dtype != out.dtype:
        lt_ok = False                   # Lt's bias has D's type; a bf16 bias into a float32 out takes the fill
    else:
        lt_ok = _lt_gemm_rowmajor(a, b, out, M, N, K, transpose_a, transpose_b, 1.0, beta, bias)
    if lt_ok:
        return
    if bias is not None:
        _bias_fill(out, bias)
        beta = 1.0
    _gemm_rowmajor(a, b, out, M, N, K, transpose_a, transpose_b, 1.0, beta)
# ------------------------------------------------------------ public: cuBLAS ---

def batched_matmul(a, b, out=None, transpose_a=False, transpose_b=False, alpha=1.0, beta=0.0):
    """out (Bt, M, N) = alpha * op(a) @ op(b) + beta * out, one GEMM per batch entry.

    a: (Bt, M, K), or (Bt, K, M) with transpose_a; b: (Bt, K, N), or (Bt, N, K)
    with transpose_b. float32, or bfloat16 (then out may be bfloat16 or float32;
    default: a's dtype). beta != 0 reads `out`, which must then be given.
    GPU: one cublasGemmStridedBatchedEx on the current stream.
    """
    _check("a", a, ndim=3)
    _check("b", b, ndim=3)
    _same_dtype(a=a, b=b)
    Bt = a.shape[0]
    M, K = (a.shape[2], a.shape[1]) if transpose_a else (a.shape[1], a.shape[2])
    Kb, N = (b.shape[2], b.shape[1]) if transpose_b else (b.shape[1], b.shape[2])
    if b.shape[0] != Bt:
        raise ValueError(f"b: batch size {b.shape[0]} differs from a's {Bt}")
    if Kb != K:
        raise ValueError(f"b: inner dimension {Kb} differs from a's {K} (shapes {a.shape}, {b.shape}, "
                         f"transpose_a={transpose_a}, transpose_b={transpose_b})")
    alpha, beta = float(alpha), float(beta)
    if beta != 0.0 and out is None:
        raise ValueError("out: beta != 0 reads out, so out must be given")
    xp = runtime.array_module(a, b, out)
    out = _output("out", out, xp, (Bt, M, N), a.dtype, a.dtype)
    if xp is np:
        out[...] = batched_matmul_reference(a, b, out, transpose_a, transpose_b, alpha, beta, out.dtype)
        return out
    if Bt == 0 or M == 0 or N == 0:
        return out
    if K == 0:
        _scale_inplace(out, beta)
        return out
    _gemm_rowmajor(a, b, out, M, N, K, transpose_a, transpose_b, alpha, beta, batch=Bt)
    return out


def matmul(a, b, out=None):
    """numpy-like a @ b for 2-D (M, K) @ (K, N), batched 3-D (Bt, M, K) @ (Bt, K, N),
    and (Bt, M, K) @ (K, N) (b shared by every batch entry). cuBLAS on the GPU."""
    _check("a", a, ndim=(2, 3))
    _check("b", b, ndim=(2, 3))
    _same_dtype(a=a, b=b)
    if a.ndim == 2 and b.ndim == 3:
        raise ValueError(f"b: a 3-D b needs a 3-D a, got shapes {a.shape} @ {b.shape}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"b: inner dimension {b.shape[-2]} differs from a's {a.shape[-1]} "
                         f"(shapes {a.shape} @ {b.shape})")
    if a.ndim == 3 and b.ndim == 3:
        return batched_matmul(a, b, out=out)
    xp = runtime.array_module(a, b, out)
    K, N = b.shape
    M = a.size // K if K else int(np.prod(a.shape[:-1]))
    shape = a.shape[:-1] + (N,)
    out = _output("out", out, xp, shape, a.dtype, a.dtype)
    if xp is np:
        out[...] = batched_matmul_reference(a, b, out_dtype=out.dtype)
        return out
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.fill(0)
        return out
    _gemm_rowmajor(a, b, out, M, N, K)   # a 3-D a is contiguous: rows of (Bt*M, K)
    return out


def _bias_fill(out2d, bias):
    """out2d (N, M) = broadcast bias (M,): one write pass, 16-byte stores where possible."""
    N, M = out2d.shape
    so, sb = dtypes.kernel_suffix(out2d.dtype), dtypes.kernel_suffix(bias.dtype)
    P = 16 // out2d.dtype.itemsize
    vec = so == sb and M % P == 0 and out2d.data.ptr % 16 == 0 and bias.data.ptr % 16 == 0
    V = P if vec else 1
    k = runtime.get_kernel("matmul", f"matmul_bias_fill_kernel_{'vec' if vec else 'scalar'}_{so}_{sb}")
    strips = -(-M // (32 * V))
    # About 16 blocks of 256 threads per SM in all; each walks rows with a fixed stride.
    row_groups = max(1, min(-(-N // 8), runtime.sm_count() * 16 // strips, 65535))
    runtime.launch(k, (strips, row_groups), (32, 8), (out2d, bias, np.int32(N), np.int32(M)))


def matmul_forward(x, weight, bias=None, out=None):
    """out (N, M) = x (N, K) @ weight (M, K)^T + bias (M,).

    x may have leading dims (..., K): they are flattened to N rows and out has
    shape (..., M). x, weight (and bias) share a dtype; with bfloat16 inputs,
    out may be bfloat16 (default) or float32; bias has x's dtype or out's.
    """
    _check("x", x)
    if x.ndim < 2:
        raise ValueError(f"x: expected at least 2 dimensions (N, K), got shape {tuple(x.shape)}")
    _check("weight", weight, ndim=2)
    _same_dtype(x=x, weight=weight)
    K = x.shape[-1]
    M = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"weight: expected shape ({M}, {K}) to match x's last dim {K}, got {tuple(weight.shape)}")
    xp = runtime.array_module(x, weight, bias, out)
    out = _output("out", out, xp, x.shape[:-1] + (M,), x.dtype, x.dtype)
    if bias is not None:
        _check("bias", bias, dtypes_=tuple(dict.fromkeys((x.dtype, out.dtype))), shape=(M,))
        _device(xp, "bias", bias)
    if xp is np:
        out[...] = matmul_forward_reference(x, weight, bias, out.dtype)
        return out
    N = x.size // K if K else int(np.prod(x.shape[:-1]))
    if N == 0 or M == 0:
        return out
    out2d = out.reshape(N, M)
    if K == 0:                          # an empty sum: out = bias (or 0)
        if bias is None:
            out.fill(0)
        else:
            _bias_fill(out2d, bias)
        return out
    _train_gemm(x, weight, out2d, N, M, K, transpose_b=True, bias=bias)
    return out


def _bias_backward(dbias, dout2d):
    """dbias (M,) += dout2d (N, M).sum(0): two deterministic launches, float32 partials."""
    N, M = dout2d.shape
    cp = runtime.cupy
    suf = dtypes.kernel_suffix(dout2d.dtype)
    chunks = max(1, -(-N // BIAS_BWD_ROWS_PER_CHUNK))
    partials = cp.empty((chunks, M), dtype=np.float32)
    P = 16 // dout2d.dtype.itemsize
    vec = M % P == 0 and dout2d.data.ptr % 16 == 0
    V = P if vec else 1
    k1 = runtime.get_kernel("matmul", f"matmul_bias_backward_stage1_kernel_{'vec' if vec else 'scalar'}_{suf}")
    grid1 = (-(-M // (32 * V)), chunks)
    runtime.launch(k1, grid1, (32, BIAS_BWD_ROWS),
                   (partials, dout2d, np.int32(N), np.int32(M), np.int32(BIAS_BWD_ROWS_PER_CHUNK)))
    bias_reduce_partials(dbias, partials)


def bias_reduce_partials(dbias, partials):
    """dbias (M,) += partials (chunks, M) float32 summed over chunks in chunk order, on the current
    stream (matmul.cu's stage 2). The second stage of every deterministic column sum: the dbias
    kernel above, and kernels that produce a matmul's dout with its column sums fused (they write
    per-row-chunk partials and call this)."""
    M, chunks = partials.shape[1], partials.shape[0]
    k2 = runtime.get_kernel("matmul", f"matmul_bias_backward_stage2_kernel_{dtypes.kernel_suffix(dbias.dtype)}")
    runtime.launch(k2, -(-M // 256), 256, (dbias, partials, np.int32(M), np.int32(chunks)))


def _dweight_dbias_fused(dbias, dout2d, x2d, dweight, M, K, N, beta):
    """dweight (M, K) = dout2d^T @ x2d + beta * dweight with cuBLASLt's BGRADB epilogue writing
    dout2d's column sums into a scratch vector, then dbias (M,) += scratch (a tiny kernel: the
    epilogue overwrites, the gradient rule is +=). Saves the dbias kernel's pass over dout
    (~0.1 ms of ~0.7 at 65536 x 768 x 2304). Deterministic as long as the algorithm is (the
    GPU tests check it bitwise). The scratch is float32; if Lt has no algorithm for a float32
    bias gradient next to a bf16 dweight, a bf16 scratch is tried when dbias is bf16 anyway.
    Returns the scratch dtype's name ("float32" / "bfloat16"), or None, having launched
    nothing, when Lt cannot do it (or LT_BGRAD is off): the caller then runs the plain dW
    GEMM and the two-stage dbias kernel.
    """
    if not LT_BGRAD or _lt() is None:
        return None
    cp = runtime.cupy
    scratch_types = [F32] + ([BF16] if dbias.dtype == BF16 and dweight.dtype == BF16 else [])
    for st in scratch_types:
        scratch = cp.empty((M,), dtype=st)
        if _lt_gemm_rowmajor(dout2d, x2d, dweight, M, K, N, transpose_a=True, beta=beta, bgrad=scratch):
            k = runtime.get_kernel("matmul", f"matmul_bias_accumulate_kernel_{dtypes.kernel_suffix(dbias.dtype)}_"
                                             f"{dtypes.kernel_suffix(st)}")
            runtime.launch(k, -(-M // 256), 256, (dbias, scratch, np.int32(M)))
            return dtypes.name(st)
    return None


def matmul_backward(dout, x, weight, dx=None, dweight=None, dbias=None, need_dx=True, *,
                    need_dweight=True, need_dbias=True):
    """Gradients of out = x @ weight^T + bias. Returns (dx, dweight, dbias).

    dout (..., M), x (..., K), weight (M, K), all one dtype.
    dx (..., K)     = dout @ weight              [=]   (None returned when need_dx=False)
    dweight (M, K) += dout^T @ x                 [+=]  (zeros allocated when None)
    dbias (M,)     += dout summed over rows      [+=]  (zeros allocated when None)
    With bfloat16 inputs, dx/dweight/dbias may be float32 or bfloat16 (default:
    the input dtype). need_dweight=False / need_dbias=False skip those (None is
    returned): a layer without bias should pass need_dbias=False. dbias comes
    from a two-stage column-sum kernel that reads all of dout once more (where:
    DBIAS_STREAM), or with GPUCORE_LT_BGRAD=1 from the dW GEMM's cuBLASLt
    epilogue (BGRADB) when Lt can.
    """
    _check("dout", dout)
    _check("x", x)
    _check("weight", weight, ndim=2)
    _same_dtype(dout=dout, x=x, weight=weight)
    M, K = weight.shape
    if x.ndim < 2 or x.shape[-1] != K:
        raise ValueError(f"x: expected shape (..., {K}) to match weight {tuple(weight.shape)}, got {tuple(x.shape)}")
    if tuple(dout.shape) != tuple(x.shape[:-1]) + (M,):
        raise ValueError(f"dout: expected shape {tuple(x.shape[:-1]) + (M,)}, got {tuple(dout.shape)}")
    xp = runtime.array_module(dout, x, weight, dx, dweight, dbias)
    in_dt = x.dtype
    if need_dx:
        dx = _output("dx", dx, xp, x.shape, in_dt, in_dt)
    else:
        dx = None
    if need_dweight and dweight is not None:
        _check("dweight", dweight, dtypes_=_out_dtypes(in_dt), shape=(M, K))
        _device(xp, "dweight", dweight)
    if need_dbias and dbias is not None:
        _check("dbias", dbias, dtypes_=_out_dtypes(in_dt), shape=(M,))
        _device(xp, "dbias", dbias)
    fresh_dw = need_dweight and dweight is None
    if fresh_dw:
        dweight = xp.zeros((M, K), dtype=in_dt) if xp is np else xp.empty((M, K), dtype=in_dt)
    if need_dbias and dbias is None:
        dbias = xp.zeros((M,), dtype=in_dt)
    if not need_dweight:
        dweight = None
    if not need_dbias:
        dbias = None

    if xp is np:
        rdx, rdw, rdb = matmul_backward_reference(dout, x, weight)
        if dx is not None:
            dx[...] = rdx.astype(dx.dtype)
        if dweight is not None:
            dweight[...] = (_f64(dweight) + rdw).astype(dweight.dtype)
        if dbias is not None:
            dbias[...] = (_f64(dbias) + rdb).astype(dbias.dtype)
        return dx, dweight, dbias

    N = x.size // K if K else int(np.prod(x.shape[:-1]))
    dout2d = dout.reshape(N, M)
    x2d = x.reshape(N, K)
    side = None                             # the dbias kernel beside the GEMMs (DBIAS_STREAM)
    if dbias is not None and M and N and DBIAS_STREAM in ("first", "last") and not (LT_BGRAD and _lt()):
        side = _dbias_side(dbias, dout2d, launch=DBIAS_STREAM == "first")
    if dx is not None and N and K:
        if M == 0:
            dx.fill(0)
        else:
            _train_gemm(dout2d, weight, dx.reshape(N, K), N, K, M)               # (N,M) @ (M,K)
    dbias_done = False
    if dweight is not None and M and K:
        if N == 0:
            if fresh_dw:
                dweight.fill(0)
        else:
            beta = 0.0 if fresh_dw else 1.0
            if dbias is not None:           # dW GEMM + the bias gradient from its epilogue
                dbias_done = _dweight_dbias_fused(dbias, dout2d, x2d, dweight, M, K, N, beta) is not None
            if not dbias_done:
                _train_gemm(dout2d, x2d, dweight, M, K, N, transpose_a=True, beta=beta)   # (N,M)^T @ (N,K)
    if side is not None:
        side.finish()
    elif dbias is not None and M and N and not dbias_done:
        _bias_backward(dbias, dout2d)
    return dx, dweight, dbias


class _dbias_side:
    """The dbias kernel on the side stream "matmul dbias": forks from the caller's stream (dout and
    dbias are ready there), launches at once (launch=True) or at finish(), and finish() makes the
    caller's stream wait for it. The partials are allocated while the side stream is current, so
    CuPy's pool hands their memory back to that stream only (no reuse racing the kernel)."""

    def __init__(self, dbias, dout2d, launch):
        cp = runtime.cupy
        self.args, self.launched = (dbias, dout2d), False
        self.main = cp.cuda.get_current_stream()
        self.stream, forked, self.joined = runtime.side_stream("matmul dbias")
        forked.record(self.main)
        self.stream.wait_event(forked)
        if launch:
            self._launch()

    def _launch(self):
        with self.stream:
            _bias_backward(*self.args)
        self.launched = True

    def finish(self):
        if not self.launched:
            self._launch()
        self.joined.record(self.stream)
        self.main.wait_event(self.joined)


# ------------------------------------------------------- public: our ladder ---

# version -> (kernel file, input dtype, block tile (BM, BN), threads per block, dynamic smem bytes)
# v1 naive: one thread per C element, straight from global memory.
# v2 shared-memory tiles: 32x32 tiles of A and B staged in smem, one C element per thread.
# v3 register blocking: 128x128x8 block tile, 256 threads each own an 8x8 C tile, float4 loads.
# v4 tensor cores: 128x128x32 block tile, 8 warps of 64x32, mma.sync m16n8k16 bf16, ldmatrix,
#    4-stage cp.async pipeline, XOR-swizzled smem.
# v4b/v4c (gemm_tc2.cu): 64x64 warp tiles, fragments double-buffered in registers, BK = 64,
#    3 stages; v4b a 128x256 block of 8 warps (1 block/SM), v4c a 128x128 block of 4 warps
#    (2 blocks/SM). See the header of gemm_tc2.cu for why.
# v5 (gemm_wgmma.cu): Hopper warpgroup MMA; see its header.
GEMM_VERSIONS = {
    1: ("gemm_simt", F32, (16, 16), 256, 0),
    2: ("gemm_simt", F32, (32, 32), 1024, 0),
    3: ("gemm_simt", F32, (128, 128), 256, 0),
    4: ("gemm_tc", BF16, (128, 128), 256, 4 * (128 * 32 + 32 * 128) * 2),
    # "4w": the same kernel with a 128x256 block of 8 warps x (64x64), 3 stages (236 regs,
    # 1 block/SM): fewer ldmatrix per mma. Measured slower than 4 (312 vs 334 TFLOP/s, H200).
    "4w": ("gemm_tc", BF16, (128, 256), 256, 3 * (128 * 32 + 32 * 256) * 2),
    "4b": ("gemm_tc2", BF16, (128, 256), 256, 3 * (128 * 64 + 64 * 256) * 2),
    "4c": ("gemm_tc2", BF16, (128, 128), 128, 3 * (128 * 64 + 64 * 128) * 2),
    # v5 (gemm_wgmma.cu, sm_90 only): wgmma.m64n256k16 from 128B-swizzled shared memory, 2
    # warpgroups on a 128x256x64 block, 4 cp.async stages (+1 KB to align the base to 1024).
    5: ("gemm_wgmma", BF16, (128, 256), 256, 4 * (128 * 64 + 64 * 256) * 2 + 1024),
    # v6 (gemm_wgmma.cu): v5's tiles and stages, warp-specialized -- a producer warpgroup copies,
    # 2 consumer warpgroups only multiply; stages handed over by mbarriers (no __syncthreads);
    # persistent (a grid of min(tiles, SMs) blocks).
    6: ("gemm_wgmma", BF16, (128, 256), 384, 4 * (128 * 64 + 64 * 256) * 2 + 1024),
}
_ARCH = {5: "90a", 6: "90a"}            # compiled for sm_90a (wgmma); runs on sm_90 devices only
PERSISTENT_VERSIONS = (6,)
TC_VERSIONS = tuple(v for v, spec in GEMM_VERSIONS.items() if spec[1] == BF16)
# The bf16 default: the fastest measured on an H200 (2026-11-22): v6 (warp-specialized wgmma)
# 640 TFLOP/s at 4096^3 and ahead of v5 (608-617) at every GPT-2 shape; earlier: v5 (wgmma) 545
# TFLOP/s on sm_90, else v4b (mma.sync) 418 TFLOP/s; v4 309, v4w 317, v4c 375.
GEMM_DEFAULT_BF16 = "4b"
GEMM_DEFAULT_BF16_SM90 = 6
_CARVEOUT_SET = set()


def _default_bf16_version():
    if runtime.gpu_available() and runtime.device_arch() == "90":
        return GEMM_DEFAULT_BF16_SM90
    return GEMM_DEFAULT_BF16


def gemm(a, b, out=None, version=None):
    """C (M, N) = A (M, K) @ B (K, N), all row-major, with our own kernels.

    version 1-3: float32 in and out (SIMT). version 4, "4w", "4b", "4c", 5, 6 (tensor
    cores, see GEMM_VERSIONS; 5, 6 = wgmma, Hopper only): bfloat16 in, bfloat16
    (default) or float32 out; need N and K multiples of 8 (16-byte rows for
    cp.async), M any.
    Default: v6 for bfloat16 on sm_90 (else GEMM_DEFAULT_BF16), 3 for float32.
    NumPy inputs run the float64 reference (any version).
    """
    _check("a", a, ndim=2)
    _check("b", b, ndim=2)
    _same_dtype(a=a, b=b)
    if version is None:
        version = _default_bf16_version() if a.dtype == BF16 else 3
    if version not in GEMM_VERSIONS:
        raise ValueError(f"version: must be one of {list(GEMM_VERSIONS)}, got {version!r}")
    family, in_dt, (BM, BN), threads, smem = GEMM_VERSIONS[version]
    M, K = a.shape
    if b.shape[0] != K:
        raise ValueError(f"b: inner dimension {b.shape[0]} differs from a's {K} (shapes {a.shape} @ {b.shape})")
    N = b.shape[1]
    xp = runtime.array_module(a, b, out)
    if xp is not np and a.dtype != in_dt:
        raise TypeError(f"a: gemm version {version} takes {dtypes.name(in_dt)}, got {dtypes.name(a.dtype)}")
    tc = version in TC_VERSIONS
    if xp is not np and tc and (K % 8 or N % 8):
        raise ValueError(f"b: gemm version {version} needs K and N multiples of 8 (16-byte rows), got K={K}, N={N}")
    out = _output("out", out, xp, (M, N), a.dtype, a.dtype)
    if xp is np:
        out[...] = gemm_reference(a, b, out.dtype)
        return out
    for name, arr in (("a", a), ("b", b), ("out", out)):
        if arr.size >= 2**31:
            raise ValueError(f"{name}: {arr.size} elements is more than the kernels' 32-bit indexing allows")
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.fill(0)
        return out
    if version == 3 or tc:
        # 128-bit / cp.async loads and vector stores need 16-byte aligned bases
        # (the kernels check row lengths, not base pointers).
        for name, arr in (("a", a), ("b", b), ("out", out)):
            if arr.data.ptr % 16:
                raise ValueError(f"{name}: gemm version {version} needs a 16-byte aligned array")
    arch = _ARCH.get(version)
    if arch is not None and runtime.device_arch() != arch[:-1]:
        raise ValueError(f"version: gemm version {version} needs an sm_{arch[:-1]} GPU (Hopper), "
                         f"this one is sm_{runtime.device_arch()}")
    suf = f"bf16_{dtypes.kernel_suffix(out.dtype)}" if tc else dtypes.kernel_suffix(a.dtype)
    kernel = runtime.get_kernel(family, f"gemm_forward_kernel_v{version}_{suf}", arch=arch)
    tiles_m, tiles_n = -(-M // BM), -(-N // BN)
    # v4 rasterises its own 1-D grid (grouped along M for L2 reuse); the others are 2-D.
    grid = (tiles_m * tiles_n,) if tc else (tiles_n, tiles_m)
    if version in PERSISTENT_VERSIONS:      # one block per SM walks the tiles
        grid = (min(tiles_m * tiles_n, runtime.sm_count()),)
    block = (threads,) if version != 1 else (BN, BM)
    if tc and kernel not in _CARVEOUT_SET:
        # Ask for the largest shared-memory carveout once per kernel: v4c's two 96 KB blocks
        # per SM need 192 KB of the 228 KB unified L1/shared array.
        kernel.preferred_shared_memory_carveout = 100
        _CARVEOUT_SET.add(kernel)
    runtime.launch(kernel, grid, block, (out, a, b, np.int32(M), np.int32(N), np.int32(K)), shared_mem=smem)
    return out
