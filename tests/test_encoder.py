"""gpucore.encoder_forward / encoder_backward: reference vs float64 finite differences, the
chunked dwte scheme (simulated on the CPU), GPU vs reference, determinism, bad input."""
import numpy as np
import pytest

import gpucore
from gpucore import runtime, settings
from gpucore.ops import encoder as enc_ops
from gpucore.ops.encoder import DWTE_CHUNK, encoder_backward_reference, encoder_forward_reference
from conftest import poison, rel_err, to_cpu
from gradcheck import assert_grad_close, numerical_grad

BF16 = gpucore.bfloat16

DTYPES = [np.float32, gpucore.bfloat16]
TOL = {np.dtype(np.float32): 1e-5, np.dtype(gpucore.bfloat16): 1e-2}


def _inputs(rng, B, T, C, V, maxT, dtype, tokens="uniform"):
    if tokens == "uniform":
        tok = rng.integers(0, V, size=(B, T))
    elif tokens == "zipf":                       # a few very frequent ids, a long tail
        tok = (rng.zipf(1.3, size=(B, T)) - 1) % V
    elif tokens == "blocks":                     # sorted runs of exactly one and two chunks
        tok = (np.arange(B * T) // DWTE_CHUNK % V).reshape(B, T)
    else:
        raise ValueError(tokens)
    wte = rng.standard_normal((V, C)).astype(dtype)
    wpe = rng.standard_normal((maxT, C)).astype(dtype)
    return tok.astype(np.int32), wte, wpe


# ------------------------------------------------------------------ CPU ------

def test_forward_reference_and_public_cpu(rng):
    tok, wte, wpe = _inputs(rng, 2, 5, 4, 11, 8, np.float32)
    out = gpucore.encoder_forward(tok, wte, wpe)
    assert out.shape == (2, 5, 4) and out.dtype == np.float32
    for b in range(2):
        for t in range(5):
            np.testing.assert_array_equal(out[b, t], wte[tok[b, t]] + wpe[t])


def test_backward_reference_matches_finite_differences(rng):
    B, T, C, V, maxT = 2, 3, 4, 5, 6
    tok, wte, wpe = _inputs(rng, B, T, C, V, maxT, np.float64)
    tok[0, :] = 2                                # a repeated token
    probe = rng.standard_normal((B, T, C))
    dwte, dwpe = encoder_backward_reference(probe, tok, V, maxT)
    assert_grad_close(dwte, numerical_grad(lambda w: encoder_forward_reference(tok, w, wpe), wte, probe),
                      rtol=1e-7, name="dwte")
    assert_grad_close(dwpe, numerical_grad(lambda p: encoder_forward_reference(tok, wte, p), wpe, probe),
                      rtol=1e-7, name="dwpe")
    assert np.all(dwpe[T:] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_public_cpu_accumulates(rng, dtype):
    B, T, C, V = 3, 4, 8, 6
    tok, wte, wpe = _inputs(rng, B, T, C, V, T, dtype)
    dout = rng.standard_normal((B, T, C)).astype(dtype)
    dwte0 = rng.standard_normal((V, C)).astype(dtype)
    dwte, dwpe = gpucore.encoder_backward(dout, tok, dwte=dwte0.copy())
    assert dwpe.shape == (T, C) and dwte.dtype == dtype
    rte, rpe = encoder_backward_reference(dout, tok, V, T)
    np.testing.assert_allclose(dwte.astype(np.float64), dwte0.astype(np.float64) + rte, rtol=1e-2, atol=2e-2)
    np.testing.assert_allclose(dwpe.astype(np.float64), rpe, rtol=1e-2, atol=2e-2)
    dwte2, dwpe2 = gpucore.encoder_backward(dout, tok, V=V, maxT=T + 3)
    assert dwte2.shape == (V, C) and dwpe2.shape == (T + 3, C) and not dwpe2[T:].astype(np.float32).any()


def _simulate_dwte(tokens, values):
    """The dwte scheme of encoder.cu (stage 1 chunks + merge), line by line, on one column.

    Runs on the CPU so that the bookkeeping of runs that cross chunk boundaries
    is tested here, not only on a GPU.
    """
    N, K = tokens.size, DWTE_CHUNK
    keys = np.sort(tokens.reshape(-1).astype(np.int64) * N + np.arange(N))
    order, stok = keys % N, keys // N
    num_chunks = -(-N // K)
    V = int(tokens.max()) + 1
    dwte = np.zeros(V)
    scratch = np.full((num_chunks, 2), np.nan)           # unwritten slots must never be read

    def tok_at(p):                                       # s_tok with its -1 sentinels
        return stok[p] if 0 <= p < N else -1

    for chunk in range(num_chunks):
        start = chunk * K
        length = min(K, N - start)
        head_cont = tok_at(start - 1) == tok_at(start)
        acc = 0.0
        for li in range(length):
            acc += values[order[start + li]]
            tok = tok_at(start + li)
            last = li + 1 == length
            cont_after = tok_at(start + li + 1) == tok
            if not last and cont_after:
                continue
            cont_before = head_cont and tok == tok_at(start)
            if not cont_before and not cont_after:
                dwte[tok] += acc
            else:
                scratch[chunk, 0 if cont_before else 1] = acc
            acc = 0.0
    for chunk in range(num_chunks):                      # the merge kernel
        start, end = chunk * K, min(chunk * K + K, N)
        if end >= N:
            continue
        tok = stok[end - 1]
        if stok[end] != tok or (start > 0 and stok[start] == tok and stok[start - 1] == tok):
            continue
        acc = scratch[chunk, 1]
        j = chunk + 1
        while True:
            acc += scratch[j, 0]
            jend = min((j + 1) * K, N)
            if not (jend < N and stok[jend] == tok):
                break
            j += 1
        dwte[tok] += acc
    return dwte


@pytest.mark.parametrize("N,V", [(1, 1), (63, 2), (64, 1), (65, 1), (128, 2), (200, 3), (1000, 5),
                                 (1000, 1000), (4096 + 17, 40), (3000, 2)])
@pytest.mark.parametrize("dist", ["uniform", "zipf", "blocks"])
def test_dwte_chunk_scheme_simulated(rng, N, V, dist):
    tok, _, _ = _inputs(rng, 1, N, 1, V, N, np.float64, dist)
    values = rng.standard_normal(N)
    got = _simulate_dwte(tok, values)
    ref = np.zeros(V)
    np.add.at(ref, tok.reshape(-1), values)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, ref[:got.size], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("N,V", [(1000, 5), (4096 + 17, 40), (3000, 2), (20000, 3), (64 * 70, 1)])
def test_v3_merge_chain_end_matches_v2_walk(rng, N, V):
    """v3's merge counts the chunks a run reaches (first position holds the token, a consecutive
    range because the keys are sorted); v2 walks them one by one. Same end on every chain."""
    K = DWTE_CHUNK
    stok = np.sort(rng.integers(0, V, size=N))
    num_chunks = -(-N // K)
    for chunk in range(num_chunks):
        end = min(chunk * K + K, N)
        if end >= N or stok[end] != stok[end - 1]:
            continue
        tok = stok[end - 1]
        j = chunk + 1                                        # v2: walk while the next chunk continues
        while min((j + 1) * K, N) < N and stok[min((j + 1) * K, N)] == tok:
            j += 1
        last = chunk + sum(1 for jj in range(chunk + 1, num_chunks) if stok[jj * K] == tok)   # v3: count
        assert last == j, (chunk, last, j)


@pytest.mark.parametrize("N,V,bits,dtype", [(1, 7, 1, np.uint32), (2, 7, 1, np.uint32), (65536, 50304, 16, np.uint32),
                                            (65536, 65536, 16, np.uint32), (65536, 65537, 16, np.uint64),
                                            (65537, 32768, 17, np.uint32), (66560, 40000, 17, np.uint64)])
def test_sort_key_width(N, V, bits, dtype):
    assert enc_ops.key_bits(N, V) == (bits, dtype)
    if dtype == np.uint32:                                   # the largest key fits in 32 bits
        assert ((V - 1) << bits) | (N - 1) < 2**32


def _counting_sort_simulated(tokens, V):
    """The three kernels of encoder.counting_sort_keys (encoder/counting_sort.cu), step by step in
    NumPy, so that the bookkeeping is tested on the CPU. Returns (keys int64 (N,), bits)."""
    tile_size, scan_block = enc_ops.V4_TILE, enc_ops.V4_SCAN_BLOCK
    tok = np.asarray(tokens).reshape(-1).astype(np.int64)
    N = tok.size
    bits, _ = enc_ops.key_bits(N, V)
    tiles = -(-N // tile_size)
    nb = -(-V // scan_block)
    table = np.zeros((tiles, V), np.int64)
    local = np.zeros(N, np.int64)
    for tile in range(tiles):                            # 1. tile_rank: rounds of 1024, warps in order
        cnt = np.zeros(V, np.int64)
        for r in range(tile_size // 1024):
            for w in range(32):
                n0 = tile * tile_size + r * 1024 + w * 32
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
        seg = totals[b * scan_block:(b + 1) * scan_block]
        start_local[b * scan_block:b * scan_block + seg.size] = np.cumsum(seg) - seg
        blocktot[b] = seg.sum()
    bp = np.cumsum(blocktot) - blocktot                  # 3. scatter
    keys = np.full(N, -1, np.int64)
    for n in range(N):
        t = tok[n]
        slot = bp[t // scan_block] + start_local[t] + table[n // tile_size, t] + local[n]
        assert keys[slot] == -1, "two positions scattered to one slot"
        keys[slot] = (t << bits) | n
    return keys, bits


@pytest.mark.parametrize("N,V", [(1, 1), (31, 2), (1024, 7), (2048, 1), (2049, 2), (4096 + 17, 40),
                                 (5000, 3000), (6000, 2049), (3 * 2048 + 5, 1)])
@pytest.mark.parametrize("dist", ["uniform", "zipf", "blocks"])
def test_v4_counting_sort_simulated(rng, N, V, dist):
    """v4's counting sort (tile ranks with warps in order, scans, scatter), step by step on the CPU:
    exactly the sorted keys (token << bits) | position that v3 sorts with CuPy."""
    tok, _, _ = _inputs(rng, 1, N, 1, V, N, np.float64, dist)
    keys, bits = _counting_sort_simulated(tok, V)
    ref = np.sort((tok.reshape(-1).astype(np.int64) << bits) | np.arange(N))
    np.testing.assert_array_equal(keys, ref)


def test_pick_version():
    pick = enc_ops.pick_version
    assert pick(None, np.float32, 8, (), backward=True, V=50304) == (4, 4)          # the default: v4
    assert pick(None, np.float32, 8, (), backward=True, V=65536) == (4, 4)
    assert pick(None, np.float32, 8, (), backward=True, V=65537) == (3, 4)          # v3 above v4's limit
    assert pick(None, BF16, 16, (), backward=True, V=10) == (4, 8)
    assert pick(None, np.float32, 6, (), backward=True, V=10) == (1, 1)             # the general fallback
    assert pick(2, np.float32, 8, (), backward=True, V=10) == (2, 4)                # the rung kept for comparison
    assert pick(None, np.float32, 8, ()) == (2, 4)
    assert pick(None, BF16, 12, ()) == (1, 1)
    with pytest.raises(ValueError, match="version: v4 needs V <= 65536"):
        pick(4, np.float32, 8, (), backward=True, V=65537)
    with pytest.raises(ValueError, match="version: encoder backward has kernel versions 1, 2, 3, 4, got 5"):
        pick(5, np.float32, 8, (), backward=True, V=10)
    with pytest.raises(ValueError, match="version: encoder forward has kernel versions 1, 2"):
        pick(4, np.float32, 8, ())
    with pytest.raises(ValueError, match="version: v3 needs C a multiple of 4"):
        pick(3, np.float32, 6, (), backward=True, V=10)


def test_bad_input(rng):
    tok, wte, wpe = _inputs(rng, 2, 5, 4, 11, 8, np.float32)
    dout = rng.standard_normal((2, 5, 4)).astype(np.float32)
    with pytest.raises(TypeError, match="tokens: dtype"):
        gpucore.encoder_forward(tok.astype(np.int64), wte, wpe)
    with pytest.raises(ValueError, match="tokens: expected 2 dimensions"):
        gpucore.encoder_forward(tok.reshape(-1), wte, wpe)
    with pytest.raises(ValueError, match="wte: expected 2 dimensions"):
        gpucore.encoder_forward(tok, wte.reshape(-1), wpe)
    with pytest.raises(TypeError, match="wpe: dtype"):
        gpucore.encoder_forward(tok, wte, wpe.astype(gpucore.bfloat16))
    with pytest.raises(ValueError, match="wpe: expected 4 columns"):
        gpucore.encoder_forward(tok, wte, wpe[:, :3].copy())
    with pytest.raises(ValueError, match="tokens: sequence length 5 exceeds"):
        gpucore.encoder_forward(tok, wte, wpe[:4].copy())
    with pytest.raises(ValueError, match="wte: array must be C-contiguous"):
        gpucore.encoder_forward(tok, np.ones((4, 11), np.float32).T, wpe)
    with pytest.raises(ValueError, match="out: expected shape"):
        gpucore.encoder_forward(tok, wte, wpe, out=np.empty((2, 5, 3), np.float32))
    bad = tok.copy()
    bad[1, 2] = 11
    with pytest.raises(ValueError, match=r"tokens: id 11 is out of range \[0, 11\)"):
        gpucore.encoder_forward(bad, wte, wpe)
    bad[1, 2] = -1
    with pytest.raises(ValueError, match="tokens: id -1 is out of range"):
        gpucore.encoder_forward(bad, wte, wpe)
    with pytest.raises(ValueError, match="tokens: id -1 is out of range"):
        gpucore.encoder_backward(dout, bad, V=11)
    with pytest.raises(ValueError, match="V: needed to allocate dwte"):
        gpucore.encoder_backward(dout, tok)
    with pytest.raises(ValueError, match="dout: expected 3 dimensions"):
        gpucore.encoder_backward(dout.reshape(10, 4), tok, V=11)
    with pytest.raises(ValueError, match="tokens: expected shape"):
        gpucore.encoder_backward(dout, tok[:, :4].copy(), V=11)
    with pytest.raises(ValueError, match="dwte: expected 4 columns"):
        gpucore.encoder_backward(dout, tok, dwte=np.zeros((11, 3), np.float32))
    with pytest.raises(ValueError, match="dwte: expected 12 rows"):
        gpucore.encoder_backward(dout, tok, dwte=np.zeros((11, 4), np.float32), V=12)
    with pytest.raises(TypeError, match="dwte: dtype"):
        gpucore.encoder_backward(dout, tok, dwte=np.zeros((11, 4), gpucore.bfloat16))
    with pytest.raises(ValueError, match="dwpe: 4 positions is fewer"):
        gpucore.encoder_backward(dout, tok, V=11, dwpe=np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match="tokens: id 10 is out of range"):
        gpucore.encoder_backward(dout, np.full((2, 5), 10, np.int32), V=10)


# ------------------------------------------------------------------ GPU ------

# (B, T, C, V, maxT): C in {768, 1024, 1600} plus odd C (v1 only); B*T not a multiple of the block.
SHAPES = [(1, 1, 768, 5, 1), (2, 37, 768, 100, 64), (4, 256, 768, 5003, 1024), (3, 100, 1024, 300, 128),
          (2, 77, 1600, 1000, 77), (5, 13, 37, 7, 20), (1, 300, 8, 3, 300)]


def _versions(C, dtype, backward=False):
    if C % (16 // np.dtype(dtype).itemsize):
        return [1]
    return [1, 2, 3, 4] if backward else [1, 2]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,C,V,maxT", SHAPES)
def test_gpu_forward(rng, dtype, B, T, C, V, maxT):
    cp = runtime.cupy
    tok, wte, wpe = _inputs(rng, B, T, C, V, maxT, dtype)
    ref = gpucore.encoder_forward(tok, wte, wpe)          # NumPy: one rounding of wte + wpe, exact
    for version in _versions(C, dtype):
        out = poison((B, T, C), dtype)
        gpucore.encoder_forward(cp.asarray(tok), cp.asarray(wte), cp.asarray(wpe), out=out, version=version)
        np.testing.assert_array_equal(to_cpu(out).astype(np.float64), ref.astype(np.float64))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,C,V,maxT", SHAPES)
@pytest.mark.parametrize("dist", ["uniform", "zipf", "blocks"])
def test_gpu_backward(rng, dtype, B, T, C, V, maxT, dist):
    cp = runtime.cupy
    tok, _, _ = _inputs(rng, B, T, C, V, maxT, dtype, dist)
    dout = rng.standard_normal((B, T, C)).astype(dtype)
    dwte0 = rng.standard_normal((V, C)).astype(dtype)
    dwpe0 = rng.standard_normal((maxT, C)).astype(dtype)
    rte, rpe = encoder_backward_reference(dout, tok, V, maxT)
    tol = TOL[np.dtype(dtype)]
    by_version = {}
    for version in _versions(C, dtype, backward=True):
        results = []
        for _ in range(2):                                   # twice: bitwise identical
            dwte, dwpe = cp.asarray(dwte0), cp.asarray(dwpe0)
            gpucore.encoder_backward(cp.asarray(dout), cp.asarray(tok), dwte=dwte, dwpe=dwpe, version=version)
            results.append((to_cpu(dwte), to_cpu(dwpe)))
        for name, got, ref, g0 in (("dwte", results[0][0], rte, dwte0), ("dwpe", results[0][1], rpe, dwpe0)):
            got = got.astype(np.float64)
            assert not np.isnan(got).any(), f"v{version} {name} has NaN"
            want = g0.astype(np.float64) + ref
            assert rel_err(got, want) < tol, f"v{version} {name}: rel err {rel_err(got, want):.2e}"
            # rows no token touched are unchanged, bit for bit
            untouched = ~np.any(ref != 0, axis=1)
            np.testing.assert_array_equal(got[untouched], g0.astype(np.float64)[untouched])
            # the gradient part alone (bf16: compare where the sum dominates the start value)
            assert rel_err(got - g0.astype(np.float64), ref) < (1e-5 if dtype == np.float32 else 5e-2)
        assert results[0][0].tobytes() == results[1][0].tobytes(), f"v{version} dwte not deterministic"
        assert results[0][1].tobytes() == results[1][1].tobytes(), f"v{version} dwpe not deterministic"
        by_version[version] = results[0]
    if 3 in by_version:   # v3 keeps v2's chunks and summation order: the same bits
        assert by_version[3][0].tobytes() == by_version[2][0].tobytes(), "v3 dwte differs from v2's bits"
        assert by_version[3][1].tobytes() == by_version[2][1].tobytes(), "v3 dwpe differs from v2's bits"
    if 4 in by_version:   # v4 = v3 on keys from the counting sort (the same keys): the same bits
        assert by_version[4][0].tobytes() == by_version[3][0].tobytes(), "v4 dwte differs from v3's bits"
        assert by_version[4][1].tobytes() == by_version[3][1].tobytes(), "v4 dwpe differs from v3's bits"
    if 4 in by_version:   # a plan made ahead (as the model does in its forward) gives v4's bits
        dwte, dwpe = cp.asarray(dwte0), cp.asarray(dwpe0)
        plan = gpucore.encoder_backward_plan(cp.asarray(tok), V)
        gpucore.encoder_backward(cp.asarray(dout), cp.asarray(tok), dwte=dwte, dwpe=dwpe, plan=plan)
        assert to_cpu(dwte).tobytes() == by_version[4][0].tobytes(), "dwte with a plan differs from v4's bits"
        assert to_cpu(dwpe).tobytes() == by_version[4][1].tobytes(), "dwpe with a plan differs from v4's bits"


@pytest.mark.cuda
def test_gpu_backward_plan_on_a_side_stream_and_mismatch(rng):
    """A plan made on another stream (its `ready` event awaited) gives the bits of the plain call;
    a plan of other tokens' count or vocabulary is refused before any launch."""
    cp = runtime.cupy
    B, T, C, V = 4, 256, 768, 5003
    tok, _, _ = _inputs(rng, B, T, C, V, T, BF16, "zipf")
    dout = cp.asarray(rng.standard_normal((B, T, C)).astype(BF16))
    tok_d = cp.asarray(tok)
    want = gpucore.encoder_backward(dout, tok_d, V=V)
    side = cp.cuda.Stream(non_blocking=True)
    with side:
        plan = gpucore.encoder_backward_plan(tok_d, V)
        plan.ready = cp.cuda.Event()
        plan.ready.record(side)
    got = gpucore.encoder_backward(dout, tok_d, V=V, plan=plan)
    for g, w in zip(got, want):
        assert to_cpu(g).tobytes() == to_cpu(w).tobytes()
    with pytest.raises(ValueError, match="plan: made for"):
        gpucore.encoder_backward(dout, tok_d, V=V + 1, plan=plan)
    with pytest.raises(ValueError, match="plan: made for"):
        gpucore.encoder_backward(dout[:2], tok_d[:2], V=V, plan=plan)
    with pytest.raises(TypeError, match="plan: expected an EncoderPlan"):
        gpucore.encoder_backward(dout, tok_d, V=V, plan=(plan.keys, plan.bits))


def test_backward_plan_on_numpy_and_bad_v(rng):
    tok = rng.integers(0, 7, size=(2, 5)).astype(np.int32)
    assert gpucore.encoder_backward_plan(tok, 7) is None
    with pytest.raises(ValueError, match="V: expected"):
        gpucore.encoder_backward_plan(tok, 0)
    with pytest.raises(TypeError):
        gpucore.encoder_backward_plan(tok.astype(np.int64), 7)


@pytest.mark.cuda
def test_gpu_backward_fresh_buffers_and_bad_tokens(rng):
    cp = runtime.cupy
    B, T, C, V = 8, 64, 768, 50
    tok, _, _ = _inputs(rng, B, T, C, V, T, np.float32, "zipf")
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    dwte, dwpe = gpucore.encoder_backward(cp.asarray(dout), cp.asarray(tok), V=V)
    rte, rpe = encoder_backward_reference(dout, tok, V, T)
    assert dwte.shape == (V, C) and dwpe.shape == (T, C)
    assert rel_err(to_cpu(dwte), rte) < 1e-5 and rel_err(to_cpu(dwpe), rpe) < 1e-5
    bad = tok.copy()
    bad[3, 7] = V
    with pytest.raises(ValueError, match="tokens: id 50 is out of range"):
        gpucore.encoder_backward(cp.asarray(dout), cp.asarray(bad), V=V)
    with pytest.raises(ValueError, match="tokens: id 50 is out of range"):
        gpucore.encoder_forward(cp.asarray(bad), cp.zeros((V, C), np.float32), cp.zeros((T, C), np.float32))


@pytest.mark.cuda
@pytest.mark.parametrize("beside", [True, False])
@pytest.mark.parametrize("B,T,C,V,dist", [(65, 1024, 64, 40000, "zipf"),      # 64-bit keys (N * V > 2**32)
                                          (16, 1024, 768, 50304, "zipf"),     # the model's shape, 32-bit keys
                                          (3, 1000, 128, 2, "uniform")])      # two tokens: two long chains
def test_gpu_backward_v3_keys_streams_and_long_runs(rng, beside, B, T, C, V, dist):
    """v3/v4 with 64-bit and 32-bit sort keys, with and without dwpe on the side stream
    (settings.encoder_dwpe_beside), with and without a plan, on runs that span hundreds of
    chunks: bit-identical to v2, and to the float64 reference within bf16 rounding."""
    cp = runtime.cupy
    dtype = gpucore.bfloat16
    tok, _, _ = _inputs(rng, B, T, C, V, T, dtype, dist)
    dout = rng.standard_normal((B, T, C)).astype(dtype)
    dwte0 = rng.standard_normal((V, C)).astype(dtype)
    tg, dg = cp.asarray(tok), cp.asarray(dout)
    got = {}
    with settings.using(encoder_dwpe_beside=beside):
        for version in (2, 3, 4, "plan"):
            dwte, dwpe = cp.asarray(dwte0), cp.zeros((T, C), dtype=dtype)
            if version == "plan":
                plan = gpucore.encoder_backward_plan(tg, V)
                gpucore.encoder_backward(dg, tg, dwte=dwte, dwpe=dwpe, plan=plan)
            else:
                gpucore.encoder_backward(dg, tg, dwte=dwte, dwpe=dwpe, version=version)
            got[version] = (to_cpu(dwte), to_cpu(dwpe))
    rte, rpe = encoder_backward_reference(dout, tok, V, T)
    assert not np.isnan(got[3][0].astype(np.float32)).any()
    assert rel_err(got[3][0].astype(np.float64) - dwte0.astype(np.float64), rte) < 5e-2
    assert rel_err(got[3][1], rpe) < 1e-2
    for version in (3, 4, "plan"):
        assert got[version][0].tobytes() == got[2][0].tobytes(), f"{version} dwte differs from v2's bits"
        assert got[version][1].tobytes() == got[2][1].tobytes(), f"{version} dwpe differs from v2's bits"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dist", ["uniform", "zipf", "blocks"])
def test_gpu_public_steps_compose_to_the_backward(rng, dtype, dist):
    """The backward's steps as `gpucore bench encoder` runs them one by one (launch_dwpe,
    sort_tokens + launch_dwte_from_order; sort_keys / counting_sort_keys + launch_dwte, whose
    before_merge hook runs once between its launches) give the bits of encoder_backward."""
    cp = runtime.cupy
    B, T, C, V = 4, 300, 768, 700
    tok, _, _ = _inputs(rng, B, T, C, V, T, dtype, dist)
    tg = cp.asarray(tok)
    dout = cp.asarray(rng.standard_normal((B, T, C)).astype(dtype))
    dwte0 = rng.standard_normal((V, C)).astype(dtype)
    dwpe0 = rng.standard_normal((T, C)).astype(dtype)
    want = {}
    for version in (1, 2, 3):
        dwte, dwpe = cp.asarray(dwte0), cp.asarray(dwpe0)
        gpucore.encoder_backward(dout, tg, dwte=dwte, dwpe=dwpe, version=version)
        want[version] = (to_cpu(dwte), to_cpu(dwpe))
    for version in (1, 2):
        dwte, dwpe = cp.asarray(dwte0), cp.asarray(dwpe0)
        enc_ops.launch_dwpe(dwpe, dout, version)
        order, sorted_tokens = enc_ops.sort_tokens(tg)
        enc_ops.launch_dwte_from_order(dwte, dout, order, sorted_tokens, version)
        assert to_cpu(dwte).tobytes() == want[version][0].tobytes(), f"v{version} steps: dwte"
        assert to_cpu(dwpe).tobytes() == want[version][1].tobytes(), f"v{version} steps: dwpe"
    for sort in (enc_ops.sort_keys, enc_ops.counting_sort_keys):
        dwte, dwpe = cp.asarray(dwte0), cp.asarray(dwpe0)
        keys, bits = sort(tg, V)
        calls = []
        enc_ops.launch_dwte(dwte, dout, keys, bits, before_merge=lambda: calls.append(1))
        enc_ops.launch_dwpe(dwpe, dout)
        assert calls == [1]
        assert to_cpu(dwte).tobytes() == want[3][0].tobytes(), f"{sort.__name__} + launch_dwte: dwte"
        assert to_cpu(dwpe).tobytes() == want[3][1].tobytes(), f"{sort.__name__} + launch_dwpe: dwpe"
    rte, _ = encoder_backward_reference(to_cpu(dout), tok, V, T)
    got = want[3][0].astype(np.float64) - dwte0.astype(np.float64)
    assert rel_err(got, rte) < (1e-5 if dtype == np.float32 else 5e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,C,V,dist", [(1, 1, 8, 1, "uniform"), (1, 63, 8, 2, "zipf"), (2, 65, 1600, 40, "zipf"),
                                          (3, 1000, 2048, 2, "uniform"), (7, 300, 1024, 5000, "uniform"),
                                          (4, 512, 768, 50, "blocks"), (65, 1024, 64, 40000, "zipf")])
def test_gpu_dwte_keys_match_v2_on_launch_edge_shapes(rng, dtype, B, T, C, V, dist):
    """v3/v4's dwte (launch_dwte on the sorted keys) on shapes that stress its launch: fewer than
    one chunk of positions (N < 64) and a short last chunk, 1-2 column slices (C = 1600, 2048 in
    fp32/bf16), hundreds of chunks of one token, 64-bit keys: v2's bits, NaN-free, deterministic,
    and near the reference."""
    cp = runtime.cupy
    tok, _, _ = _inputs(rng, B, T, C, V, T, dtype, dist)
    tg = cp.asarray(tok)
    dout = cp.asarray(rng.standard_normal((B, T, C)).astype(dtype))
    dwte0 = rng.standard_normal((V, C)).astype(dtype)
    want = cp.asarray(dwte0)
    order, sorted_tokens = enc_ops.sort_tokens(tg)
    enc_ops.launch_dwte_from_order(want, dout, order, sorted_tokens, 2)
    want = to_cpu(want)
    keys, bits = enc_ops.sort_keys(tg, V)
    for _ in range(2):                                       # twice: deterministic
        dwte = cp.asarray(dwte0)
        enc_ops.launch_dwte(dwte, dout, keys, bits)
        got = to_cpu(dwte)
        assert not np.isnan(got.astype(np.float32)).any(), "NaN in dwte"
        bad = np.flatnonzero(np.any(got != want, axis=1))
        assert bad.size == 0, f"{bad.size} dwte rows differ from v2, first {bad[:5]}"
    rte, _ = encoder_backward_reference(to_cpu(dout), tok, V, T)
    assert rel_err(want.astype(np.float64) - dwte0.astype(np.float64), rte) < (1e-5 if dtype == np.float32 else 5e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("B,T,V,dist", [(1, 1, 1, "uniform"), (2, 1000, 3, "zipf"), (5, 409, 2049, "uniform"),
                                        (64, 1024, 50304, "zipf"), (16, 1024, 65536, "uniform"),
                                        (65, 1024, 40000, "zipf"), (3, 2048, 1, "blocks")])
def test_gpu_v4_sort_keys_match_cupy_sort(rng, B, T, V, dist):
    """v4's counting sort writes exactly the keys v3 gets from CuPy's sort (u32 and u64 keys, tile tails,
    one token everywhere, V not a multiple of the scan block, V = 65536), twice with the same bits."""
    cp = runtime.cupy
    tok, _, _ = _inputs(rng, B, T, 1, V, T, np.float32, dist)
    tg = cp.asarray(tok)
    ref, bits = enc_ops.sort_keys(tg, V)
    for _ in range(2):
        keys, bits4 = enc_ops.counting_sort_keys(tg, V)
        assert bits4 == bits and keys.dtype == ref.dtype
        got, want = to_cpu(keys), to_cpu(ref)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{bad.size} keys differ, first at sorted index {bad[:5]}: {got[bad[:5]]} vs {want[bad[:5]]}"
