"""GPT-2 input embedding, token + position, forward and backward (kernels_cu/encoder.cu).

    out[b, t]  = wte[tokens[b, t]] + wpe[t]
    dwte[v]   += sum of dout[b, t] over the (b, t) with tokens[b, t] == v      (parameter grads: +=)
    dwpe[t]   += sum over b of dout[b, t]

The backward is deterministic without float atomics: the launcher sorts the
unique keys tokens * N + position on the device (CuPy's sort, preprocessing
only), so every token's rows form one run of the sorted order, summed in
position order by the kernels (see encoder.cu for the chunked scheme that
keeps frequent tokens from serialising onto one SM). The forward is exact (one
rounding of wte + wpe); the backward accumulates in float32 and rounds once
into the gradient dtype.

Token ids must lie in [0, V): checked on the host before any launch (for CuPy
tokens with one device min/max reduction, i.e. one synchronisation; pass
check_tokens=False to skip it, e.g. inside a CUDA graph capture, when the ids
are known to be valid).

Kernel versions: v2 moves 16 bytes per access (C a multiple of 16/itemsize,
16-byte aligned arrays); v1 takes any C and alignment. `version=None` picks v2
whenever it applies. The backward also has v3 (v2's conditions, its default):
v2's dwpe, and a dwte with the same chunked scheme and summation order as v2
(bit-identical gradients) whose loads are really in flight, 32-bit sort keys
(token << bits | position) made by one kernel and sorted in place, a merge
that knows each chain's length before summing, and dwpe run on a side stream
alongside the sort (latency-bound: it leaves SMs idle) and dwte.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, runtime
from ._common import check_array, check_same_dtype, output

BLOCK = 256            # forward and dwpe: one thread per 16 bytes (v2) / element (v1)
DWTE_CHUNK = 64        # sorted positions per dwte block; CHUNK in encoder.cu
DWTE_MAX_BLOCK = 256   # dwte threads per block (a column slice), a multiple of 32
OVERLAP_SORT = True    # v3: dwpe on a side stream, alongside the key sort and dwte (False: one stream)


# ------------------------------------------------------------- references ----

def encoder_forward_reference(tokens, wte, wpe):
    """float64 wte[tokens] + wpe[:T]."""
    T = tokens.shape[1]
    return np.asarray(wte, np.float64)[tokens] + np.asarray(wpe, np.float64)[:T]


def encoder_backward_reference(dout, tokens, V, maxT):
    """float64 gradient contributions (dwte (V, C), dwpe (maxT, C))."""
    d64 = np.asarray(dout, dtype=np.float64)
    B, T, C = d64.shape
    dwte = np.zeros((V, C))
    np.add.at(dwte, np.asarray(tokens).reshape(-1), d64.reshape(-1, C))
    dwpe = np.zeros((maxT, C))
    dwpe[:T] = d64.sum(axis=0)
    return dwte, dwpe


# ----------------------------------------------------------------- helpers ---

def _check_tokens(tokens, V, xp, check):
    if not check or tokens.size == 0:
        return
    if xp is np:
        lo, hi = int(tokens.min()), int(tokens.max())
    else:
        lo, hi = (int(v) for v in xp.stack([tokens.min(), tokens.max()]).get())
    if lo < 0 or hi >= V:
        bad = lo if lo < 0 else hi
        raise ValueError(f"tokens: id {bad} is out of range [0, {V})")


def _pick(version, dtype, C, arrays, backward=False):
    """(version, W): v2 (forward) / v3 (backward) where 16-byte packs apply, else v1."""
    W = 16 // np.dtype(dtype).itemsize
    v2_ok = C % W == 0 and all(a.data.ptr % 16 == 0 for a in arrays)
    versions = (1, 2, 3) if backward else (1, 2)
    if version is None:
        version = versions[-1] if v2_ok else 1
    if version not in versions:
        raise ValueError(f"version: encoder {'backward' if backward else 'forward'} has kernel versions "
                         f"{', '.join(map(str, versions))}, got {version!r}")
    if version >= 2 and not v2_ok:
        raise ValueError(f"version: v{version} needs C a multiple of {W} and 16-byte aligned arrays (got C={C})")
    return version, (W if version >= 2 else 1)


def _grad(name, g, xp, rows, C, dtype, what):
    """The caller's gradient buffer (checked: (rows, C) -- any rows when rows is None --, dout's
    dtype) or a fresh zero one of (rows, C)."""
    if g is None:
        if rows is None:
            raise ValueError(f"{what}: needed to allocate {name} when {name} is None")
        return xp.zeros((rows, C), dtype=dtype)
    check_array(name, g, dtype=dtype, ndim=2)
    if g.shape[1] != C:
        raise ValueError(f"{name}: expected {C} columns to match dout, got shape {tuple(g.shape)}")
    if rows is not None and g.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} rows ({what}={rows}), got shape {tuple(g.shape)}")
    if (xp is np) != isinstance(g, np.ndarray):
        raise TypeError(f"{name}: must live on the same device as the inputs")
    return g


# ----------------------------------------------------------------- forward ---

def encoder_forward(tokens, wte, wpe, out=None, *, check_tokens=True, version=None):
    """out (B, T, C) = wte[tokens] + wpe[:T]; tokens (B, T) int32 in [0, V)."""
    check_array("tokens", tokens, dtype=np.int32, ndim=2)
    check_array("wte", wte, ndim=2)
    check_array("wpe", wpe, ndim=2)
    check_same_dtype(wte=wte, wpe=wpe)
    B, T = tokens.shape
    V, C = wte.shape
    if wpe.shape[1] != C:
        raise ValueError(f"wpe: expected {C} columns to match wte, got shape {tuple(wpe.shape)}")
    if T > wpe.shape[0]:
        raise ValueError(f"tokens: sequence length {T} exceeds wpe's {wpe.shape[0]} positions")
    xp = runtime.array_module(tokens, wte, wpe, out)
    out = output("out", out, xp, (B, T, C), wte.dtype)
    _check_tokens(tokens, V, xp, check_tokens)
    if xp is np:
        out[...] = encoder_forward_reference(tokens, wte, wpe).astype(wte.dtype)
        return out
    version, W = _pick(version, wte.dtype, C, (wte, wpe, out))
    N = B * T
    if N == 0 or C == 0:
        return out
    kernel = runtime.get_kernel("encoder", f"encoder_forward_kernel_v{version}_{dtypes.kernel_suffix(wte.dtype)}")
    runtime.launch(kernel, -(-(N * (C // W)) // BLOCK), BLOCK,
                   (out, tokens, wte, wpe, np.int32(N), np.int32(T), np.int32(C)))
    return out


# ---------------------------------------------------------------- backward ---

def encoder_backward(dout, tokens, dwte=None, dwpe=None, V=None, maxT=None, *, check_tokens=True, version=None):
    """Accumulate (+=) the embedding gradients -> (dwte (V, C), dwpe (maxT, C)).

    A None gradient is allocated zeroed: V is then required for dwte, and maxT
    defaults to T for dwpe. Gradients have dout's dtype.
    """
    check_array("dout", dout, ndim=3)
    check_array("tokens", tokens, dtype=np.int32, ndim=2)
    B, T, C = dout.shape
    if tokens.shape != (B, T):
        raise ValueError(f"tokens: expected shape {(B, T)} to match dout, got {tuple(tokens.shape)}")
    xp = runtime.array_module(dout, tokens, dwte, dwpe)
    if maxT is None and dwpe is None:
        maxT = T
    dwte = _grad("dwte", dwte, xp, V, C, dout.dtype, "V")
    dwpe = _grad("dwpe", dwpe, xp, maxT, C, dout.dtype, "maxT")
    V, maxT = dwte.shape[0], dwpe.shape[0]
    if T > maxT:
        raise ValueError(f"dwpe: {maxT} positions is fewer than the sequence length {T}")
    _check_tokens(tokens, V, xp, check_tokens)
    if xp is np:
        gte, gpe = encoder_backward_reference(dout, tokens, V, maxT)
        dwte[...] = (dwte.astype(np.float64) + gte).astype(dwte.dtype)
        dwpe[...] = (dwpe.astype(np.float64) + gpe).astype(dwpe.dtype)
        return dwte, dwpe
    version, W = _pick(version, dout.dtype, C, (dout, dwte, dwpe), backward=True)
    if B * T == 0 or C == 0:
        return dwte, dwpe
    if version == 3:
        _backward_v3(dwte, dwpe, dout, tokens, V, W)
        return dwte, dwpe
    _launch_dwpe(dwpe, dout, version, W)
    order, sorted_tokens = _sort_tokens(tokens)
    _launch_dwte(dwte, dout, order, sorted_tokens, version, W)
    return dwte, dwpe


# The three steps of the GPU backward, separate so that `gpucore bench encoder`
# can time each one.

def _launch_dwpe(dwpe, dout, version, W):
    """dwpe[:T] += dout.sum(0): one thread per (t, W columns), summing over b in order."""
    B, T, C = dout.shape
    kernel = runtime.get_kernel("encoder", f"encoder_backward_dwpe_kernel_v{version}_{dtypes.kernel_suffix(dout.dtype)}")
    runtime.launch(kernel, -(-(T * (C // W)) // BLOCK), BLOCK, (dwpe, dout, np.int32(B), np.int32(T), np.int32(C)))


def _sort_tokens(tokens):
    """(order, sorted_tokens), int32 (N,): the positions sorted by (token, position), on the device.

    The keys token * N + position are unique, so any correct sort gives the
    same result: the bucketing (and hence the summation order) is deterministic.
    """
    xp = runtime.cupy
    N = tokens.size
    keys = xp.sort(tokens.reshape(-1).astype(np.int64) * N + xp.arange(N, dtype=np.int64))
    return (keys % N).astype(np.int32), (keys // N).astype(np.int32)


def _launch_dwte(dwte, dout, order, sorted_tokens, version, W):
    """dwte += the per-token sums of dout's rows: the chunk kernel, then the merge of long runs."""
    B, T, C = dout.shape
    N, CW = B * T, C // W
    suf = f"v{version}_{dtypes.kernel_suffix(dout.dtype)}"
    num_chunks = -(-N // DWTE_CHUNK)
    block = min(-(-CW // 32) * 32, DWTE_MAX_BLOCK)
    grid = (num_chunks, -(-CW // block))
    scratch = runtime.cupy.empty((num_chunks, 2, C), dtype=np.float32)
    i32 = np.int32
    k_te = runtime.get_kernel("encoder", f"encoder_backward_dwte_kernel_{suf}")
    runtime.launch(k_te, grid, block, (dwte, scratch, dout, order, sorted_tokens, i32(N), i32(C)))
    k_merge = runtime.get_kernel("encoder", f"encoder_backward_dwte_merge_kernel_{suf}")
    runtime.launch(k_merge, grid, block, (dwte, scratch, sorted_tokens, i32(N), i32(C), i32(num_chunks)))


# ----------------------------------------------------------- backward, v3 ----

def _key_bits(N: int, V: int):
    """(bits, dtype) of the sort keys (token << bits) | position: uint32 whenever every key fits."""
    bits = max(1, (N - 1).bit_length())
    return bits, (np.uint32 if V <= 1 << (32 - bits) else np.uint64)


def _sort_keys(tokens, V):
    """(keys, bits): the keys (token << bits) | position of every position, sorted, on the current stream.

    The keys are unique, so the sorted order -- by (token, position) -- is the same whatever
    sort runs; CuPy's sort of unsigned ints is CUB's radix sort (no host synchronisation).
    """
    cp = runtime.cupy
    N = tokens.size
    bits, kdt = _key_bits(N, V)
    keys = cp.empty(N, dtype=kdt)
    ksuf = "u32" if kdt == np.uint32 else "u64"
    runtime.launch(runtime.get_kernel("encoder", f"encoder_sort_keys_kernel_{ksuf}"), -(-N // BLOCK), BLOCK,
                   (keys, tokens, np.int32(N), np.int32(bits)))
    keys.sort()
    return keys, bits


_SIDE: dict[int, tuple] = {}


def _side_stream():
    """(stream, fork event, join event) of this device, made once."""
    cp = runtime.cupy
    dev = cp.cuda.Device().id
    if dev not in _SIDE:
        _SIDE[dev] = (cp.cuda.Stream(non_blocking=True), cp.cuda.Event(disable_timing=True),
                      cp.cuda.Event(disable_timing=True))
    return _SIDE[dev]


def _backward_v3(dwte, dwpe, dout, tokens, V, W):
    """dwpe (v2's kernel) on a side stream, concurrently with the key sort and dwte (v3) on the current one.

    The sort is latency-bound (a few small CUB passes over N keys) and leaves most SMs idle;
    dwpe, independent of it, fills them, and then shares the bandwidth with the dwte kernels.
    """
    cp = runtime.cupy
    if not OVERLAP_SORT:
        _launch_dwpe(dwpe, dout, 2, W)
        keys, bits = _sort_keys(tokens, V)
        _launch_dwte_v3(dwte, dout, keys, bits)
        return
    main = cp.cuda.get_current_stream()
    side, forked, joined = _side_stream()
    forked.record(main)                  # dout, tokens, dwpe (and everything before) are ready
    side.wait_event(forked)
    with side:
        _launch_dwpe(dwpe, dout, 2, W)
    joined.record(side)
    keys, bits = _sort_keys(tokens, V)
    _launch_dwte_v3(dwte, dout, keys, bits)
    main.wait_event(joined)              # whatever the caller queues next sees dwpe done


DWTE_V3_UNROLL = 4     # rows in flight per thread in the v3 chunk kernel (4 or 8; see encoder.cu)
DWTE_MERGE_BLOCK = 64  # v3 merge threads per block (a multiple of 32: the kernel ballots per warp)


def _launch_dwte_v3(dwte, dout, keys, bits, unroll=None):
    """dwte += per-token sums of dout's rows from the sorted keys: chunk kernel, then merge."""
    B, T, C = dout.shape
    N = B * T
    W = 16 // dout.dtype.itemsize
    CW = C // W
    suf = f"{dtypes.kernel_suffix(dout.dtype)}_{'u32' if keys.dtype == np.uint32 else 'u64'}"
    num_chunks = -(-N // DWTE_CHUNK)
    block = min(-(-CW // 32) * 32, DWTE_MAX_BLOCK)
    scratch = runtime.cupy.empty((num_chunks, 2, C), dtype=np.float32)
    i32 = np.int32
    k_te = runtime.get_kernel("encoder", f"encoder_backward_dwte_kernel_v3_u{unroll or DWTE_V3_UNROLL}_{suf}")
    runtime.launch(k_te, (num_chunks, -(-CW // block)), block,
                   (dwte, scratch, dout, keys, i32(N), i32(C), i32(bits)))
    # The merge: one thread per 4 fp32 columns, 64 threads per block, so a hot token's chain of
    # partials (hundreds of chunks x C x 4 bytes) is read by C/256 blocks on as many SMs, not by
    # one SM at its ~100 GB/s share of L2 (most merge blocks exit at once).
    C4 = C // 4
    mblock = min(-(-C4 // 32) * 32, DWTE_MERGE_BLOCK)
    k_merge = runtime.get_kernel("encoder", f"encoder_backward_dwte_merge_kernel_v3_{suf}")
    runtime.launch(k_merge, (num_chunks, -(-C4 // mblock)), mblock,
                   (dwte, scratch, keys, i32(N), i32(C), i32(bits), i32(num_chunks)))
