/*
 * attention/flash_v3_bwd1.cu -- causal attention backward in ONE pass on Hopper's wgmma (v3, sm_90a).
 *
 * Op and math: attention/flash_v3_bwd.cu's (same inputs: qkv (B, T, 3C) bf16, dout (B, T, C) bf16,
 * lse and D = rowsum(dout * out) (B, NH, T) f32 from v2's preprocess kernel; same output: dqkv
 * (B, T, 3C) bf16 written [=], every element of every row t < T once). HD = 64.
 *
 * Why: the two-pass backward computes S and dP twice (7 tile products per tile pair, where
 * FlashAttention's one pass does 5) to stay deterministic without atomics. Here one block owns a
 * whole head, so dQ can be summed in a fixed order without atomics or semaphores:
 *   block = one (batch, head), NWG = 2 warpgroups, one block per SM; for each KV tile j of 128
 *   keys (in order; warpgroup w owns keys 64w..64w+63) and each Q tile i of 64 queries at or after
 *   the tile's first key (ascending for even j, descending for odd j: each pass starts on the Q/dO
 *   tiles and dQ^T sums the one before touched last, still in the L2 -- see q_of):
 *     S^T  = K Q^T, dP^T = V dO^T            (smem x smem, K-major)
 *     P^T  = exp2(S^T * scale*log2e - lse*log2e), 0 where key > query or query >= T
 *     dV  += P^T dO, dS^T = P^T (dP^T - D), dK += dS^T Q   (as the dK/dV pass)
 *     dQ^T_i (+)= K^T dS^T over all 128 keys, warpgroup w for queries 32w..32w+31 (dS^T staged in
 *                 smem; both operands MN-major; m64n32, B starting 64 bytes into swizzled rows)
 *   dQ^T of Q tile i is summed over the KV tiles in order in an f32 scratch per head in global
 *   memory (a 16 KB tile per Q tile): each thread puts its part into a shared staging tile and one
 *   bulk copy (async proxy) stores it to the scratch (first KV tile) or adds it to the scratch's
 *   sum in the L2 (cp.reduce.async.bulk .add.f32) while the block goes on; every bulk operation of
 *   a KV tile completes before the next KV tile issues its own, so the additions land in KV-tile
 *   order. At Q tile i's last (diagonal) KV tile its sums so far are copied into shared memory a
 *   tile ahead (cp.async) and the sum plus this part goes to dqkv as bf16 (times scale) instead,
 *   each 8 x 8 block turned by movmatrix so that every lane stores 8 contiguous bytes of a dQ row.
 *   Only ordered bulk adds, no atomics; same bits run after run. dK, dV of KV tile j are stored
 *   when its Q loop ends.
 * Pipelining (per warpgroup): per tile, after the loop-top barrier: wait<0> (S^T, issued by the
 * previous tile, and the previous tile's dV, dK, dQ^T groups) -> dP^T group, running on -> P^T -> dV group ->
 * wait<1> (dP^T) -> dS^T -> dK group -> the previous tile's dQ^T into the staging tile (or, at its
 * diagonal, added to the sums there and stored to dqkv) while dV and dK run; dS^T to smem (its last
 * reader, the previous dQ^T, retired at the wait<0>) -> fence.proxy.async + barrier -> the previous
 * tile's bulk store or add, the dQ^T group, then the next tile's S^T group (its Q tile waited for
 * before that barrier); dV, dK, dQ^T and S^T run on into the next tile (ptxas' C7517 notes: the
 * waits it adds where S^T's registers cross the KV loop's ends, where all is retired anyway). Q/dO/lse/D
 * stream through a 4-stage cp.async ring (the stage a running group reads is never the one
 * prefetched), prefetched two tiles ahead, across KV tiles too; K and V of the next KV tile are
 * copied into the second K/V buffer at its predecessor's first Q tile. At a KV tile's end dK and dV
 * go out through the free dS^T tile (stmatrix, then 16-byte stores of whole rows).
 * L2 policies: the dQ^T scratch is written evict_last and each tile dropped (discard) once its
 * diagonal has copied it in; K and V (read once) and Q/dO (re-read each pass, in serpentine order:
 * see q_of and load_q_tile) are copied evict_first. The scratch's adds had
 * cost ~0.19 ms of 1.08 at d12, half of it in sums evicted between two adds (x1.04, bitwise equal).
 * Measured: tools/notes/attention.md (H200, d12 B=64: 1.03 vs the two-pass 1.25 ms); a block is a
 * whole head, so gpucore/ops/attention.py takes this kernel only where B*NH fills the SMs' waves.
 * (The 1-warpgroup instantiation, 2 blocks per SM, lost and spills at 255 registers: not built.)
 *
 * Shared memory: 2 x K, V (128 x HD), 4 stages of Q, dO (64 x HD), two dS^T tiles (128 keys x 64
 * queries), all 128B-swizzled (wgmma.cuh); 3 staged dQ^T partial-sum tiles (16 KB each); 4 x 64
 * lse and D: 216,064 bytes with the alignment slack (gpucore/ops/attention.py: v3_onepass_smem).
 * Compiled for anything but sm_90a the kernel traps; Python launches it only on sm_90 devices.
 */
#include "attention/flash.cuh"
#include "wgmma.cuh"
#include "attention/flash_v3.cuh"
#include "attention/flash_v3_bwd.cuh"   // v3_store_acc, v3_product_kk / rs
#include "fp8_cast.cuh"                 // block_amax: the _sums variant's amax of dqkv

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Q tile i's dQ^T, one KV tile's part at a time. v3_dq_store puts the part from the accumulator into
// a staging tile, and one bulk operation per tile stores it to the scratch or adds it there
// (v3_dq_flush). Measured on an H200: per-thread loads where the sums are needed cost 1.6 ms of a
// 2.4 ms kernel; per-thread stores and one 256-byte bulk copy per row were slower than one 16 KB
// bulk copy per tile; copying the sums into shared memory a tile ahead (cp.async), adding there
// and bulk-storing them back cost ~0.35 ms of 1.15 (tools/notes/attention.md), so only the last
// (diagonal) KV tile's sums are copied in now (v3_dq_prefetch). The part's reads come after a
// wait<0>: ptxas serialises every wgmma of a kernel whose accumulator is read where it cannot
// prove the group retired, and a wait<1> across the loop's back edge is such a place.
// The f32 scratch holds, per head, one 16 KB tile per Q tile (HD rows x 64 queries of dQ^T), laid
// out as the staging tile in shared memory so that one bulk copy moves it: element (hd, q) of a
// tile at v3_dq_off(hd, q) (q even; q + 1 follows), the float2 pairs of a row permuted by hd & 7 so
// the staging tile's accesses hit 2 banks each at most.
__device__ __forceinline__ int v3_dq_off(int hd, int q) { return hd * 64 + ((((q >> 1) ^ ((hd & 7) << 2))) << 1); }

// Q tile i's partial sums (the scratch tile at qtile) -> the staging tile at shared address s_old.
template <int NT>
__device__ __forceinline__ void v3_dq_prefetch(u32 s_old, const float* qtile) {
    #pragma unroll
    for (int k = 0; k < 1024 / NT; k++) {         // 16 KB = 1024 chunks of 16 bytes
        const int c = threadIdx.x + NT * k;
        cp_async16(s_old + 16 * c, qtile + 4 * c, 16);
    }
}

// This thread's part dq of Q tile i's dQ^T (NJ n8 blocks: head-dim rows 16 w4 + g (+8), query
// columns c0 + 8 jj + 2 t4 (+1) of the tile). Before Q tile i's last (diagonal) KV tile it goes into
// the staging tile s_old, from where one bulk copy stores it to the scratch (first KV tile) or adds
// it to the scratch's sum (cp.reduce.async.bulk); at the last KV tile the sums so far (copied into
// s_old by v3_dq_prefetch; none when it is also the first) plus dq, times `scale`, go to dq_g (rows
// t < T of Q tile i, bf16).
// qsum (SUMS): this warpgroup's 64 running sums of the dQ values written (bf16, as stored), one per
// head-dim row: at the last KV tile each thread sums its rows' values over its query columns, the
// quad (t4) combines them by two fixed shuffles and lane t4 = 0 adds them in (one owner per row).
// amx (SUMS): this thread's running max |dqkv| (the bf16 bits as written, as fp32 bits) in its own
// shared word: the values it stores here (rows t < T) are folded in.
template <int NJ, bool SUMS = false>
__device__ __forceinline__ void v3_dq_store(bf16* dq_g, float* s_old, const float* dq, int i,
                                            int c0, bool first, bool last, float scale, int T, int stride,
                                            int w4, int lane, float* qsum = nullptr, u32* amx = nullptr) {
    const int g = lane >> 2, t4 = lane & 3;
    if (!last) {
        #pragma unroll
        for (int jj = 0; jj < NJ; jj++)
            #pragma unroll
            for (int r = 0; r < 2; r++)
                *reinterpret_cast<float2*>(s_old + v3_dq_off(16 * w4 + g + 8 * r, c0 + 8 * jj + 2 * t4)) =
                    make_float2(dq[4 * jj + 2 * r], dq[4 * jj + 2 * r + 1]);
        return;
    }
    // The diagonal: old sums + part, times scale, to bf16 (pk[2 jj + r]: an 8 x 8 block, head-dim rows
    // 16 w4 + 8 r + g, query columns c0 + 8 jj + 2 t4 (+1)). movmatrix turns each block so that the lane
    // holds query row c0 + 8 jj + g's head dims 16 w4 + 8 r + 2 t4 (+1), and one swap inside each pair
    // of lanes gives every lane 4 contiguous head dims: one 8-byte store per query row, a whole 32-byte
    // sector per row and warp, instead of 16 scattered 2-byte stores a thread (twentieth session: the
    // diagonal's finish was ~0.12 ms of the d12 kernel; this made the kernel x1.034). 16-byte stores
    // (a second swap between lanes t4 and t4 ^ 2) measured the same (1.012 vs 1.013 ms): not kept.
    float rs[2] = {0.f, 0.f};                     // SUMS: rows 16 w4 + g (+8)
    u32 m = 0;                                    // SUMS: max |value| as fp32 bits
    static_assert(NJ == 4, "the diagonal's finish holds one Q tile's 4 n8 blocks a thread");
    u32 pk[8];
    {
        float2 old[8];
        #pragma unroll
        for (int k = 0; k < 8; k++) {
            const int jj = k >> 1, r = k & 1;
            old[k] = first ? make_float2(0.f, 0.f)
                           : *reinterpret_cast<const float2*>(
                                 s_old + v3_dq_off(16 * w4 + g + 8 * r, c0 + 8 * jj + 2 * t4));
        }
        #pragma unroll
        for (int k = 0; k < 8; k++) {
            const int jj = k >> 1, r = k & 1, e = 4 * jj + 2 * r;
            pk[k] = pack_bf16x2_rn((old[k].x + dq[e]) * scale, (old[k].y + dq[e + 1]) * scale);
            if constexpr (SUMS) {
                const int q = 64 * i + c0 + 8 * jj + 2 * t4;
                if (q < T) {
                    rs[r] += __uint_as_float(pk[k] << 16);
                    m = max(m, (pk[k] << 16) & 0x7fffffffu);
                }
                if (q + 1 < T) {
                    rs[r] += __uint_as_float(pk[k] & 0xffff0000u);
                    m = max(m, pk[k] & 0x7fff0000u);
                }
            }
        }
    }
    const int hd0 = 16 * w4 + 2 * t4 + 6 * (t4 & 1);   // t4 = 0..3: head dims 0, 8, 4, 12 (+3) of the warp's 16
    #pragma unroll
    for (int jj = 0; jj < NJ; jj++) {
        const u32 a0 = movmatrix_trans(pk[2 * jj]), a1 = movmatrix_trans(pk[2 * jj + 1]);
        // t4 = 0, 2 store r = 0's dims 2 t4 .. 2 t4 + 3 (their own pair, then their odd neighbour's);
        // t4 = 1, 3 store r = 1's dims 2 t4 + 6 .. 2 t4 + 9 (their even neighbour's pair, then their own)
        const u32 got = __shfl_xor_sync(0xffffffffu, (t4 & 1) ? a0 : a1, 1);
        const int q = 64 * i + c0 + 8 * jj + g;
        if (q < T)
            *reinterpret_cast<uint2*>(dq_g + (size_t)q * stride + hd0) =
                (t4 & 1) ? make_uint2(got, a1) : make_uint2(a0, got);
    }
    if constexpr (SUMS) {
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            float v = rs[r] + __shfl_xor_sync(0xffffffffu, rs[r], 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            if (t4 == 0) qsum[16 * w4 + g + 8 * r] += v;
        }
        *amx = max(*amx, m);
    }
}

// SUMS: a warp's 16 staged rows (bf16, as v3_store_acc_staged left them, swizzled) summed into its
// running column sums (lane c: columns 2c, 2c + 1; rows in order), and their max |value| into the
// thread's amx word (as v3_dq_store's). Rows past T hold zeros.
__device__ __forceinline__ void v3_warp_colsum(float2* csum, u32* amx, const unsigned char* rows, int lane) {
    float2 cs = *csum;
    u32 m = 0;
    #pragma unroll
    for (int r = 0; r < 16; r++) {
        const u32 v = *reinterpret_cast<const u32*>(rows + wg_swz128(r, lane >> 2) + 4 * (lane & 3));
        cs.x += __uint_as_float(v << 16);
        cs.y += __uint_as_float(v & 0xffff0000u);
        m = max(m, max((v << 16) & 0x7fffffffu, v & 0x7fff0000u));
    }
    *csum = cs;
    *amx = max(*amx, m);
    __syncwarp();                                 // the next staged store may overwrite the rows
}

// The staged part of Q tile pi (at shared address s) to its scratch tile: stored at the first KV tile,
// added to the sum from the second on. One thread issues it; thread 0 issues every bulk operation of
// the block, and waits for them all to complete at the end of each KV tile, so the additions into a
// scratch tile land in KV-tile order: the same sum, bit for bit, every run.
// The scratch's lines go to the L2 as evict_last: ~34 MB of live sums at d12 (132 heads x 256 KB)
// share the 50 MB L2 with K/V (read once) and Q/dO (re-read per KV tile), both evict_first, and dqkv;
// a sum evicted between two adds costs a DRAM read and write (twentieth session: the adds' cost
// halved, the kernel x1.04; tools/notes/attention.md). v3_dq_discard drops each tile once its
// diagonal has copied it in, so no dead evict_last line outlives its use.
__device__ __forceinline__ void v3_dq_flush(float* qtile, u32 s, int j, u32 bytes) {
    const u64 keep = l2_evict_last();
    if (j == 0) bulk_store_s2g(qtile, s, bytes, keep);
    else bulk_reduce_add_s2g(qtile, s, bytes, keep);
    bulk_commit();
}

// Q tile's scratch tile (16 KB = 128 lines of 128 bytes), dead once its diagonal copied it into
// shared memory: one line per thread of threads 0..127, dropped from the L2 unwritten.
__device__ __forceinline__ void v3_dq_discard(const float* qtile) {
    if (threadIdx.x < 128) discard_l2_line(qtile + 32 * threadIdx.x);
}

// NWG = 2 warpgroups: 128 keys per KV tile, warpgroup w owning keys 64w.. for S^T .. dK, 1 block
// per SM. Warpgroup w computes dQ^T for query columns 32w..32w+31 over all 128 keys (m64n32, B
// starting 64 bytes into dS^T's swizzled rows) and stages or finishes that half.
// SUMS: also the head's column sums of dQ, dK and dV as written (bf16) into part (B, 3C), row b,
// columns h HD.. of each third: the qkv bias gradient's stage 1 without a pass over dqkv. Running
// sums in shared memory after D (per warp for dK, dV; per warpgroup and head-dim row for dQ),
// combined in a fixed order at the end: deterministic. And when amax is not null, the max |dqkv|
// of the values written (bf16) folded into *amax by atomicMax on the bits (fp8_amax's rule: the
// same in any order), so that dqkv's FP8 cast knows its scale before it runs (adaptive scaling's
// re-cast of dqkv, its most frequent, goes away: tools/notes/fp8.md, fifty-fifth session).
template <int HD, int NWG, bool SUMS = false>
__device__ __forceinline__ void flash_bwd_onepass_v3(bf16* dqkv, float* dqacc, const bf16* qkv, const bf16* dout,
                                                     const float* lse, const float* Dv, int T, int NH, float scale,
                                                     float* part = nullptr, float* amax = nullptr) {
    static_assert(HD == 64, "one-pass backward: head dim 64");
    static_assert(NWG == 2, "one-pass backward: 2 warpgroups (1 lost and spills: tools/notes/attention.md)");
    // ST ring stages: Q tiles copied two tiles ahead; the stage a running group reads (the previous
    // tile's) is never the one being filled
    constexpr int BM = 64, BN = 64 * NWG, NT = 128 * NWG, ST = 4;
    constexpr int KV_BYTES = BN * HD * 2, Q_BYTES = BM * HD * 2, DS_BYTES = BN * BM * 2;
    constexpr int A_BYTES = HD * 64 * 4;
    // staging tiles, by tile counter: tile tc's part is staged at tc+1 (at its diagonal, onto the
    // sums copied in at tc) and bulk-stored or -added from there; the buffer comes round again at
    // tc+3, after the loop top's wait for the bulk operation's read (the bulk operation had a tile)
    constexpr int SA = 3;
    constexpr int QN = 64 / NWG;                  // query columns of this warpgroup's dQ^T
    extern __shared__ unsigned char smem_v3[];
    const u32 raw = smem_u32_asm(smem_v3);
    const u32 sK = (raw + 1023u) & ~1023u;        // swizzle atoms need 1024-byte alignment
    // two K/V buffers (KV tile j in buffer j & 1): buffer b's K at sK + b * 2 KV_BYTES, V after it
    const u32 sQ = sK + 4 * KV_BYTES;             // ST stages
    const u32 sO = sQ + ST * Q_BYTES;             // ST stages (dout)
    // two dS^T tiles (BN keys x BM queries), tile tc's in tc & 1: the other warpgroup's dQ^T of tile
    // tc - 1 may still read its buffer while this one writes tile tc's half -- that dQ^T is retired by
    // its own warpgroup's wait<0> only, and the next S^T is issued before the loop-top barrier --
    // while tile tc - 2's readers all retired before tile tc - 1's middle barrier
    const u32 sS = sO + ST * Q_BYTES;
    unsigned char* sS_gen = smem_v3 + (sS - raw);
    const u32 sA = sS + 2 * DS_BYTES;             // SA staged dQ^T partial-sum tiles
    float* sA_gen = reinterpret_cast<float*>(smem_v3 + (sA - raw));
    float* sL = reinterpret_cast<float*>(smem_v3 + (sA + SA * A_BYTES - raw));  // ST x BM lse
    float* sD = sL + ST * BM;                                                            // ST x BM D

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wg = warp >> 2, w4 = warp & 3, g = lane >> 2, t4 = lane & 3;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int C = NH * HD, stride = 3 * C;
    const int nt = ceil_div(T, BM), Tp = nt * BM, nkv = ceil_div(T, BN);
    const bf16* q_g = qkv + (size_t)b * T * stride + h * HD;
    const bf16* do_g = dout + (size_t)b * T * C + h * HD;
    const float* l_g = lse + (size_t)bh * T;
    const float* d_g = Dv + (size_t)bh * T;
    bf16* dq_g = dqkv + (size_t)b * T * stride + h * HD;
    float* qacc = dqacc + (size_t)bh * HD * Tp;   // nt tiles of HD x 64 (v3_dq_off)
    const float sl2 = scale * FA_LOG2E;
    // SUMS: per warp 64 float2 (dK's columns, then dV's: lane c's 2c, 2c + 1 at c and 32 + c), then per
    // warpgroup 64 dQ rows, then a max |value| word per thread (ONEPASS_SUMS_BYTES in
    // gpucore/ops/attention.py)
    float2* ksum = reinterpret_cast<float2*>(sD + ST * BM) + warp * 64 + lane;
    float* qsums = sD + ST * BM + 8 * 128;        // 2 warpgroups x 64 rows
    float* qsum = qsums + 64 * wg;
    u32* amx = reinterpret_cast<u32*>(qsums + 128) + threadIdx.x;
    if constexpr (SUMS) {
        ksum[0] = ksum[32] = make_float2(0.f, 0.f);
        if (threadIdx.x < 128) qsums[threadIdx.x] = 0.f;   // read by other threads after the first barrier
        *amx = 0u;
    }

    // Q/dO copied evict_first too, although each pass re-reads them: with the serpentine order
    // (q_of) the re-reads are of lines just touched, and the hint leaves the L2 to the dQ^T sums
    // (evict_last): x1.013-1.015 of the kernel at both shapes, measured in three rounds (H100)
    auto load_q_tile = [&](int st, int r) {
        const u64 qpol = l2_evict_first();
        v3_load_tile<BM, HD, NT, true>(sQ + st * Q_BYTES, q_g, r, T, stride, qpol);
        v3_load_tile<BM, HD, NT, true>(sO + st * Q_BYTES, do_g, r, T, C, qpol);
        load_vec_async<BM, NT>(sL + st * BM, l_g, r, T);
        load_vec_async<BM, NT>(sD + st * BM, d_g, r, T);
    };
    // KV tile pj's part of Q tile pi's dQ^T (in the accumulator, retired) into the staging tile at
    // `old` (holding the sums so far at pi's diagonal); this warpgroup's query columns QN * wg...
    auto dq_rmw = [&](const float* dq, int pi, int pj, float* old) {
        if (pj == pi * BM / BN && pj > 0)        // the diagonal: the sums copied in (waited for at the
            v3_dq_discard(qacc + pi * HD * 64);  // loop top / before this call) are dead in the scratch
        v3_dq_store<QN / 8, SUMS>(dq_g, old, dq, pi, QN * wg, pj == 0, pj == pi * BM / BN, scale, T, stride,
                                  w4, lane, qsum, amx);
    };
    auto load_kv_tile = [&](int jj) {
        const u32 k_s = sK + (jj & 1) * 2 * KV_BYTES;
        const u64 once = l2_evict_first();      // K and V are read once per head
        v3_load_tile<BN, HD, NT, true>(k_s, q_g + C, jj * BN, T, stride, once);
        v3_load_tile<BN, HD, NT, true>(k_s + KV_BYTES, q_g + 2 * C, jj * BN, T, stride, once);
    };
    // KV tile jj's kk-th visit -> its Q tile. Odd KV tiles walk their Q tiles backwards (serpentine):
    // a KV tile's pass re-reads the Q/dO tiles (and adds into the dQ^T sums) its predecessor touched
    // last, which are still in the L2; in one direction every pass met the tiles least recently used
    // (the 132 resident heads' Q/dO and sums, ~68 MB, do not fit the 50 MB L2). Measured: x1.05 (d12).
    auto q_of = [&](int jj, int kk) { return (jj & 1) ? nt - 1 - kk : jj * BN / BM + kk; };
    // (jj, kk) -> the visit after it, in the order the loops below walk them (jj >= nkv past the last)
    auto next_tile = [&](int& jj, int& kk) {
        if (kk + 1 < nt - jj * BN / BM) { kk++; return; }
        jj++;
        kk = 0;
    };
    load_kv_tile(0);
    load_q_tile(0, 0);
    cp_async_commit();
    int aj = 0, ai = 0;                           // the visit two ahead of the current one
    next_tile(aj, ai);
    if (aj < nkv) load_q_tile(1, q_of(aj, ai) * BM);
    cp_async_commit();
    next_tile(aj, ai);

    float dk[HD / 2], dv[HD / 2], st[BM / 2], dpt[BM / 2], dq[QN / 2];
    #pragma unroll
    for (int e = 0; e < BM / 2; e++) st[e] = dpt[e] = 0.f;
    // S^T = K Q^T of the first visit (each visit issues its successor's after its dQ^T)
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    wg_fence_regs<BM / 2>(st);
    wgmma_fence();
    v3_product_kk<BM, HD>(st, sK + wg * 8192, BN, sQ);
    wgmma_commit();
    #pragma unroll
    for (int e = 0; e < QN / 2; e++) dq[e] = 0.f;
    int tc = 0;                                   // tiles done: ring stage tc % ST, staging buffer tc % SA
    int pend_i = -1;                              // the Q tile of the dQ^T group in flight (of KV tile j:
                                                  // the pending tile never crosses a KV tile)

    for (int j = 0; j < nkv; j++) {
        const int n0 = j * BN;
        const int wk0 = n0 + 64 * wg;             // this warpgroup's first key
        const int key0 = wk0 + 16 * w4 + g;       // this thread's keys: key0, key0 + 8
        const u32 cK = sK + (j & 1) * 2 * KV_BYTES, cV = cK + KV_BYTES;
        #pragma unroll
        for (int e = 0; e < HD / 2; e++) dk[e] = dv[e] = 0.f;
        wg_fence_regs<HD / 2>(dk);
        wg_fence_regs<HD / 2>(dv);
        const int i_first = n0 / BM;
        const int nvis = nt - i_first;
        for (int k = 0; k < nvis; k++, tc++) {
            const int i = q_of(j, k);
            const int buf = tc % ST;
            cp_async_wait<1>();                   // this thread's copies of tile i, K/V and the staged
                                                  // sums landed (only tile tc+1's copies may pend)
            if (threadIdx.x == 0) bulk_wait_read<1>();   // tile tc-2's bulk store / add has read its staging tile
            fence_proxy_async();                  // ... visible to wgmma (async proxy)
            __syncthreads();                      // ... everyone's; every warp is past tile tc-1's
                                                  // reads of the staging buffer
            // two commit groups per tile: first what the next tile needs, then the Q tile two ahead
            // (across KV tiles too). The next KV tile's K and V, a whole KV tile ahead, into the
            // buffer KV tile j - 1 used (its last wgmma retired before the barrier at its end):
            if (k == 0 && j + 1 < nkv) load_kv_tile(j + 1);
            // this tile's dQ^T is stored at the next tile (or after the loop); at its last (diagonal)
            // KV tile, it needs the partial sums so far: into the staging buffer the previous
            // tile's part has left
            if (j > 0 && i * BM / BN == j)
                v3_dq_prefetch<NT>(sA + (tc + 1) % SA * A_BYTES, qacc + i * HD * 64);
            cp_async_commit();
            if (aj < nkv) load_q_tile((tc + 2) % ST, q_of(aj, ai) * BM);
            cp_async_commit();
            next_tile(aj, ai);
            const int m0 = i * BM;
            const u32 q_s = sQ + buf * Q_BYTES, o_s = sO + buf * Q_BYTES;
            const float* l_s = sL + buf * BM;
            const float* d_s = sD + buf * BM;
            wgmma_wait<0>();                      // S^T (issued by the previous visit) and the previous
                                                  // tile's dV, dK, dQ^T retired
            wg_fence_regs<BM / 2>(st);
            wg_fence_regs<QN / 2>(dq);
            wgmma_fence();
            v3_product_kk<BM, HD>(dpt, cV + wg * 8192, BN, o_s);  // dP^T = V dO^T, runs on
            wgmma_commit();
            // P^T = exp(S^T * scale - lse[query]); 0 where key > query or query >= T
            if (wk0 + 63 > m0 || m0 + BM > T) v3_pt_from_st<BM, 1>(st, l_s, sl2, true, key0, m0, T, t4);
            else v3_pt_from_st<BM, 0>(st, l_s, sl2, false, key0, m0, T, t4);
            {
                u32 pa[BM / 16][4];
                v3_to_frags<BM>(pa, st);
                v3_product_rs<BM, HD>(dv, pa, o_s);               // dV += P^T dO
                wgmma_commit();
                wgmma_wait<1>();                                   // dP^T ready, dV may run on
            }
            wg_fence_regs<BM / 2>(dpt);
            v3_dst_from_pt<BM>(dpt, st, d_s, t4);           // dS^T = P^T (dP^T - D[query])
            {
                u32 sa[BM / 16][4];
                v3_to_frags<BM>(sa, dpt);
                v3_product_rs<BM, HD>(dk, sa, q_s);               // dK += dS^T Q
                wgmma_commit();
                // the previous tile's dQ^T (retired at the wait<0>) into the staging tile / dqkv,
                // while dV and dK run
                if (pend_i >= 0) dq_rmw(dq, pend_i, j, sA_gen + tc % SA * (A_BYTES / 4));
                // dS^T (keys x queries) into smem, swizzled like any (BN, 64) tile: the A fragment
                // of k-step k holds rows r, r+8 (keys) x columns 16k + 2t4 (+1), 16k + 8 + 2t4 (+1)
                // (v3_tile_frags' inverse). Into buffer tc & 1: its last readers, both warpgroups'
                // dQ^T of tile tc-2, retired before tile tc-1's middle barrier.
                unsigned char* blk = sS_gen + (tc & 1) * DS_BYTES + 4 * t4;
                const int r = 64 * wg + 16 * w4 + g;
                #pragma unroll
                for (int k = 0; k < BM / 16; k++) {
                    *reinterpret_cast<u32*>(blk + wg_swz128(r, 2 * k)) = sa[k][0];
                    *reinterpret_cast<u32*>(blk + wg_swz128(r + 8, 2 * k)) = sa[k][1];
                    *reinterpret_cast<u32*>(blk + wg_swz128(r, 2 * k + 1)) = sa[k][2];
                    *reinterpret_cast<u32*>(blk + wg_swz128(r + 8, 2 * k + 1)) = sa[k][3];
                }
            }
            cp_async_wait<2>();                   // all but this visit's two groups: the next visit's Q
                                                  // tile, and the next KV tile's K (this thread's copies)
            fence_proxy_async();                  // dS^T (and staged dQ^T) stores visible to the async proxy ...
            __syncthreads();                      // ... from every warp (dQ^T reads all BN keys)
            wg_fence_regs<QN / 2>(dq);
            wgmma_fence();
            const u64 k_desc = smem_desc(cK, BN * 128, 1024);   // K^T: K's rows MN-major
            const u64 ds_desc = smem_desc(sS + (tc & 1) * DS_BYTES + 2 * QN * wg, BN * 128, 1024);
            #pragma unroll
            for (int ks = 0; ks < BN / 16; ks++)  // dQ^T = K^T dS^T over all BN keys
                wgmma_m64n32k16_ss_mnmn(dq, desc_add(k_desc, ks * 2048), desc_add(ds_desc, ks * 2048), ks > 0);
            wgmma_commit();
            {   // the next visit's S^T = K Q^T, running while this one finishes and the next one's
                // loop top meets (the next KV tile's first after this KV tile's last; after the
                // head's last visit a product nobody reads, on stale tiles). Issuing its dP^T here
                // too measured no faster: dP^T then no longer runs beside the exps.
                const u32 kn = sK + ((k + 1 == nvis ? j + 1 : j) & 1) * 2 * KV_BYTES;
                wg_fence_regs<BM / 2>(st);
                wg_fence_regs<BM / 2>(dpt);
                wgmma_fence();
                v3_product_kk<BM, HD>(st, kn + wg * 8192, BN, sQ + (tc + 1) % ST * Q_BYTES);
                wgmma_commit();
            }
            // the previous tile's staged part (not its last KV tile) into the scratch
            if (threadIdx.x == 0 && pend_i >= 0 && j != pend_i * BM / BN)
                v3_dq_flush(qacc + pend_i * HD * 64, sA + tc % SA * A_BYTES, j, A_BYTES);
            pend_i = i;
        }
        wgmma_wait<0>();                          // this KV tile's dK, dV and last dQ^T
        wg_fence_regs<HD / 2>(dk);
        wg_fence_regs<HD / 2>(dv);
        wg_fence_regs<QN / 2>(dq);
        cp_async_wait<1>();                       // the staged partial sums (the Q tile two ahead may pend)
        __syncthreads();                          // ... everyone's copies
        dq_rmw(dq, pend_i, j, sA_gen + tc % SA * (A_BYTES / 4));
        if (j != pend_i * BM / BN) {
            fence_proxy_async();
            __syncthreads();
            if (threadIdx.x == 0) v3_dq_flush(qacc + pend_i * HD * 64, sA + tc % SA * A_BYTES, j, A_BYTES);
        }
        // The next KV tile's bulk additions must land after this one's, and its staging copies
        // read what they wrote: complete them (thread 0 issued them all); the next loop-top
        // barrier publishes that.
        if (threadIdx.x == 0) bulk_wait_done<0>();
        pend_i = -1;
        bf16* dk_g = dqkv + (size_t)b * T * stride + C + h * HD;
        // dK, dV through the first dS^T tile (free: every dQ^T that read it retired before the
        // barrier above; the next KV tile writes it after its loop-top barrier), 8 KB per warpgroup
        const u32 stage = sS + wg * (64 * HD * 2);
        unsigned char* stage_gen = sS_gen + wg * (64 * HD * 2);
        v3_store_acc_staged<HD>(dk_g, dk, scale, wk0, T, stride, stage, stage_gen, w4, lane);
        if constexpr (SUMS) v3_warp_colsum(ksum, amx, stage_gen + 16 * w4 * 128, lane);
        v3_store_acc_staged<HD>(dk_g + C, dv, 1.f, wk0, T, stride, stage, stage_gen, w4, lane);
        if constexpr (SUMS) v3_warp_colsum(ksum + 32, amx, stage_gen + 16 * w4 * 128, lane);
    }
    cp_async_wait<0>();
    if constexpr (SUMS) {                          // the head's sums, in a fixed order
        __syncthreads();
        const float* kred = reinterpret_cast<const float*>(sD + ST * BM);   // 8 warps x (64 dK + 64 dV)
        const float* qred = kred + 8 * 128;                                 // 2 warpgroups x 64 dQ rows
        float* prow = part + (size_t)b * 3 * C + h * HD;
        const int t = threadIdx.x;
        if (t < HD) {
            prow[t] = qred[t] + qred[64 + t];
        } else if (t < 3 * HD) {
            const int c = t - HD;                  // 0..63 dK, 64..127 dV
            float acc = kred[c];
            #pragma unroll
            for (int w = 1; w < 4 * NWG; w++) acc += kred[w * 128 + c];
            prow[(c < HD ? C : 2 * C) + (c & (HD - 1))] = acc;
        }
        if (amax) block_amax(amax, *amx);          // uniform: every thread of the block calls it
    }
}

#define V3_BWD1_BODY(HD, NWG) flash_bwd_onepass_v3<HD, NWG>(dqkv, dqacc, qkv, dout, lse, D, T, NH, scale)
#define V3_BWD1_SUMS_BODY(HD, NWG) \
    flash_bwd_onepass_v3<HD, NWG, true>(dqkv, dqacc, qkv, dout, lse, D, T, NH, scale, part, amax)
#else
#define V3_BWD1_BODY(HD, NWG) __trap()    // not sm_90a: Python never launches this
#define V3_BWD1_SUMS_BODY(HD, NWG) __trap()
#endif

// grid (B * NH), 128 * NWG threads, 2 / NWG blocks per SM; dqacc: f32 scratch (B * NH, HD,
// ceil(T / 64) * 64), no initial value needed.
#define FLASH_V3_BWD1(HD, NWG)                                                                     \
    extern "C" __global__ void __launch_bounds__(128 * NWG, 2 / NWG)                              \
    attention_backward_onepass_kernel_v3_hd##HD##_g##NWG##_bf16(bf16* dqkv, float* dqacc,         \
            const bf16* qkv, const bf16* dout, const float* lse, const float* D, int T, int NH,     \
            float scale) {                                                                         \
        V3_BWD1_BODY(HD, NWG);                                                                     \
    }

FLASH_V3_BWD1(64, 2)

// The same, and the qkv bias gradient's stage 1: part (B, 3C) f32, row b = the column sums of dqkv[b]
// (as written, bf16) over t < T; each block writes its head's 3 x HD (colsum's stage 2 adds the rows).
// amax (1,) f32 or null: *amax = max(*amax, max |dqkv|) (bit max, as fp8_amax_kernel folds it).
#define FLASH_V3_BWD1_SUMS(HD, NWG)                                                                \
    extern "C" __global__ void __launch_bounds__(128 * NWG, 2 / NWG)                              \
    attention_backward_onepass_kernel_v3_hd##HD##_g##NWG##_bf16_sums(bf16* dqkv, float* dqacc,    \
            const bf16* qkv, const bf16* dout, const float* lse, const float* D, int T, int NH,     \
            float scale, float* part, float* amax) {                                               \
        V3_BWD1_SUMS_BODY(HD, NWG);                                                                \
    }

FLASH_V3_BWD1_SUMS(64, 2)
