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
v4 (v3's conditions and V <= 65536; the backward's default there, v3 above):
v3 with its CuPy sort replaced by a stable counting sort of the positions by
token (kernels_cu/encoder_v4.cu: per-tile counts and stable ranks, a scan, a
scatter: three small launches, no host synchronisation) that writes exactly
v3's sorted keys, so the gradients are bit-identical to v3's.
v5 (v3's conditions, any V): v4's counting sort (CuPy's sort where V > 65536), v3's merge,
and a dwte chunk kernel (kernels_cu/encoder_v5.cu) that streams each thread's rows through
a cp.async ring in shared memory (R - 1 rows always in flight, refilled one row at a time)
instead of v3's dependent batches of 4; same chunks and summation order: bit-identical to
v3/v4. BACKWARD_DEFAULT says which of v4/v5 `version=None` picks.

The sort depends on the tokens only: encoder_backward_plan(tokens, V) makes it ahead (an
EncoderPlan) and encoder_backward(..., plan=) then runs only the gradient kernels (v3/v4). The
model makes the plan during its forward on a side stream, off the step's critical path.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, runtime
from ._common import check_array, check_same_dtype, output

BLOCK = 256            # forward and dwpe: one thread per 16 bytes (v2) / element (v1)
DWTE_CHUNK = 64        # sorted positions per dwte block; CHUNK in encoder.cu
DWTE_MAX_BLOCK = 256   # dwte threads per block (a column slice), a multiple of 32
OVERLAP_SORT = True    # v3/v4: dwpe on a side stream, alongside the key sort and dwte (False: one stream)
V4_TILE = 2048         # positions per tile in v4's counting sort (V4_TILE in encoder_v4.cu)
V4_SCAN_BLOCK = 1024   # tokens per scan block (V4_SCAN_BLOCK in encoder_v4.cu)
V4_MAX_V = 65536       # v4: 16-bit token counters for V tokens in shared memory (2V bytes); scatter's <= 64 scan blocks
BACKWARD_DEFAULT = 4   # version=None backward where v4 applies (4 or 5: bit-identical; 5 once measured faster)
DWTE_V5_RING = 8       # v5: ring slots per thread (R - 1 rows in flight); 8 or 16 (encoder_v5.cu instantiates both)
DWTE_V5_MAX_BLOCK = 128  # v5 chunk threads per block (a column slice); ring smem = R * block * 32 bytes


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


def _pick(version, dtype, C, arrays, backward=False, V=None):
    """(version, W): v2 (forward) / v4 (backward; v3 when V > V4_MAX_V) where 16-byte packs apply,
    else v1. V (backward): rows of dwte; None skips v4's limit."""
    W = 16 // np.dtype(dtype).itemsize
    v2_ok = C % W == 0 and all(a.data.ptr % 16 == 0 for a in arrays)
    versions = (1, 2, 3, 4, 5) if backward else (1, 2)
    v4_ok = V is None or V <= V4_MAX_V
    if version is None:
        version = (BACKWARD_DEFAULT if v4_ok else 3) if backward and v2_ok else (2 if v2_ok else 1)
    if version == 4 and not v4_ok:
        raise ValueError(f"version: v4 needs V <= {V4_MAX_V} (16-bit tile counters), got V={V}")
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

class EncoderPlan:
    """The token sort of the GPU backward (v3/v4: the sorted keys (token << bits) | position), made
    ahead of the backward by encoder_backward_plan. It depends on the tokens only, so a training
    step can make it during the forward (the model does, on a side stream) and the backward runs
    only the gradient kernels. `ready`: an event the backward's stream waits on, or None."""

    def __init__(self, keys, bits, N, V, ready=None):
        self.keys, self.bits, self.N, self.V, self.ready = keys, bits, N, V, ready


def encoder_backward_plan(tokens, V):
    """EncoderPlan for encoder_backward(..., plan=) on CuPy tokens (B, T) int32 in [0, V), made on
    the current stream (v4's counting sort where V <= V4_MAX_V, else the CUB sort: the same keys).
    NumPy tokens: None (the reference needs no plan). The ids are not checked here."""
    check_array("tokens", tokens, dtype=np.int32, ndim=2)
    if not isinstance(V, (int, np.integer)) or V < 1:
        raise ValueError(f"V: expected a positive vocabulary size, got {V!r}")
    if runtime.array_module(tokens) is np:
        return None
    keys, bits = (_sort_keys_v4 if V <= V4_MAX_V else _sort_keys)(tokens, int(V))
    return EncoderPlan(keys, bits, tokens.size, int(V))


def encoder_backward(dout, tokens, dwte=None, dwpe=None, V=None, maxT=None, *, check_tokens=True, version=None,
                     plan=None):
    """Accumulate (+=) the embedding gradients -> (dwte (V, C), dwpe (maxT, C)).

    A None gradient is allocated zeroed: V is then required for dwte, and maxT
    defaults to T for dwpe. Gradients have dout's dtype. plan: an EncoderPlan of these
    tokens from encoder_backward_plan (v3/v4 then skip their sort; other versions ignore it).
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
    version, W = _pick(version, dout.dtype, C, (dout, dwte, dwpe), backward=True, V=V)
    if plan is not None:
        if not isinstance(plan, EncoderPlan):
            raise TypeError(f"plan: expected an EncoderPlan from encoder_backward_plan, got {type(plan).__name__}")
        if (plan.N, plan.V) != (B * T, V):
            raise ValueError(f"plan: made for {plan.N} tokens and V={plan.V}, the call has {B * T} and V={V}")
    if B * T == 0 or C == 0:
        return dwte, dwpe
    if version == 5:
        _backward_v3(dwte, dwpe, dout, tokens, V, W, sort=_sort_keys_v4 if V <= V4_MAX_V else _sort_keys,
                     dwte_launch=_launch_dwte_v5)
        return dwte, dwpe
    if version >= 3:
        sort = _sort_keys_v4 if version == 4 else _sort_keys
        if plan is not None:
            if plan.ready is not None:
                runtime.cupy.cuda.get_current_stream().wait_event(plan.ready)
            sort = lambda tokens, V: (plan.keys, plan.bits)   # noqa: E731 -- the same keys, made ahead
        _backward_v3(dwte, dwpe, dout, tokens, V, W, sort=sort, planned=plan is not None)
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



def _backward_v3(dwte, dwpe, dout, tokens, V, W, sort=None, dwte_launch=None, planned=False):
    """dwpe (v2's kernel) on a side stream, concurrently with the key sort and dwte (v3) on the current one.

    The sort is latency-bound (a few small CUB passes over N keys, or v4's counting sort: sort
    = _sort_keys_v4) and leaves most SMs idle; dwpe, independent of it, fills them, and then
    shares the bandwidth with the dwte kernels. planned (the keys were made ahead, no sort here):
    dwpe starts after the dwte chunk kernel instead, beside the merge -- a chain of dependent
    loads over a hot token's partials (~16 us on an H100) that leaves the memory system idle --
    rather than sharing bandwidth with the chunk kernel and leaving the merge alone at the end.
    """
    cp = runtime.cupy
    sort = sort or _sort_keys
    dwte_launch = dwte_launch or _launch_dwte_v3
    if planned and OVERLAP_SORT and dwte_launch is _launch_dwte_v3:
        main = cp.cuda.get_current_stream()
        side, forked, joined = runtime.side_stream("encoder dwpe")
        keys, bits = sort(tokens, V)

        def dwpe_beside():
            forked.record(main)          # dout, dwpe ready; the chunk kernel queued before it
            side.wait_event(forked)
            with side:
                _launch_dwpe(dwpe, dout, 2, W)
            joined.record(side)

        _launch_dwte_v3(dwte, dout, keys, bits, before_merge=dwpe_beside)
        main.wait_event(joined)
        return
    if not OVERLAP_SORT:
        _launch_dwpe(dwpe, dout, 2, W)
        keys, bits = sort(tokens, V)
        dwte_launch(dwte, dout, keys, bits)
        return
    main = cp.cuda.get_current_stream()
    side, forked, joined = runtime.side_stream("encoder dwpe")
    forked.record(main)                  # dout, tokens, dwpe (and everything before) are ready
    side.wait_event(forked)
    with side:
        _launch_dwpe(dwpe, dout, 2, W)
    joined.record(side)
    keys, bits = sort(tokens, V)
    dwte_launch(dwte, dout, keys, bits)
    main.wait_event(joined)              # whatever the caller queues next sees dwpe done


DWTE_V3_UNROLL = 4     # rows in flight per thread in the v3 chunk kernel (4 or 8; see encoder.cu)
DWTE_MERGE_BLOCK = 64  # v3 merge threads per block (a multiple of 32: the kernel ballots per warp)


def _launch_dwte_v3(dwte, dout, keys, bits, unroll=None, before_merge=None, merge=True):
    """dwte += per-token sums of dout's rows from the sorted keys: chunk kernel, then merge
    (before_merge(), if given, is called between the two launches; merge=False: the bench times
    the chunk kernel alone, leaving dwte incomplete)."""
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
    if before_merge is not None:
        before_merge()
    if not merge:
        return
    C4 = C // 4
    mblock = min(-(-C4 // 32) * 32, DWTE_MERGE_BLOCK)
    k_merge = runtime.get_kernel("encoder", f"encoder_backward_dwte_merge_kernel_v3_{suf}")
    runtime.launch(k_merge, (num_chunks, -(-C4 // mblock)), mblock,
                   (dwte, scratch, keys, i32(N), i32(C), i32(bits), i32(num_chunks)))


# ----------------------------------------------------------- backward, v5 ----

def _v5_block(CP: int):
    """(threads per block, column slices) of the v5 chunk kernel for CP 16-byte packs per row:
    the fewest slices of <= DWTE_V5_MAX_BLOCK packs, split evenly, rounded up to whole warps."""
    slices = -(-CP // DWTE_V5_MAX_BLOCK)
    return -(-(-(-CP // slices)) // 32) * 32, slices


_V5_OPTED_IN: dict[int, int] = {}   # id(kernel) -> dynamic shared memory it was opted in for


def _launch_dwte_v5(dwte, dout, keys, bits, ring=None, merge=True):
    """dwte += per-token sums of dout's rows from the sorted keys: v5 chunk kernel (cp.async ring),
    then v3's merge (same scratch layout and chunks: v3's bits). merge=False (bench only: times the
    chunk kernel alone, dwte is then incomplete)."""
    B, T, C = dout.shape
    N = B * T
    CP = C // (16 // dout.dtype.itemsize)
    ring = ring or DWTE_V5_RING
    suf = f"{dtypes.kernel_suffix(dout.dtype)}_{'u32' if keys.dtype == np.uint32 else 'u64'}"
    num_chunks = -(-N // DWTE_CHUNK)
    block, slices = _v5_block(CP)
    scratch = runtime.cupy.empty((num_chunks, 2, C), dtype=np.float32)
    i32 = np.int32
    k_te = runtime.get_kernel("encoder_v5", f"encoder_backward_dwte_kernel_v5_r{ring}_{suf}")
    smem = ring * block * 32                               # [ring][2][block] uint4: dout + dwte packs
    # Without the opt-in, static + dynamic shared memory must fit in 48 KB; the kernel has ~0.5 KB
    # static (s_row, s_tok), so a 48 KB ring (ring 16 x 96 threads) needs it too. runtime.launch opts
    # in only above 48 KB of dynamic memory: do it here from 40 KB, once per kernel object.
    if smem > 40 * 1024 and _V5_OPTED_IN.get(id(k_te), 0) < smem:
        k_te.max_dynamic_shared_size_bytes = smem
        _V5_OPTED_IN[id(k_te)] = smem
    runtime.launch(k_te, (num_chunks, slices), block, (dwte, scratch, dout, keys, i32(N), i32(C), i32(bits)),
                   shared_mem=smem)
    if not merge:
        return
    C4 = C // 4
    mblock = min(-(-C4 // 32) * 32, DWTE_MERGE_BLOCK)
    k_merge = runtime.get_kernel("encoder", f"encoder_backward_dwte_merge_kernel_v3_{suf}")
    runtime.launch(k_merge, (num_chunks, -(-C4 // mblock)), mblock,
                   (dwte, scratch, keys, i32(N), i32(C), i32(bits), i32(num_chunks)))


def _simulate_dwte_v5_ring(len_: int, ring: int):
    """The v5 chunk kernel's cp.async schedule for one thread, step by step: checks (CPU tests) that
    every row is waited for before it is read, and that no slot is refilled before its row was summed.

    Returns the list of events ("issue", row, slot) / ("read", row, slot) in program order.
    """
    events, groups, landed_upto = [], [], -1
    slot_row = {}                              # slot -> row it holds (not yet summed)

    def issue(li):
        if li < len_:
            s = li % ring
            assert s not in slot_row, f"slot {s} refilled with row {li} before row {slot_row[s]} was summed"
            slot_row[s] = li
            events.append(("issue", li, s))
        groups.append(li)                      # one group per row index, empty past len_

    for li in range(ring - 1):
        issue(li)
    for li in range(len_):
        done = len(groups) - (ring - 2)        # wait_group(R - 2): all but the newest R - 2 groups
        landed_upto = max(landed_upto, groups[done - 1])
        assert landed_upto >= li, f"row {li} read before its group completed"
        s = li % ring
        assert slot_row.get(s) == li, f"slot {s} holds row {slot_row.get(s)}, expected {li}"
        events.append(("read", li, s))
        issue(li + ring - 1)                   # before row li counts as summed: must not hit slot s
        del slot_row[s]                        # summed (the FADDs consumed the shared load)
    return events


# ----------------------------------------------------------- backward, v4 ----

def _sort_keys_v4(tokens, V):
    """(keys, bits): v3's sorted keys (token << bits) | position, by a stable counting sort (encoder_v4.cu).

    Three launches on the current stream, no host synchronisation: tile counts + stable ranks
    (one 1024-thread block per V4_TILE positions, 2V bytes of shared counters), the per-token
    scan over tiles and tokens, the scatter. Integer work only: the same keys whatever the
    scheduling, and the same keys as _sort_keys (unique keys have one sorted order).
    """
    cp = runtime.cupy
    N = tokens.size
    bits, kdt = _key_bits(N, V)
    tiles = -(-N // V4_TILE)
    nb = -(-V // V4_SCAN_BLOCK)
    # One int32 workspace: table (tiles, V) | local (N,) | start_local (V,) | blocktot (nb,)
    work = cp.empty(tiles * V + N + V + nb, dtype=np.int32)
    table = work[:tiles * V]
    local = work[tiles * V:tiles * V + N]
    start_local = work[tiles * V + N:tiles * V + N + V]
    blocktot = work[tiles * V + N + V:]
    keys = cp.empty(N, dtype=kdt)
    i32 = np.int32
    runtime.launch(runtime.get_kernel("encoder_v4", "encoder_v4_tile_rank_kernel"), tiles, 1024,
                   (table, local, tokens, i32(N), i32(V)), shared_mem=2 * V)
    runtime.launch(runtime.get_kernel("encoder_v4", "encoder_v4_scan_kernel"), nb, V4_SCAN_BLOCK,
                   (table, start_local, blocktot, i32(tiles), i32(V)))
    ksuf = "u32" if kdt == np.uint32 else "u64"
    runtime.launch(runtime.get_kernel("encoder_v4", f"encoder_v4_scatter_kernel_{ksuf}"), -(-N // BLOCK), BLOCK,
                   (keys, tokens, table, local, start_local, blocktot, i32(N), i32(V), i32(bits)))
    return keys, bits


def _sort_keys_v4_simulated(tokens, V):
    """The three kernels of _sort_keys_v4, step by step in NumPy (the CPU tests check the bookkeeping).

    Returns (keys int64 (N,), bits).
    """
    tok = np.asarray(tokens).reshape(-1).astype(np.int64)
    N = tok.size
    bits, _ = _key_bits(N, V)
    tiles = -(-N // V4_TILE)
    nb = -(-V // V4_SCAN_BLOCK)
    table = np.zeros((tiles, V), np.int64)
    local = np.zeros(N, np.int64)
    for tile in range(tiles):                            # 1. tile_rank: rounds of 1024, warps in order
        cnt = np.zeros(V, np.int64)
        for r in range(V4_TILE // 1024):
            for w in range(32):
                n0 = tile * V4_TILE + r * 1024 + w * 32
                lanes = [n for n in range(n0, n0 + 32) if n < N]
                seen = {}
                for n in lanes:                          # lrank via match_any, base from the leader
                    t = tok[n]
                    lrank = seen.get(t, 0)
                    seen[t] = lrank + 1
                    local[n] = cnt[t] + lrank
                for t, c in seen.items():                # the leader's bump
                    cnt[t] += c
        table[tile] = cnt
    start_local = np.zeros(V, np.int64)                  # 2. scan
    blocktot = np.zeros(nb, np.int64)
    totals = table.sum(axis=0)
    table = np.cumsum(table, axis=0) - table             # exclusive over tiles
    for b in range(nb):
        seg = totals[b * V4_SCAN_BLOCK:(b + 1) * V4_SCAN_BLOCK]
        start_local[b * V4_SCAN_BLOCK:b * V4_SCAN_BLOCK + seg.size] = np.cumsum(seg) - seg
        blocktot[b] = seg.sum()
    bp = np.cumsum(blocktot) - blocktot                  # 3. scatter
    keys = np.full(N, -1, np.int64)
    for n in range(N):
        t = tok[n]
        slot = bp[t // V4_SCAN_BLOCK] + start_local[t] + table[n // V4_TILE, t] + local[n]
        assert keys[slot] == -1, "two positions scattered to one slot"
        keys[slot] = (t << bits) | n
    return keys, bits
