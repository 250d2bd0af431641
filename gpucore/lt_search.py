"""cuBLASLt's configuration space, searched: more candidates for the timing race than the heuristic's 8.

cublas.CublasLt.choose races the heuristic's candidates (and gemmEx) once per GEMM shape. The
heuristic is a model of the kernels, not a measurement, and it offers at most 8 of the thousands
of configurations one algorithm has on Hopper (the nvjet family: ~600 tile shapes x split-K x
CTA swizzle x cluster shape x custom options). With `settings.lt_search = n` (0: off), the race
also gets the fastest few of up to n configurations drawn from that space:

  1. for each algorithm id among the heuristic's candidates, cublasLtMatmulAlgoInit and its
     capabilities (tile and stage ids, split-K, reduction schemes, swizzling, custom options);
  2. configurations drawn in a seeded random order from the product of those, each checked
     by cublasLtMatmulAlgoCheck against the plan (and the workspace limit), until n are valid;
  3. each valid one launched once untimed (cuBLASLt loads a kernel at its first launch), then once
     more on the real operands, all timed by events in one batch;
  4. the fastest LT_SEARCH_KEEP join the heuristic's candidates in the usual race.

The winner goes to the tune cache like any other choice (its 64 algorithm bytes), and a later
process restores it from there (`restore`), checked again against its plan, so two runs on one
machine still run the same algorithms and agree bit for bit. Split-K only with the reduction
schemes that sum in a workspace (not in place), so a configuration's sums keep one order.

The attribute numbers are cublasLt.h's (CUDA 12.x/13.x): cublasLtMatmulAlgoCapAttributes_t and
cublasLtMatmulAlgoConfigAttributes_t.
"""
from __future__ import annotations

import ctypes
import zlib

import numpy as np

from . import runtime

LT_SEARCH_KEEP = 8                      # searched configurations that join the race
CHECKS_PER_VALID = 20                   # give up after this many AlgoCheck calls per configuration wanted
_CAP_SPLITK, _CAP_REDUCTION_MASK, _CAP_SWIZZLE, _CAP_TILE_IDS, _CAP_CUSTOM_MAX = 0, 1, 2, 6, 7
_CAP_STAGES_IDS = 13
_CFG_ID, _CFG_TILE, _CFG_SPLITK, _CFG_REDUCTION, _CFG_SWIZZLE, _CFG_CUSTOM, _CFG_STAGES = 0, 1, 2, 3, 4, 5, 6
_CFG_CLUSTER = 8
_CLUSTERS = (0, 2, 3, 5)                # CLUSTER_SHAPE_AUTO, 1x1x1, 2x1x1, 1x2x1
_SPLITS = (1, 2, 3, 4, 6, 8)
_REDUCTIONS = (2, 4)                    # COMPUTE_TYPE, OUTPUT_TYPE: partial sums in a workspace (not INPLACE)
_COMPUTE_32F, _R_32F = 68, 0
_U32, _I32, _U16, _SZ, _VP = ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint16, ctypes.c_size_t, ctypes.c_void_p
_ALGO_BYTES, _RESULT_BYTES = 64, 96


def _bind(lib):
    """Declare the configuration functions on the loaded libcublasLt (once)."""
    if getattr(lib, "_gpucore_search_bound", False):
        return lib
    i32, sz, vp = ctypes.c_int, _SZ, _VP
    for name, args in {
            "cublasLtMatmulAlgoGetIds": [vp, i32, i32, i32, i32, i32, i32, i32, vp, ctypes.POINTER(i32)],
            "cublasLtMatmulAlgoInit": [vp, i32, i32, i32, i32, i32, i32, i32, vp],
            "cublasLtMatmulAlgoCapGetAttribute": [vp, i32, vp, sz, ctypes.POINTER(sz)],
            "cublasLtMatmulAlgoConfigSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoConfigGetAttribute": [vp, i32, vp, sz, ctypes.POINTER(sz)],
            "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, vp, vp]}.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, i32
    lib._gpucore_search_bound = True
    return lib


def _cap(lib, algo_ptr, attr, ctype=_U32):
    v, n = ctype(), _SZ()
    st = lib.cublasLtMatmulAlgoCapGetAttribute(algo_ptr, attr, ctypes.addressof(v), ctypes.sizeof(v), ctypes.byref(n))
    return v.value if st == 0 else None


def _cap_list(lib, algo_ptr, attr):
    n = _SZ()
    if lib.cublasLtMatmulAlgoCapGetAttribute(algo_ptr, attr, None, 0, ctypes.byref(n)) != 0 or n.value < 4:
        return []
    arr = (_U32 * (n.value // 4))()
    lib.cublasLtMatmulAlgoCapGetAttribute(algo_ptr, attr, ctypes.addressof(arr), n.value, ctypes.byref(n))
    return list(arr)


def config_id(lib, algo_ptr) -> int:
    v, n = _I32(), _SZ()
    _bind(lib).cublasLtMatmulAlgoConfigGetAttribute(algo_ptr, _CFG_ID, ctypes.addressof(v), ctypes.sizeof(v),
                                                    ctypes.byref(n))
    return v.value


def describe(lib, algo_ptr) -> str:
    """The configuration in words (for probes and notes)."""
    _bind(lib)

    def get(attr, ctype=_U32):
        v, n = ctype(), _SZ()
        lib.cublasLtMatmulAlgoConfigGetAttribute(algo_ptr, attr, ctypes.addressof(v), ctypes.sizeof(v), ctypes.byref(n))
        return v.value
    return (f"id={get(_CFG_ID, _I32)} tile={get(_CFG_TILE)} stages={get(_CFG_STAGES)} splitk={get(_CFG_SPLITK)} "
            f"red={get(_CFG_REDUCTION)} swizzle={get(_CFG_SWIZZLE)} custom={get(_CFG_CUSTOM)} "
            f"cluster={get(_CFG_CLUSTER, _U16)}")


def check(lib, handle, plan, algo, workspace_limit) -> bool:
    """AlgoCheck of a 96-byte buffer (algo + result) against the plan; the result lands in its tail."""
    res = (ctypes.c_ubyte * _RESULT_BYTES)()
    st = _bind(lib).cublasLtMatmulAlgoCheck(handle, plan.desc, plan.lay_b, plan.lay_a, plan.lay_c, plan.lay_d,
                                            ctypes.addressof(algo), ctypes.addressof(res))
    if st != 0:
        return False
    return int.from_bytes(bytes(res[64:72]), "little") <= workspace_limit


def mixed_radix(index: int, radices) -> list[int]:
    """The digits of `index` in the mixed radix `radices` (first radix varies slowest)."""
    digits = []
    for r in reversed(radices):
        index, d = divmod(index, r)
        digits.append(d)
    return digits[::-1]


def _spaces(lib, handle, plan):
    """(base algo, attribute lists) per algorithm id the heuristic offered."""
    ta, tb, tc = plan.lt_types[:3]
    td = plan.lt_types[3] if len(plan.lt_types) > 3 else tc     # D's type is C's unless a 4th is given
    out = []
    ids = sorted({config_id(lib, plan.algo_ptr(i)) for i in plan.candidates})
    for algo_id in ids:
        base = (ctypes.c_ubyte * _RESULT_BYTES)()
        if lib.cublasLtMatmulAlgoInit(handle, _COMPUTE_32F, _R_32F, ta, tb, tc, td, algo_id,
                                      ctypes.addressof(base)) != 0:
            continue
        p = ctypes.addressof(base)
        red_mask = _cap(lib, p, _CAP_REDUCTION_MASK) or 0
        splits = [(1, 0)]
        if _cap(lib, p, _CAP_SPLITK, _I32):
            splits += [(s, r) for s in _SPLITS[1:] for r in _REDUCTIONS if red_mask & r]
        attrs = [
            (_CFG_TILE, _U32, _cap_list(lib, p, _CAP_TILE_IDS) or [0]),
            (_CFG_STAGES, _U32, _cap_list(lib, p, _CAP_STAGES_IDS) or [0]),
            ("split", None, splits),
            (_CFG_SWIZZLE, _U32, [0, 1] if _cap(lib, p, _CAP_SWIZZLE) else [0]),
            (_CFG_CUSTOM, _U32, list(range(min(_cap(lib, p, _CAP_CUSTOM_MAX, _I32) or 0, 3) + 1))),
            (_CFG_CLUSTER, _U16, list(_CLUSTERS)),
        ]
        out.append((base, attrs))
    return out


def _configure(lib, base, attrs, digits):
    algo = (ctypes.c_ubyte * _RESULT_BYTES)()
    ctypes.memmove(algo, base, _ALGO_BYTES)
    ptr = ctypes.addressof(algo)

    def put(attr, ctype, value):
        v = ctype(value)
        lib.cublasLtMatmulAlgoConfigSetAttribute(ptr, attr, ctypes.addressof(v), ctypes.sizeof(v))
    for (attr, ctype, values), d in zip(attrs, digits):
        if attr == "split":
            split, red = values[d]
            put(_CFG_SPLITK, _U32, split)
            put(_CFG_REDUCTION, _U32, red)
        else:
            put(attr, ctype, values[d])
    return algo


def search(lt, plan, launch, c_ptr, budget: int, seed_text: str, workspace_limit: int) -> list[int]:
    """Indices (into plan's algorithms) of the fastest LT_SEARCH_KEEP of up to `budget` valid
    configurations, each launched once into c_ptr by launch(i, c_ptr). Heuristic candidates
    are not repeated. Returns [] when nothing valid was found."""
    lib = _bind(lt.lib)
    _, handle, _ = lt.device_state()
    known = {bytes.fromhex(plan.algo_hex(i)) for i in plan.candidates}
    rng = np.random.default_rng(zlib.crc32(seed_text.encode()))
    found = []
    for base, attrs in _spaces(lib, handle, plan):
        radices = [len(values) for _, _, values in attrs]
        total = int(np.prod(radices))
        want = budget - len(found)
        if want <= 0:
            break
        order = rng.permutation(total) if total <= 1 << 22 else rng.integers(0, total, size=want * CHECKS_PER_VALID)
        for checks, index in enumerate(order):
            if len(found) >= budget or checks >= want * CHECKS_PER_VALID:
                break
            algo = _configure(lib, base, attrs, mixed_radix(int(index), radices))
            key = bytes(algo[:_ALGO_BYTES])
            if key not in known and check(lib, handle, plan, algo, workspace_limit):
                known.add(key)
                found.append(plan.add(algo))
    if not found:
        return []
    cp = runtime.cupy
    ok = []
    for i in found:                     # a warm-up call each: cuBLASLt loads a kernel on its first launch,
        try:                            # and that host time would land between a timed pair's events
            launch(i, c_ptr)
            ok.append(i)
        except RuntimeError:            # offered and checked, then refused at launch: not a candidate
            pass
    if not ok:
        return []
    events = []
    for i in ok:                        # then one timed call each, queued back to back; one synchronisation
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        launch(i, c_ptr)
        stop.record()
        events.append((start, stop))
    events[-1][1].synchronize()
    timed = sorted((cp.cuda.get_elapsed_time(*ev), i) for ev, i in zip(events, ok))
    return [i for _, i in timed[:LT_SEARCH_KEEP]]


def restore(lt, plan, algo_hex: str, workspace_limit: int):
    """The plan's index of a configuration saved as hex (a searched winner), or None when it
    does not parse or no longer passes AlgoCheck for this plan (another cuBLASLt, say)."""
    try:
        raw = bytes.fromhex(algo_hex)
    except ValueError:
        return None
    if len(raw) != _ALGO_BYTES:
        return None
    lib = _bind(lt.lib)
    _, handle, _ = lt.device_state()
    algo = (ctypes.c_ubyte * _RESULT_BYTES)()
    ctypes.memmove(algo, raw, _ALGO_BYTES)
    if not check(lib, handle, plan, algo, workspace_limit):
        return None
    return plan.add(algo)
