"""The cuBLAS / cuBLASLt binding: row-major GEMMs on raw pointers, plans, and the autotune cache.

    gemm_ex(a, b, out, M, N, K, ...)   cuBLAS gemmEx / gemmStridedBatchedEx (ctypes, our own handle)
    lt_gemm(a, b, out, M, N, K, ...)   cuBLASLt matmul, optionally with the bias / GELU epilogues;
                                       False when Lt cannot (the caller then uses gemm_ex)
    lt_binding()                       the process's CublasLt (plans, tune cache), or None
    TuneCache(path)                    the winners of the timing race, on disk

Layout: cuBLAS is column-major. A row-major (r, c) array is, byte for byte, the
column-major (c, r) matrix -- its transpose. So row-major C = op(A) @ op(B) is
computed as column-major C^T = op(B)^T @ op(A)^T: pass B first, then A, swap
M and N, and keep each operand's transpose flag (a row-major array's leading
dimension is its row length, shape[-1]).

Precision: bf16 inputs multiply on tensor cores with float32 accumulation
(CUBLAS_COMPUTE_32F); float32 inputs use plain FP32 arithmetic (never TF32).

Why cuBLASLt, through ctypes: CuPy binds cuBLAS but not cuBLASLt, whose matmul
takes fused epilogues (CUBLASLT_EPILOGUE_BIAS: the forward bias costs nothing;
GELU_AUX(_BIAS): the MLP's GELU in the fc GEMM, its input kept as the "aux"
matrix). Both gemmEx and Lt are called through ctypes, unlike CuPy's cuBLAS wrappers, so
they can be captured into a CUDA graph (CuPy's setStream refuses during a capture). We call
the handful of functions we need from the libcublas / libcublasLt that CuPy has already
loaded. Enum values and the heuristic-result layout are from cublasLt.h (CUDA
12.x/13.x; the ABI is unchanged since 11.0).

Plans: descriptors + up to LT_ALGO_CANDIDATES algorithms from the heuristic,
built once per (shape, dtypes, alignments, epilogue) and cached; a call then
costs two ctypes calls. The algorithm (autotuning): the heuristic's first
choice is not always the fastest (measured: no-bias forward 65536x3072x768,
0.457 ms vs gemmEx 0.428 ms), so on the first call of a plan big enough to
matter, every candidate -- and plain gemmEx when there is no epilogue -- is
timed in interleaved rounds on the real operands and the fastest wins (the heuristic's
first choice keeps its place unless another is LT_TUNE_MARGIN faster). The
choice is stored on disk (TuneCache, keyed by GPU, cuBLASLt version and plan
key) so that the next process runs the *same* algorithms: different
algorithms round differently, and two training runs must agree bit for bit.
Inside a CUDA-graph capture nothing is timed (the first candidate is used).

Choices come from gpucore.settings: `cublaslt` (False: lt_gemm declines),
`lt_autotune`, `lt_try_gemmex`, `lt_autotune_min_flops`, `lt_tune_cache`, and
`lt_search` (> 0: configurations beyond the heuristic's join the race, gpucore/lt_search.py;
a winner saved from such a race is restored by its bytes in later processes).
The fused bias gradient (CUBLASLT_EPILOGUE_BGRADB) was measured slower than
our column-sum kernel at every GPT-2 shape and is not bound here any more
(tools/notes/matmul.md, "Removed in the restructuring").
"""
from __future__ import annotations

import ctypes
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from . import dtypes, lt_search, runtime, settings

LT_ALGO_CANDIDATES = 8                  # heuristic results requested per plan
LT_TUNE_MARGIN = 0.01                   # another algorithm must be 1% faster to replace the first choice
LT_RACE_ROUNDS, LT_RACE_REPS = 7, 5     # the race: median of 7 interleaved rounds of 5 calls (_time_each)
LT_WORKSPACE_BYTES = 32 << 20           # cuBLAS' recommendation for Hopper
GEMMEX = "gemmex"                       # a plan's choice when plain gemmEx won the race
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_AUX_POINTER, _DESC_AUX_LD = 11, 12
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER, _DESC_FAST_ACCUM = 17, 18, 25
_DESC_D_SCALE_POINTER, _DESC_AMAX_D_POINTER = 20, 21
_SCALE_ATTRS = (_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER, _DESC_D_SCALE_POINTER, _DESC_AMAX_D_POINTER)
_CUDA_R_8F_E4M3, _CUDA_R_8F_E5M2 = 28, 29     # cudaDataType_t of the FP8 formats
FP8_TYPES = {"e4m3": _CUDA_R_8F_E4M3, "e5m2": _CUDA_R_8F_E5M2}
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS = 1, 4
_EPILOGUE_GELU_AUX, _EPILOGUE_GELU_AUX_BIAS = 160, 164
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)      # A, B, C, D
_HEURISTIC_BYTES = 96                   # cublasLtMatmulHeuristicResult_t: algo[64] ws(8) state(4) waves(4) int[4]
_ALGO_BYTES = 64
_COMPUTE_32F = 68


# ------------------------------------------------------------------ cuBLAS ----

def _cublas():
    # Imported lazily: the module needs libcublas, absent on CPU-only machines.
    from cupy_backends.cuda.libs import cublas
    return cublas


def cuda_type(dtype) -> int:
    """The cudaDataType of a float32 / bfloat16 array."""
    rt = runtime.cupy.cuda.runtime
    return rt.CUDA_R_16BF if dtype == dtypes.bfloat16 else rt.CUDA_R_32F


def _load(stem: str):
    """The CUDA library `stem` (libcublas, libcublasLt) that CuPy loaded: dlopen by soname
    returns the copy already in the process."""
    for name in (f"{stem}.so.13", f"{stem}.so.12", f"{stem}.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError(f"{stem}.so.13/.12 not found")


_OP_N, _OP_T, _GEMM_DEFAULT = 0, 1, -1


class Cublas:
    """cuBLAS's gemmEx through ctypes, with our own handle and workspace per device.

    Why not CuPy's binding: its setStream refuses to run while a stream is being captured, so
    a GEMM through it cannot be part of a CUDA graph (gpucore/step_graph.py). Ours sets the
    stream itself. The workspace is set explicitly (cuBLAS's default size on Hopper, 32 MiB):
    a captured cuBLAS call must not allocate one itself.
    """

    def __init__(self):
        _cublas()                           # CuPy loads libcublas: dlopen below finds that copy
        lib = _load("libcublas")
        vp, i32, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_size_t
        mat = [vp, i32, i32]                # pointer, data type, leading dimension
        for fname, args in {
                "cublasCreate_v2": [ctypes.POINTER(vp)],
                "cublasSetStream_v2": [vp, vp],
                "cublasSetWorkspace_v2": [vp, vp, sz],
                "cublasGemmEx": [vp, i32, i32, i32, i32, i32, vp, *mat, *mat, vp, *mat, i32, i32],
                "cublasGemmStridedBatchedEx": [vp, i32, i32, i32, i32, i32, vp, *mat, i64, *mat, i64, vp,
                                               *mat, i64, i32, i32, i32]}.items():
            f = getattr(lib, fname)
            f.argtypes, f.restype = args, i32
        self.lib = lib
        self.handles = {}

    def _ok(self, status, what):
        if status != 0:
            raise RuntimeError(f"cuBLAS {what} failed with status {status}")

    def handle(self):
        """This device's handle, bound to the current CuPy stream."""
        dev = runtime.cupy.cuda.Device().id
        if dev not in self.handles:
            h = ctypes.c_void_p()
            self._ok(self.lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
            ws = runtime.cupy.empty(LT_WORKSPACE_BYTES, dtype=np.uint8)
            self._ok(self.lib.cublasSetWorkspace_v2(h, ctypes.c_void_p(ws.data.ptr), LT_WORKSPACE_BYTES),
                     "cublasSetWorkspace")
            self.handles[dev] = (h, ws)
        h = self.handles[dev][0]
        self._ok(self.lib.cublasSetStream_v2(h, ctypes.c_void_p(runtime.cupy.cuda.get_current_stream().ptr)),
                 "cublasSetStream")
        return h


_CUBLAS: list = []                      # [Cublas]: made once per process


def gemm_ex(a, b, out, M, N, K, transpose_a=False, transpose_b=False, alpha=1.0, beta=0.0, batch=1):
    """Row-major out (batch, M, N) = alpha * op(a) @ op(b) + beta * out on the current CuPy stream.

    a is (M, K) or, transposed, (K, M); b is (K, N) or (N, K); one matrix per
    batch entry, densely packed. Shapes are trusted: callers validate.
    """
    if not _CUBLAS:
        _CUBLAS.append(Cublas())
    cb = _CUBLAS[0]
    handle = cb.handle()
    # Host scalars (the handle's default pointer mode): cuBLAS reads them before the call returns.
    al = ctypes.c_float(alpha)
    be = ctypes.c_float(beta)
    op_a = _OP_T if transpose_a else _OP_N
    op_b = _OP_T if transpose_b else _OP_N
    lda, ldb, ldc = a.shape[-1], b.shape[-1], N
    ta, tb, tc = cuda_type(a.dtype), cuda_type(b.dtype), cuda_type(out.dtype)
    pa, pb, pc = (ctypes.c_void_p(x.data.ptr) for x in (a, b, out))
    # Column-major C^T (N, M) = op(B)^T (N, K) @ op(A)^T (K, M).
    if batch == 1:
        status = cb.lib.cublasGemmEx(handle, op_b, op_a, N, M, K, ctypes.byref(al), pb, tb, ldb, pa, ta, lda,
                                     ctypes.byref(be), pc, tc, ldc, _COMPUTE_32F, _GEMM_DEFAULT)
    else:
        status = cb.lib.cublasGemmStridedBatchedEx(handle, op_b, op_a, N, M, K, ctypes.byref(al),
                                                   pb, tb, ldb, K * N, pa, ta, lda, M * K,
                                                   ctypes.byref(be), pc, tc, ldc, M * N, batch,
                                                   _COMPUTE_32F, _GEMM_DEFAULT)
    cb._ok(status, "gemmEx" if batch == 1 else "gemmStridedBatchedEx")


# ------------------------------------------------------------- tune cache ----

class TuneCache:
    """Autotune winners {key: algorithm bytes as hex, or GEMMEX}, in memory and in a JSON file.

    Writes merge with what other processes wrote meanwhile and replace the file
    atomically; a read-only location keeps the choice for this process only.
    """

    def __init__(self, path):
        self.path = Path(path)
        self._entries = None

    def entries(self) -> dict:
        if self._entries is None:
            self._entries = _read_json_dict(self.path)
        return self._entries

    def get(self, key: str):
        return self.entries().get(key)

    def put(self, key: str, value: str) -> None:
        entries = self.entries()
        entries[key] = value
        try:
            merged = _read_json_dict(self.path)
            merged.update(entries)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            pass                        # a read-only cache dir: the choice still holds for this process


def _read_json_dict(path) -> dict:
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def pick_fastest(times, margin=LT_TUNE_MARGIN) -> int:
    """Index of the candidate to use: the fastest, unless it beats candidate 0 by less than `margin`."""
    best = min(range(len(times)), key=lambda i: (times[i], i))
    return best if times[best] < times[0] * (1.0 - margin) else 0


def _time_each(fns, rounds=LT_RACE_ROUNDS, reps=LT_RACE_REPS):
    """ms per call of each fn: one warm-up call each, then `rounds` interleaved rounds of `reps`
    calls each; the median round. A candidate whose warm-up call raises (an algorithm Lt offered
    but then refuses) gets inf.
    Why the median of 7 x 5 (was: the min of 3 x 3): at d48 the short race kept the heuristic's
    first choice where another candidate is 3-5% faster when timed at length (the dW GEMMs,
    attproj's dx: 2.4 ms a d48 step, tools/probes/race_check.py); the min of a few calls rewards
    the lucky burst of the clock, not the candidate that is faster under sustained load."""
    cp = runtime.cupy
    ok = []
    for i, fn in enumerate(fns):
        try:
            fn()
            ok.append(i)
        except RuntimeError:
            pass
    times = [[] for _ in fns]
    for _ in range(rounds):
        for i in ok:
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(reps):
                fns[i]()
            stop.record()
            stop.synchronize()
            times[i].append(cp.cuda.get_elapsed_time(start, stop) / reps)
    return [sorted(t)[len(t) // 2] if t else float("inf") for t in times]


def _capturing() -> bool:
    try:
        return bool(runtime.cupy.cuda.get_current_stream().is_capturing())
    except Exception:  # noqa: BLE001 - the legacy stream under a global capture raises: treat as capturing
        return True


# ---------------------------------------------------------------- cuBLASLt ----

class Plan:
    """Descriptors, the heuristic's candidate algorithms and (once decided) the choice."""

    def __init__(self, desc, lay_b, lay_a, lay_c, results, candidates, lt_types=None, lay_d=None):
        self.desc, self.lay_b, self.lay_a, self.lay_c = desc, lay_b, lay_a, lay_c
        self.lay_d = lay_c if lay_d is None else lay_d   # D's layout: C's but for an FP8 output
        self.results = results          # the heuristic-result array (kept alive: algos point into it)
        self.candidates = candidates    # indices of the usable results, heuristic order
        self.lt_types = lt_types        # (Lt's A, B, C[, D]) cudaDataTypes: what AlgoInit needs (lt_search)
        self.extra = []                 # 96-byte algorithm buffers added later (searched, or from the cache)
        self.raced = None               # the indices the race timed (candidates + searched), in order
        self.choice = None              # an index into results, GEMMEX, or None (not decided yet)
        self.times = None               # ms per raced candidate (+ gemmEx) when it was timed

    def algo_ptr(self, i):
        n = len(self.results) // _HEURISTIC_BYTES
        return ctypes.addressof(self.results) + i * _HEURISTIC_BYTES if i < n else ctypes.addressof(self.extra[i - n])

    def algo_hex(self, i):
        return ctypes.string_at(self.algo_ptr(i), _ALGO_BYTES).hex()

    def add(self, algo) -> int:
        """Index of a further algorithm buffer (at least _ALGO_BYTES, kept alive here)."""
        self.extra.append(algo)
        return len(self.results) // _HEURISTIC_BYTES + len(self.extra) - 1

    def label(self, i) -> str:
        """"lt#k/n" for the heuristic's k-th of n candidates, "searched" for any other."""
        return f"lt#{self.candidates.index(i) + 1}/{len(self.candidates)}" if i in self.candidates else "searched"


class CublasLt:
    """The cuBLASLt library, one handle and one workspace per device, the plan cache and tune caches."""

    def __init__(self):
        lib = _load("libcublasLt")
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
        self.handles, self.workspaces = {}, {}
        self.forget()

    def forget(self):
        """Drop every plan and in-memory tune choice, as a new process starts (the files stay)."""
        self.plans = {}
        self.tune_caches = {}

    def tune_cache(self) -> TuneCache:
        """The TuneCache of the current settings' file (default: next to the compiled kernels)."""
        path = settings.current().lt_tune_cache or runtime.CACHE_DIR / "cublaslt_algos.json"
        key = str(path)
        if key not in self.tune_caches:
            self.tune_caches[key] = TuneCache(path)
        return self.tune_caches[key]

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
        """(device id, handle, workspace) of the current device, created on first use."""
        dev = runtime.cupy.cuda.Device().id
        if dev not in self.handles:
            self.handles[dev] = self._create(self.lib.cublasLtCreate)
            self.workspaces[dev] = runtime.cupy.empty(LT_WORKSPACE_BYTES, dtype=np.uint8)
        return dev, self.handles[dev], self.workspaces[dev]

    def matmul(self, handle, plan, i, alpha, beta, a_ptr, b_ptr, c_ptr, d_ptr, ws, stream, what):
        """cublasLtMatmul of the plan's algorithm i on the shared workspace ws: D = alpha * (Lt's
        A = b, B = a) + beta * C (alpha, beta: ctypes floats)."""
        self._ok(self.lib.cublasLtMatmul(handle, plan.desc, ctypes.addressof(alpha), b_ptr, plan.lay_b, a_ptr,
                                         plan.lay_a, ctypes.addressof(beta), c_ptr, plan.lay_c, d_ptr, plan.lay_d,
                                         plan.algo_ptr(i), ws.data.ptr, LT_WORKSPACE_BYTES, stream), what)

    def set_pointers(self, plan, bias_ptr, aux_ptr, scale_ptrs=None):
        """The per-call epilogue and scale pointers (a plan is shared by every call of its shape)."""
        if scale_ptrs:
            for attr, ptr in zip(_SCALE_ATTRS, scale_ptrs):
                self._set(self.lib.cublasLtMatmulDescSetAttribute, plan.desc, attr, ctypes.c_void_p(ptr))
        if bias_ptr:
            self._set(self.lib.cublasLtMatmulDescSetAttribute, plan.desc, _DESC_BIAS_POINTER,
                      ctypes.c_void_p(bias_ptr))
        if aux_ptr:
            self._set(self.lib.cublasLtMatmulDescSetAttribute, plan.desc, _DESC_AUX_POINTER,
                      ctypes.c_void_p(aux_ptr))

    def plan(self, key, handle, op_b, op_a, N, M, K, ldb, lda, tb, ta, tc, epilogue, bias_ptr, aligns,
             aux_ptr=0, scale_ptrs=None, fast_accum=False, td=None):
        """The Plan for C^T = op(B)^T op(A)^T (+ epilogue), or None if Lt has no algorithm.
        scale_ptrs: (Lt's A = our b, Lt's B = our a[, D's scale, D's amax]) device float32 pointers
        (FP8). td: D's cudaDataType when it is not C's (an FP8 output)."""
        if key in self.plans:
            return self.plans[key]
        lib = self.lib
        desc = self._create(lib.cublasLtMatmulDescCreate, _COMPUTE_32F, runtime.cupy.cuda.runtime.CUDA_R_32F)
        self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSA, ctypes.c_int32(op_b))
        self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSB, ctypes.c_int32(op_a))
        self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_EPILOGUE, ctypes.c_uint32(epilogue))
        if bias_ptr:                          # the heuristic reads the pointers' alignment
            self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_BIAS_POINTER, ctypes.c_void_p(bias_ptr))
        if scale_ptrs:
            for attr, ptr in zip(_SCALE_ATTRS, scale_ptrs):
                self._set(lib.cublasLtMatmulDescSetAttribute, desc, attr, ctypes.c_void_p(ptr))
        if fast_accum:
            self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_FAST_ACCUM, ctypes.c_int8(1))
        if aux_ptr:   # the GELU input matrix: D's column-major shape (N, M), leading dimension N
            self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_AUX_POINTER, ctypes.c_void_p(aux_ptr))
            self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_AUX_LD, ctypes.c_int64(N))
        # Column-major layouts of the stored matrices: (rows, cols, ld) = (row length, row count, row length).
        lay_b = self._create(lib.cublasLtMatrixLayoutCreate, tb, *((N, K) if op_b == 0 else (K, N)), ldb)
        lay_a = self._create(lib.cublasLtMatrixLayoutCreate, ta, *((K, M) if op_a == 0 else (M, K)), lda)
        lay_c = self._create(lib.cublasLtMatrixLayoutCreate, tc, N, M, N)
        lay_d = lay_c if td is None else self._create(lib.cublasLtMatrixLayoutCreate, td, N, M, N)
        pref = self._create(lib.cublasLtMatmulPreferenceCreate)
        self._set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE_BYTES,
                  ctypes.c_uint64(LT_WORKSPACE_BYTES))
        for attr, al in zip(_PREF_MIN_ALIGNMENT, aligns):
            self._set(lib.cublasLtMatmulPreferenceSetAttribute, pref, attr, ctypes.c_uint32(al))
        results = (ctypes.c_ubyte * (LT_ALGO_CANDIDATES * _HEURISTIC_BYTES))()
        count = ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, lay_b, lay_a, lay_c, lay_d, pref,
                                                    LT_ALGO_CANDIDATES, ctypes.addressof(results),
                                                    ctypes.byref(count))
        candidates = []
        if status == 0:
            for i in range(min(count.value, LT_ALGO_CANDIDATES)):
                off = i * _HEURISTIC_BYTES
                state = int.from_bytes(bytes(results[off + 72:off + 76]), "little", signed=True)
                ws = int.from_bytes(bytes(results[off + 64:off + 72]), "little")
                if state == 0 and ws <= LT_WORKSPACE_BYTES:
                    candidates.append(i)
        types = (tb, ta, tc) if td is None else (tb, ta, tc, td)
        plan = Plan(desc, lay_b, lay_a, lay_c, results, candidates, types, lay_d) if candidates else None
        self.plans[key] = plan
        return plan

    def tune_key(self, key) -> str:
        """The plan key without the device index, with what makes timings and algorithms differ."""
        name = runtime.device_properties()["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        return f"{name}|sm{runtime.sm_count()}|lt{self.version}|{key[1:]}".replace(" ", "")

    def choose(self, plan, key, launch, out, beta, flops, gemmex):
        """Decide plan.choice (see the module docstring). launch(i, c_ptr) runs candidate i into
        c_ptr; gemmex(c) runs plain gemmEx into array c, or is None when gemmEx is no candidate."""
        if flops < settings.current().lt_autotune_min_flops or (len(plan.candidates) == 1 and gemmex is None):
            plan.choice = plan.candidates[0]
            return
        cache = self.tune_cache()
        tkey = self.tune_key(key)
        saved = cache.get(tkey)
        if saved == GEMMEX and gemmex is not None:
            plan.choice = GEMMEX
            return
        for i in plan.candidates:
            if saved == plan.algo_hex(i):
                plan.choice = i
                return
        if saved and saved != GEMMEX:   # a searched winner: restored when it still checks for this plan
            restored = lt_search.restore(self, plan, saved, LT_WORKSPACE_BYTES)
            if restored is not None:
                plan.choice = restored
                return
        if _capturing():
            return                      # undecided: candidate 0 now, timed on a later call outside capture
        # beta == 0: the output is only written, and the chosen algorithm rewrites it last -> time in place.
        # beta != 0: out is read (+=); time on a scratch copy of its shape so out is untouched.
        target = out if beta == 0.0 else runtime.cupy.empty_like(out)
        raced = list(plan.candidates)
        budget = settings.current().lt_search
        if budget > 0 and plan.lt_types is not None:
            raced += lt_search.search(self, plan, launch, target.data.ptr, budget, tkey, LT_WORKSPACE_BYTES)
        fns = [lambda i=i: launch(i, target.data.ptr) for i in raced]
        if gemmex is not None:
            fns.append(lambda: gemmex(target))
        times = _time_each(fns)
        best = pick_fastest(times)
        plan.raced, plan.times = raced, times
        plan.choice = GEMMEX if best == len(raced) else raced[best]
        cache.put(tkey, GEMMEX if plan.choice == GEMMEX else plan.algo_hex(plan.choice))


_LT: list = []                          # [CublasLt or None, status]: loaded once per process


def lt_binding():
    """The process's CublasLt, or None when cuBLASLt is off (settings) or did not load (lt_status)."""
    if not settings.current().cublaslt:
        return None
    if not _LT:
        try:
            _cublas()                   # makes CuPy load libcublas and libcublasLt
            _LT[:] = [CublasLt(), "ok"]
        except Exception as e:  # noqa: BLE001 - any failure means: use gemmEx
            _LT[:] = [None, f"unavailable: {e}"]
    return _LT[0]


def lt_status() -> str:
    """'ok', 'not tried', or why cuBLASLt is unavailable."""
    return _LT[1] if _LT else "not tried"


def _alignment(ptr: int) -> int:
    return min(256, ptr & -ptr) if ptr else 256


def _epilogue(bias, gelu) -> int:
    if gelu:
        return _EPILOGUE_GELU_AUX_BIAS if bias is not None else _EPILOGUE_GELU_AUX
    return _EPILOGUE_BIAS if bias is not None else _EPILOGUE_DEFAULT


def lt_gemm(a, b, out, M, N, K, transpose_a=False, transpose_b=False, alpha=1.0, beta=0.0, bias=None,
            gelu_aux=None, c=None) -> bool:
    """Row-major out = alpha * op(a) @ op(b) + beta * out [+ bias over rows] by cublasLtMatmul.

    bias (N,) must have out's dtype (Lt's bias has D's type). gelu_aux (M, N), out's dtype and
    layout: it receives the sum above and out gets its GELU (tanh form; GELU_AUX(_BIAS)).
    c (M, N), out's dtype and layout, optional: Lt's C matrix apart from D -- beta * c is added
    in place of beta * out, and out is only written (a residual added in the epilogue).
    Returns False (nothing launched) when cuBLASLt is off or unavailable, has no algorithm for
    this case, or plain gemmEx won the timing race: the caller then runs gemm_ex (with the bias
    or the GELU some other way).
    """
    lt = lt_binding()
    if lt is None:
        return False
    dev, handle, ws = lt.device_state()
    op_a, op_b = int(transpose_a), int(transpose_b)          # CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
    ta, tb, tc = cuda_type(a.dtype), cuda_type(b.dtype), cuda_type(out.dtype)
    gelu = gelu_aux is not None
    epilogue = _epilogue(bias, gelu)
    bias_ptr = bias.data.ptr if bias is not None else 0
    aux_ptr = gelu_aux.data.ptr if gelu else 0
    c_ptr = c.data.ptr if c is not None else 0
    aligns = tuple(_alignment(p) for p in (b.data.ptr, a.data.ptr, c_ptr or out.data.ptr, out.data.ptr))
    # The None stands where the bias-gradient epilogue's vector type was: the key (and so every
    # tune-cache entry written before that epilogue was removed) stays the same. The aux
    # alignment is appended only for the GELU epilogues, and "c" only for a separate C, for
    # the same reason.
    key = (dev, op_a, op_b, M, N, K, a.shape[-1], b.shape[-1], ta, tb, tc, epilogue, None,
           _alignment(bias_ptr) if bias is not None else 0, aligns, beta != 0.0)
    if gelu:
        key = key[:-1] + (_alignment(aux_ptr), key[-1])
    if c is not None:
        key = key[:-1] + ("c", key[-1])
    plan = lt.plan(key, handle, op_b, op_a, N, M, K, b.shape[-1], a.shape[-1], tb, ta, tc, epilogue, bias_ptr,
                   aligns, aux_ptr)
    if plan is None:
        return False
    lt.set_pointers(plan, bias_ptr, aux_ptr)
    al, be = ctypes.c_float(alpha), ctypes.c_float(beta)
    stream = runtime.cupy.cuda.get_current_stream().ptr
    pa, pb = a.data.ptr, b.data.ptr

    def launch(i, d_ptr):
        lt.matmul(handle, plan, i, al, be, pa, pb, c_ptr or d_ptr, d_ptr, ws, stream, "cublasLtMatmul")

    s = settings.current()
    if not s.lt_autotune:
        choice = plan.candidates[0]
    else:
        if plan.choice is None:
            gemmex = None
            if epilogue == _EPILOGUE_DEFAULT and s.lt_try_gemmex and c is None:
                def gemmex(target):
                    gemm_ex(a, b, target, M, N, K, transpose_a, transpose_b, alpha, beta)
            # with a separate C, out is only written: the race may time into it
            lt.choose(plan, key, launch, out, 0.0 if c is not None else beta, 2.0 * M * N * K, gemmex)
        choice = plan.choice if plan.choice is not None else plan.candidates[0]
    if choice == GEMMEX:
        return False
    launch(choice, out.data.ptr)
    return True


def lt_fp8_gemm(a8, b8, out, M, N, K, a_format, b_format, a_scale_inv, b_scale_inv, beta=0.0, bias=None,
                fast_accum=False, gelu_aux=None, c=None, out_format=None, out_scale=None, out_amax=None) -> None:
    """Row-major out (M, N) = (a (M, K) @ b (N, K)^T) * a_scale_inv * b_scale_inv [+ bias] [+ beta * out].

    a8, b8: uint8 arrays holding FP8 bytes (a_format / b_format "e4m3" or "e5m2"; not both e5m2),
    K-contiguous as cuBLASLt's FP8 path requires ("TN"); the scales are (1,) float32 device arrays
    (read by the GEMM, so they may change on the device between calls). out bf16, bias bf16 (N,).
    fast_accum: Hopper's faster FP8 accumulation (partial sums in lower precision; Transformer
    Engine uses it for the forward only). gelu_aux (M, N) bf16: it receives the sum and out its
    GELU (GELU_AUX(_BIAS), as lt_gemm). c (M, N) bf16, optional: Lt's C apart from D, as lt_gemm's
    (beta * c added, out only written). Raises RuntimeError when cuBLASLt cannot (no fallback:
    callers check fp8_supported() first).
    out_format ("e4m3" / "e5m2"): out is uint8 and receives the result's FP8 bytes times out_scale
    ((1,) float32 device array), saturating; out_amax ((1,) float32, optional) receives max |result|
    before the scale. Needs beta = 0; Lt's C is then a bf16 layout at a8's address that beta = 0
    never reads (Lt refuses C and D at one address with different types).
    """
    lt = lt_binding()
    if lt is None:
        raise RuntimeError("FP8 matmul needs cuBLASLt: " + lt_status())
    dev, handle, ws = lt.device_state()
    ta, tb = FP8_TYPES[a_format], FP8_TYPES[b_format]
    tc = cuda_type(out.dtype if out_format is None else dtypes.bfloat16)
    td = None if out_format is None else FP8_TYPES[out_format]
    if td is not None and (beta != 0.0 or c is not None or gelu_aux is not None):
        raise ValueError("out_format: an FP8 output needs beta = 0, no c and no gelu_aux")
    epilogue = _epilogue(bias, gelu_aux is not None)
    bias_ptr = bias.data.ptr if bias is not None else 0
    aux_ptr = gelu_aux.data.ptr if gelu_aux is not None else 0
    c_ptr = c.data.ptr if c is not None else (a8.data.ptr if td is not None else 0)
    aligns = tuple(_alignment(p) for p in (b8.data.ptr, a8.data.ptr, c_ptr or out.data.ptr, out.data.ptr))
    key = (dev, "fp8", M, N, K, ta, tb, tc, epilogue, _alignment(bias_ptr) if bias is not None else 0, aligns,
           _alignment(aux_ptr) if aux_ptr else 0, beta != 0.0, bool(fast_accum))
    if c is not None:
        key = key + ("c",)
    scales = (b_scale_inv.data.ptr, a_scale_inv.data.ptr)   # Lt's A is our b
    if td is not None:          # appended only here: the keys (and tune-cache entries) of bf16 outputs stay
        key = key + (td, out_amax is not None)
        scales += (out_scale.data.ptr, out_amax.data.ptr if out_amax is not None else 0)
    plan = lt.plan(key, handle, 1, 0, N, M, K, K, K, tb, ta, tc, epilogue, bias_ptr, aligns,
                   aux_ptr=aux_ptr, scale_ptrs=scales, fast_accum=fast_accum, td=td)
    if plan is None:
        raise RuntimeError(f"cuBLASLt has no FP8 algorithm for ({M} x {K}) @ ({N} x {K})^T "
                           f"{a_format} x {b_format} (M, N, K must be multiples of 16)")
    lt.set_pointers(plan, bias_ptr, aux_ptr, scales)
    al, be = ctypes.c_float(1.0), ctypes.c_float(beta)
    stream = runtime.cupy.cuda.get_current_stream().ptr

    def launch(i, d_ptr):
        lt.matmul(handle, plan, i, al, be, a8.data.ptr, b8.data.ptr, c_ptr or d_ptr, d_ptr, ws, stream,
                  "cublasLtMatmul (FP8)")

    if settings.current().lt_autotune and plan.choice is None:
        lt.choose(plan, key, launch, out, 0.0 if c is not None else beta, 2.0 * M * N * K, None)
    launch(plan.choice if plan.choice is not None else plan.candidates[0], out.data.ptr)


def plan_choice(M, N, K, transpose_a=False, transpose_b=False, bias=False, accumulate=False, gelu=False) -> str:
    """Which algorithm lt_gemm runs for this GEMM (as the training path calls it): "lt#i/n" (the
    heuristic's i-th of n candidates), "gemmEx" (it won the race), "untuned", "-" (no cuBLASLt)
    or "?" (not planned yet). For benchmarks and notes."""
    lt = lt_binding()
    if lt is None:
        return "-"
    epilogue = _epilogue(True if bias else None, gelu)
    for key, plan in lt.plans.items():
        # key = (dev, op_a, op_b, M, N, K, lda, ldb, ta, tb, tc, epilogue, None, bias alignment, aligns, beta != 0)
        if plan is None or key[1:6] != (int(transpose_a), int(transpose_b), M, N, K) or key[11] != epilogue \
                or key[-1] != accumulate:
            continue
        if plan.choice is None:
            return "untuned"
        if plan.choice == GEMMEX:
            return "gemmEx"
        return plan.label(plan.choice)
    return "?"
