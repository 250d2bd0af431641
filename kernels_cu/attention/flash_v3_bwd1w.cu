/*
 * attention/flash_v3_bwd1w.cu -- causal attention backward in one pass on Hopper's wgmma (v3,
 * sm_90a), in 128-query x 128-key visits: FlashAttention-3's backward shape inside the one-pass
 * kernel's deterministic frame (attention/flash_v3_bwd1.cu: same inputs, output and dQ scratch
 * scheme). HD = 64.
 *
 * Why: the one-pass kernel visits 128 keys x 64 queries; each warpgroup's products are m64n64
 * (S^T, dP^T, dV, dK) and m64n32 (dQ^T) chains of 4-8 wgmmas between exps, barriers and waits,
 * and it runs latency-bound (ncu: tensor pipe ~30% busy). Twice the queries per visit double the
 * work between those points and make S and dP m64n128 products.
 *
 *   block = one (batch, head), 2 warpgroups, one block per SM; for each KV tile j of 128 keys (in
 *   order) and each Q tile i of 128 queries, i >= j (in order); warpgroup w owns queries 64w..64w+63
 *   of S, dP, dQ and keys 64w..64w+63 of dV, dK:
 *     S  = Q_w K^T, dP = dO_w V^T          (m64n128, smem x smem, K-major)
 *     P  = exp2(S * scale*log2e - lse*log2e), 0 where key > query or query >= T (per-row lse, D
 *          straight from global memory into registers: two rows a thread)
 *     dS = P (dP - D)
 *     P, dS -> bf16 tiles in smem (stmatrix); dQ_i part = dS_w K (register A, m64n64)
 *     barrier; dV_w += P^T dO, dK_w += dS^T Q  (both operands MN-major from smem, m64n64)
 *   dQ of Q tile i is summed over the KV tiles in order in an f32 scratch per head (a 32 KB tile per
 *   Q tile), as in flash_v3_bwd1.cu: each visit's part goes to a staging tile and one bulk copy
 *   stores it (first KV tile) or adds it in the L2 (cp.reduce.async.bulk .add.f32); all of a KV
 *   tile's bulk operations complete before the next KV tile's, so the sums land in KV-tile order
 *   (same bits every run). The diagonal visit (i = j, a KV tile's first) ends Q tile i: each thread
 *   copies its own elements of the sums so far into the staging tile at the visit's top
 *   (cp.async), adds its part at the end and writes dQ (bf16, times scale) to dqkv.
 * Pipelining: Q/dO copied one visit ahead (two stages), the next KV tile's K/V a KV tile ahead (two
 * buffers). Within a visit: S and dP as two groups (P's exps run while dP finishes), dQ as a group
 * before the middle barrier, dV and dK after it, running while dQ is staged.
 *
 * Shared memory: 2 x K, V (128 x HD), 2 stages of Q, dO (128 x HD), P and dS (128 x 128), one
 * staged dQ part (128 x HD f32), all bf16 tiles 128B-swizzled (wgmma.cuh): 229,376 bytes + 1024
 * for the alignment.
 * Compiled for anything but sm_90a the kernel traps; Python launches it only on sm_90 devices.
 */
#include "attention/flash.cuh"
#include "wgmma.cuh"
#include "attention/flash_v3.cuh"
#include "attention/flash_v3_bwd.cuh"   // v3_product_kk / rs, v3_store_acc_staged

#ifndef WIDE_S_FIRST
#define WIDE_S_FIRST 1
#endif
#ifndef WIDE_SPLIT_LOADS
#define WIDE_SPLIT_LOADS 0
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Element (r, c) (c even; c + 1 follows) of a dQ part (128 query rows x 64 f32): float2 pairs of a
// row permuted by r & 7, so a warp's stores of one accumulator block hit each bank once per phase.
// The scratch tiles use the same layout: one bulk copy moves a tile.
__device__ __forceinline__ int w_dq_off(int r, int c) { return r * 64 + ((((c >> 1) ^ ((r & 7) << 2))) << 1); }

__device__ __forceinline__ void cp_async8(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}

// This warp's 16 rows (row_base..) of a 64 x 128 product, as bf16 A fragments f (k-step k = columns
// 16k..16k+15), into a (128, 128) bf16 tile at shared address s: two column blocks of 64, each a
// (128 x 128 B) swizzled block. stmatrix: matrix m of k-step k = rows 8 (m & 1).., columns 16k + 8 (m >> 1)...
__device__ __forceinline__ void w_store_frags(u32 s, const u32 (&f)[8][4], int row_base, int lane) {
    const int m = lane >> 3, row = row_base + (lane & 7) + 8 * (m & 1);
    #pragma unroll
    for (int k = 0; k < 8; k++) {
        const int chunk = 2 * k + (m >> 1);
        stmatrix_x4(s + (chunk >> 3) * (128 * 128) + wg_swz128(row, chunk & 7), f[k][0], f[k][1], f[k][2], f[k][3]);
    }
}

// d (64 x 64) += A (64 x KN) @ B (KN x 64): A's transpose stored as a (KN, 64) swizzled tile at a
// (M contiguous), B a (KN, 64) swizzled tile at b (N contiguous). No commit.
template <int KN>
__device__ __forceinline__ void w_product_mnmn(float* d, u32 a, u32 b) {
    const u64 da = smem_desc(a, KN * 128, 1024), db = smem_desc(b, KN * 128, 1024);
    #pragma unroll
    for (int ks = 0; ks < KN / 16; ks++) wgmma_m64n64k16_ss_mnmn(d, desc_add(da, ks * 2048), desc_add(db, ks * 2048), 1);
}

// The staged part of Q tile pi (at shared address s) to its scratch tile: stored at the first KV
// tile, added to the sum from the second on (thread 0 issues them all).
__device__ __forceinline__ void w_dq_flush(float* qtile, u32 s, int j, u32 bytes) {
    if (j == 0) bulk_store_s2g(qtile, s, bytes);
    else bulk_reduce_add_s2g(qtile, s, bytes);
    bulk_commit();
}

template <int HD>
__device__ __forceinline__ void flash_bwd_wide_v3(bf16* dqkv, float* dqacc, const bf16* qkv, const bf16* dout,
                                                  const float* lse, const float* Dv, int T, int NH, float scale) {
    static_assert(HD == 64, "wide one-pass backward: head dim 64");
    constexpr int BM = 128, BN = 128, NT = 256;
    constexpr int TILE = 128 * HD * 2;            // a (128, HD) bf16 tile: 16 KB
    constexpr int PT = 128 * 128 * 2;             // P or dS: 32 KB
    constexpr int A_BYTES = BM * HD * 4;          // a dQ part: 32 KB
    extern __shared__ unsigned char smem_w[];
    const u32 raw = smem_u32_asm(smem_w);
    const u32 sK = (raw + 1023u) & ~1023u;        // K0 V0 K1 V1: KV tile j in buffer j & 1
    const u32 sQ = sK + 4 * TILE;                 // Q stages 0, 1
    const u32 sO = sQ + 2 * TILE;                 // dO stages 0, 1
    const u32 sP = sO + 2 * TILE;
    const u32 sS = sP + PT;
    const u32 sA = sS + PT;                       // the staged dQ part
    float* sL = reinterpret_cast<float*>(smem_w + (sA + A_BYTES - raw));   // 2 stages x (BM lse, BM D)
    float* sA_gen = reinterpret_cast<float*>(smem_w + (sA - raw));
    unsigned char* sP_gen = smem_w + (sP - raw);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wg = warp >> 2, w4 = warp & 3, g = lane >> 2, t4 = lane & 3;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int C = NH * HD, stride = 3 * C;
    const int nt = ceil_div(T, BM);
    const bf16* q_g = qkv + (size_t)b * T * stride + h * HD;
    const bf16* do_g = dout + (size_t)b * T * C + h * HD;
    const float* l_g = lse + (size_t)bh * T;
    const float* d_g = Dv + (size_t)bh * T;
    bf16* dq_g = dqkv + (size_t)b * T * stride + h * HD;
    float* qacc = dqacc + (size_t)bh * nt * BM * HD;
    const float sl2 = scale * FA_LOG2E;
    const int rloc = 64 * wg + 16 * w4 + g;       // this thread's rows of a Q tile: rloc, rloc + 8

    auto load_q_only = [&](int st, int r) {
        v3_load_tile<BM, HD, NT>(sQ + st * TILE, q_g, r, T, stride);
        load_vec_async<BM, NT>(sL + st * 2 * BM, l_g, r, T);
        load_vec_async<BM, NT>(sL + st * 2 * BM + BM, d_g, r, T);
    };
    auto load_do = [&](int st, int r) { v3_load_tile<BM, HD, NT>(sO + st * TILE, do_g, r, T, C); };
    auto load_q = [&](int st, int r) {
        load_q_only(st, r);
        load_do(st, r);
    };
    auto load_kv = [&](int jj) {
        const u32 k_s = sK + (jj & 1) * 2 * TILE;
        v3_load_tile<BN, HD, NT>(k_s, q_g + C, jj * BN, T, stride);
        v3_load_tile<BN, HD, NT>(k_s + TILE, q_g + 2 * C, jj * BN, T, stride);
    };
    auto product_dq = [&](float* d, u32 k_s) {
        const u64 da = smem_desc(sS + wg * 8192, 16, 1024), db = smem_desc(k_s, BN * 128, 1024);
        #pragma unroll
        for (int ks = 0; ks < BN / 16; ks++)
            wgmma_m64n64k16_ss_kmn(d, desc_add(da, (ks >> 2) * (128 * 128) + (ks & 3) * 32), desc_add(db, ks * 2048),
                                   ks > 0);
    };
    float sacc[BN / 2], dpacc[BN / 2];
    float dk[HD / 2], dv[HD / 2];
    for (int e = 0; e < HD / 2; e++) dk[e] = dv[e] = 0.f;
    load_kv(0);
    load_q(0, 0);
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    wgmma_fence();
    v3_product_kk<BN, HD>(sacc, sQ + wg * 8192, BM, sK);
    wgmma_commit();
#if WIDE_S_FIRST == 2
    v3_product_kk<BN, HD>(dpacc, sO + wg * 8192, BM, sK + TILE);
    wgmma_commit();
#endif

    int tc = 0;                                   // visits done: Q/dO stage tc & 1
    int pend_i = -1;                              // the Q tile whose part is staged, to flush
    for (int j = 0; j < nt; j++) {
        const int n0 = j * BN;
        const u32 cK = sK + (j & 1) * 2 * TILE, cV = cK + TILE;
        for (int i = j; i < nt; i++, tc++) {
            const int s = tc & 1, m0 = i * BM;
            const bool diag = i == j;
            cp_async_wait<0>();                   // this visit's Q/dO (and K/V at a KV tile's first)
            fence_proxy_async();
            __syncthreads();                      // everyone's copies and staged part; the previous
                                                  // visit's wgmmas all retired
            if (threadIdx.x == 0 && pend_i >= 0) w_dq_flush(qacc + pend_i * BM * HD, sA, j, A_BYTES);
            pend_i = -1;
            {   // copies: the next visit's Q/dO, the next KV tile's K/V, this diagonal's sums so far
                int ni = i + 1;
                if (ni == nt) ni = j + 1;
#if WIDE_SPLIT_LOADS
                if (ni < nt) load_q_only(s ^ 1, ni * BM);   // needed by the next S (after the middle
                                                            // barrier); dO only by the next top's dP
#else
                if (ni < nt) load_q(s ^ 1, ni * BM);
#endif
                if (diag && j + 1 < nt) load_kv(j + 1);
                if (diag && j > 0) {
                    const float* qt = qacc + i * BM * HD;
                    #pragma unroll
                    for (int rr = 0; rr < 2; rr++)
                        #pragma unroll
                        for (int jn = 0; jn < HD / 8; jn++) {
                            const int off = w_dq_off(rloc + 8 * rr, 8 * jn + 2 * t4);
                            cp_async8(sA + 4 * off, qt + off);
                        }
                }
                cp_async_commit();
#if WIDE_SPLIT_LOADS
                if (ni < nt) load_do(s ^ 1, ni * BM);
                cp_async_commit();
#endif
            }
            const int qa = m0 + rloc, qb = qa + 8;
            const float* l_s = sL + s * 2 * BM;   // (rows >= T: zeros)
            const float nla = -l_s[rloc] * FA_LOG2E, nlb = -l_s[rloc + 8] * FA_LOG2E;
            const float da = l_s[BM + rloc], db = l_s[BM + rloc + 8];
            const u32 q_s = sQ + s * TILE, o_s = sO + s * TILE;
            wgmma_wait<0>();
            wg_fence_regs<BN / 2>(sacc);
#if WIDE_S_FIRST != 2
            wgmma_fence();
            v3_product_kk<BN, HD>(dpacc, o_s + wg * 8192, BM, cV);  // dP = dO_w V^T
            wgmma_commit();
#endif
            const bool masked = diag || m0 + BM > T;
            #pragma unroll
            for (int jn = 0; jn < BN / 8; jn++)
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int q = e < 2 ? qa : qb;
                    float p = fast_exp2(fmaf(sacc[4 * jn + e], sl2, e < 2 ? nla : nlb));
                    if (masked && (n0 + 8 * jn + 2 * t4 + (e & 1) > q || q >= T)) p = 0.f;
                    sacc[4 * jn + e] = p;
                }
            wgmma_wait<0>();
            wg_fence_regs<BN / 2>(dpacc);
            #pragma unroll
            for (int e = 0; e < BN / 2; e++) dpacc[e] = sacc[e] * (dpacc[e] - ((e & 2) ? db : da));
            {
                u32 pf[BN / 16][4];
                v3_to_frags<BN>(pf, sacc);
                w_store_frags(sP, pf, 64 * wg + 16 * w4, lane);
            }
            {
            u32 sf[BN / 16][4];
            v3_to_frags<BN>(sf, dpacc);
            w_store_frags(sS, sf, 64 * wg + 16 * w4, lane);
            }
            float dq[HD / 2];
            cp_async_wait<WIDE_SPLIT_LOADS>();    // the next visit's Q, K/V, lse/D; this diagonal's sums
            fence_proxy_async();                  // P, dS stores visible to the async proxy ...
            if (threadIdx.x == 0) bulk_wait_read<0>();   // (the flush issued at the top has read sA)
            __syncthreads();                      // ... from both warpgroups
            wg_fence_regs<HD / 2>(dk);
            wg_fence_regs<HD / 2>(dv);
            wgmma_fence();
            const int nj = i + 1 == nt ? j + 1 : j;   // the next visit's KV tile
#if WIDE_S_FIRST
            // the next visit's S first (its exps need it soonest; after the head's last visit a
            // product nobody reads, on stale tiles: issued on every path), then this visit's dQ part,
            // dV and dK
            v3_product_kk<BN, HD>(sacc, sQ + (s ^ 1) * TILE + wg * 8192, BM, sK + (nj & 1) * 2 * TILE);
            wgmma_commit();
#if WIDE_S_FIRST == 2
            v3_product_kk<BN, HD>(dpacc, sO + (s ^ 1) * TILE + wg * 8192, BM, sK + (nj & 1) * 2 * TILE + TILE);
            wgmma_commit();
#endif
            product_dq(dq, cK);                   // dQ part = dS_w K
            wgmma_commit();
            w_product_mnmn<BM>(dv, sP + wg * (128 * 128), o_s);   // dV_w += P^T dO
            w_product_mnmn<BM>(dk, sS + wg * (128 * 128), q_s);   // dK_w += dS^T Q
            wgmma_commit();
            wgmma_wait<1>();                      // S (dP) and the dQ part (dV, dK run on)
#else
            product_dq(dq, cK);
            wgmma_commit();
            w_product_mnmn<BM>(dv, sP + wg * (128 * 128), o_s);
            w_product_mnmn<BM>(dk, sS + wg * (128 * 128), q_s);
            wgmma_commit();
            v3_product_kk<BN, HD>(sacc, sQ + (s ^ 1) * TILE + wg * 8192, BM, sK + (nj & 1) * 2 * TILE);
            wgmma_commit();
            wgmma_wait<1>();                      // the dQ part, dV, dK (S runs on)
#endif
            wg_fence_regs<HD / 2>(dq);
            if (diag) {                           // Q tile i's last KV tile: sums + part -> dqkv
                cp_async_wait<0>();
                #pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    const int r = rloc + 8 * rr;
                    #pragma unroll
                    for (int jn = 0; jn < HD / 8; jn++) {
                        const int c = 8 * jn + 2 * t4;
                        float2 v = make_float2(dq[4 * jn + 2 * rr], dq[4 * jn + 2 * rr + 1]);
                        if (j > 0) {
                            const float2 o = *reinterpret_cast<const float2*>(sA_gen + w_dq_off(r, c));
                            v.x += o.x;
                            v.y += o.y;
                        }
                        if (m0 + r < T)
                            *reinterpret_cast<u32*>(dq_g + (size_t)(m0 + r) * stride + c) =
                                pack_bf16x2_rn(v.x * scale, v.y * scale);
                    }
                }
            } else {                              // the part -> the staging tile, flushed at the next top
                #pragma unroll
                for (int rr = 0; rr < 2; rr++)
                    #pragma unroll
                    for (int jn = 0; jn < HD / 8; jn++)
                        *reinterpret_cast<float2*>(sA_gen + w_dq_off(rloc + 8 * rr, 8 * jn + 2 * t4)) =
                            make_float2(dq[4 * jn + 2 * rr], dq[4 * jn + 2 * rr + 1]);
                pend_i = i;
            }
#if WIDE_S_FIRST
            wgmma_wait<0>();                      // dV, dK (the next top's barrier frees P, dS)
#endif
            wg_fence_regs<HD / 2>(dk);
            wg_fence_regs<HD / 2>(dv);
        }
        wgmma_wait<0>();
        if (pend_i >= 0) {                        // the KV tile's last part
            fence_proxy_async();
            __syncthreads();
            if (threadIdx.x == 0) w_dq_flush(qacc + pend_i * BM * HD, sA, j, A_BYTES);
            pend_i = -1;
        }
        // the next KV tile's bulk additions land after this one's, and its diagonal reads the sums
        if (threadIdx.x == 0) bulk_wait_done<0>();
        __syncthreads();                          // every wgmma of the KV tile retired: P is free
        bf16* dk_g = dqkv + (size_t)b * T * stride + C + h * HD;
        const u32 stage = sP + wg * (64 * HD * 2);
        unsigned char* stage_gen = sP_gen + wg * (64 * HD * 2);
        v3_store_acc_staged<HD>(dk_g, dk, scale, n0 + 64 * wg, T, stride, stage, stage_gen, w4, lane);
        v3_store_acc_staged<HD>(dk_g + C, dv, 1.f, n0 + 64 * wg, T, stride, stage, stage_gen, w4, lane);
        #pragma unroll
        for (int e = 0; e < HD / 2; e++) dk[e] = dv[e] = 0.f;
    }
    cp_async_wait<0>();
}

#define V3_BWD1W_BODY(HD) flash_bwd_wide_v3<HD>(dqkv, dqacc, qkv, dout, lse, D, T, NH, scale)
#else
#define V3_BWD1W_BODY(HD) __trap()    // not sm_90a: Python never launches this
#endif

// grid (B * NH), 256 threads, 1 block per SM; dqacc: f32 scratch (B * NH, ceil(T / 128) * 128, HD),
// no initial value needed.
#define FLASH_V3_BWD1W(HD)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 1)                                           \
    attention_backward_wide_kernel_v3_hd##HD##_bf16(bf16* dqkv, float* dqacc, const bf16* qkv,     \
            const bf16* dout, const float* lse, const float* D, int T, int NH, float scale) {      \
        V3_BWD1W_BODY(HD);                                                                         \
    }

FLASH_V3_BWD1W(64)
