/*
 * attention/flash_v3_bwd.cu -- causal attention backward on Hopper's wgmma (v3, sm_90a).
 *
 * Op and math: exactly attention/flash_bwd.cu's (v2), same inputs and outputs:
 *   qkv (B, T, 3C) bf16, dout (B, T, C) bf16, lse and D = rowsum(dout * out) (B, NH, T) f32
 *   (D from v2's preprocess kernel) -> dqkv (B, T, 3C) bf16, written [=] (activation gradient),
 *   every element of every row t < T exactly once. HD = 64 or 128.
 * Same deterministic two-pass structure as v2 (no atomics; each output element is summed by
 * one thread in a fixed order), only the tile products run as wgmma instead of mma.sync:
 *   dkdv: block = (KV tile of 64 * NWG keys, head); warpgroup w owns keys 64w..64w+63 and keeps
 *         dK, dV (64 x HD) as wgmma accumulators while Q / dO / lse / D tiles of BM queries
 *         stream through a cp.async ring (ST stages, below). Per Q tile (FlashAttention-3's operand choice):
 *           S^T  = K Q^T        A = K (smem, K-major), B = Q (smem, K-major)      m64nBMk16
 *           dP^T = V dO^T       A = V,                 B = dO (K-major)           m64nBMk16
 *           P^T  = exp2(S^T * scale*log2e - lse*log2e), 0 where key > query or query >= T
 *           dV  += P^T dO       A = P^T (registers),   B = dO (MN-major, trans-b) m64nHDk16
 *           dS^T = P^T (dP^T - D)
 *           dK  += dS^T Q       A = dS^T (registers),  B = Q (MN-major, trans-b)  m64nHDk16
 *   dq:   block = (Q tile of 64 * NWG rows, head); warpgroup w owns rows 64w..; per KV tile of BN:
 *           S = Q K^T, dP = dO V^T (smem x smem), P, dS = P (dP - D), dQ += dS K (K MN-major).
 *
 * Shared memory: every (rows x HD) bf16 tile is stored as HD/64 column blocks of (rows x 128 B),
 * 128-byte swizzled (wgmma.cuh's header), each block 1024-byte aligned. The same bytes serve as a
 * K-major operand (rows = M or N, k-steps of 32 B inside a block, next block at rows * 128) and as
 * an MN-major one (rows = K: k-step of 16 rows = 2048 B; LBO = rows * 128 between 64-col blocks).
 * Rows >= T are zero-filled by cp.async (src-size 0): no uninitialised bits reach a wgmma.
 *
 * Ordering (per tile i; one __syncthreads per tile): cp.async wait 0 (tile i) ->
 * fence.proxy.async -> __syncthreads -> cp.async of tile i+1 into the stage tile i+1-ST used ->
 * per warpgroup: [fence regs, wgmma.fence] S-group, dP-group; wait<1> (S ready, and tile i-1's
 * dV/dK groups) -> P -> [wgmma.fence] dV-group; wait<1> (dP ready, dV runs on) -> dS ->
 * [wgmma.fence] dK-group, left running into tile i+1 (hd 64: ST = 3 stages, so the prefetch
 * after the next barrier never hits a stage a running group reads; a warpgroup skipping a tile
 * waits 0 instead). hd 128 (register-bound): ST = 2, wait 0 after the dV and dK groups, so P's
 * and dS's A fragments share registers. The dQ pass is ordered the same way (dQ-group = dK's).
 * Warpgroups skip tiles with no unmasked element (warpgroup-uniform branch, no barrier inside).
 *
 * Compiled for anything but sm_90a (kernels check --arch 80/90) the kernels trap; Python
 * launches them only on sm_90 devices, loading this file with arch "90a".
 */
#include "attention/flash.cuh"
#include "wgmma.cuh"
#include "attention/flash_v3.cuh"   // v3_load_tile, v3_to_frags, v3_mma_ss/rs
#include "attention/flash_v3_bwd.cuh"   // v3_store_acc, v3_row_dot, v3_tile_frags, v3_product_*

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <int HD, int NWG, int BM, int MINB, bool RA>
__device__ __forceinline__ void flash_bwd_dkdv_v3(bf16* dqkv, const bf16* qkv, const bf16* dout, const float* lse,
                                                  const float* Dv, int T, int NH, float scale) {
    constexpr int BN = 64 * NWG, NT = 128 * NWG;
    constexpr int KV_BYTES = BN * HD * 2, Q_BYTES = BM * HD * 2;
    // hd 64: dK's wgmma group runs on into the next tile (3 stages; needs the 255-register budget)
    constexpr bool OVL = HD == 64;
    static_assert(!OVL || NWG * MINB <= 2, "hd 64 runs the 3-stage overlapped loop (ops/attention.py sizes smem so)");
    constexpr int ST = OVL ? 3 : 2;               // Q/dO/lse/D ring stages
    extern __shared__ unsigned char smem_v3[];
    const u32 raw = smem_u32_asm(smem_v3);
    const u32 sK = (raw + 1023u) & ~1023u;        // swizzle atoms need 1024-byte alignment
    const u32 sV = sK + KV_BYTES;
    const u32 sQ = sV + KV_BYTES;                 // 2 stages
    const u32 sO = sQ + ST * Q_BYTES;             // ST stages (dout)
    float* sL = reinterpret_cast<float*>(smem_v3 + (sO + ST * Q_BYTES - raw));  // ST x BM lse
    float* sD = sL + ST * BM;                                                   // ST x BM D

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wg = warp >> 2, w4 = warp & 3, g = lane >> 2, t4 = lane & 3;
    int bh, rank;
    v3_block_order(bh, rank);
    const int b = bh / NH, h = bh % NH;
    const int n0 = rank * BN;                     // tile 0 has the most Q tiles: launched first
    const int C = NH * HD, stride = 3 * C;
    const bf16* q_g = qkv + (size_t)b * T * stride + h * HD;
    const bf16* do_g = dout + (size_t)b * T * C + h * HD;
    const float* l_g = lse + (size_t)bh * T;
    const float* d_g = Dv + (size_t)bh * T;
    const int i_first = n0 / BM, i_end = ceil_div(T, BM);

    v3_load_tile<BN, HD, NT>(sK, q_g + C, n0, T, stride);
    v3_load_tile<BN, HD, NT>(sV, q_g + 2 * C, n0, T, stride);
    v3_load_tile<BM, HD, NT>(sQ, q_g, i_first * BM, T, stride);
    v3_load_tile<BM, HD, NT>(sO, do_g, i_first * BM, T, C);
    load_vec_async<BM, NT>(sL, l_g, i_first * BM, T);
    load_vec_async<BM, NT>(sD, d_g, i_first * BM, T);
    cp_async_commit();

    const int wk0 = n0 + 64 * wg;                 // this warpgroup's first key
    const int key0 = wk0 + 16 * w4 + g;           // this thread's keys: key0, key0 + 8
    const float sl2 = scale * FA_LOG2E;
    float dk[HD / 2], dv[HD / 2], st[BM / 2], dpt[BM / 2];
    #pragma unroll
    for (int e = 0; e < HD / 2; e++) dk[e] = dv[e] = 0.f;
    #pragma unroll
    for (int e = 0; e < BM / 2; e++) st[e] = dpt[e] = 0.f;
    wg_fence_regs<HD / 2>(dk);
    wg_fence_regs<HD / 2>(dv);
    static_assert(!RA || BM == 64, "register-A products are m64n64");
    [[maybe_unused]] u32 ka[RA ? HD / 16 : 1][4], va[RA ? HD / 16 : 1][4];
    if constexpr (RA) {                           // this warpgroup's K and V rows, once per block
        cp_async_wait<0>();
        __syncthreads();                          // everyone's copies of K, V landed
        v3_tile_frags<BN, HD>(ka, smem_v3 + (sK - raw), 64 * wg + 16 * w4 + g, t4);
        v3_tile_frags<BN, HD>(va, smem_v3 + (sV - raw), 64 * wg + 16 * w4 + g, t4);
    }

    for (int i = i_first; i < i_end; i++) {
        const int buf = (i - i_first) % ST, nxt = (i - i_first + 1) % ST;
        cp_async_wait<0>();                       // this thread's copies of tile i landed
        fence_proxy_async();                      // ... visible to wgmma (async proxy)
        __syncthreads();                          // ... everyone's; and every warpgroup has retired
                                                  // the wgmma of tile i-1 (ST 2) / i-2 (ST 3)
        if (i + 1 < i_end) {                      // -> stage nxt (tile i+1-ST's) is free
            const int r = (i + 1) * BM;
            v3_load_tile<BM, HD, NT>(sQ + nxt * Q_BYTES, q_g, r, T, stride);
            v3_load_tile<BM, HD, NT>(sO + nxt * Q_BYTES, do_g, r, T, C);
            load_vec_async<BM, NT>(sL + nxt * BM, l_g, r, T);
            load_vec_async<BM, NT>(sD + nxt * BM, d_g, r, T);
        }
        cp_async_commit();
        const int m0 = i * BM;
        if (wk0 < T && m0 + BM - 1 >= wk0) {      // warpgroup-uniform: some query >= some key
            const u32 q_s = sQ + buf * Q_BYTES, o_s = sO + buf * Q_BYTES;
            const float* l_s = sL + buf * BM;
            const float* d_s = sD + buf * BM;
            wg_fence_regs<BM / 2>(st);
            wg_fence_regs<BM / 2>(dpt);
            wgmma_fence();
            if constexpr (RA) v3_product_rk<HD>(st, ka, q_s);       // S^T = K Q^T
            else v3_product_kk<BM, HD>(st, sK + wg * 8192, BN, q_s);
            wgmma_commit();
            if constexpr (RA) v3_product_rk<HD>(dpt, va, o_s);      // dP^T = V dO^T
            else v3_product_kk<BM, HD>(dpt, sV + wg * 8192, BN, o_s);
            wgmma_commit();
            wgmma_wait<1>();                      // S^T (and the previous tile's dV, dK) retired
            wg_fence_regs<BM / 2>(st);
            // P^T = exp(S^T * scale - lse[query]); 0 where key > query or query >= T
            v3_pt_from_st<BM>(st, l_s, sl2, wk0 + 63 > m0 || m0 + BM > T, key0, m0, T, t4);
            {
                u32 pa[BM / 16][4];
                v3_to_frags<BM>(pa, st);
                v3_product_rs<BM, HD>(dv, pa, o_s);               // dV += P^T dO
                wgmma_commit();
                if constexpr (HD == 128) wgmma_wait<0>();          // frees pa's registers for sa
                else wgmma_wait<1>();                              // dP^T ready, dV may run on
            }
            wg_fence_regs<BM / 2>(dpt);
            v3_dst_from_pt<BM>(dpt, st, d_s, t4);           // dS^T = P^T (dP^T - D[query])
            {
                u32 sa[BM / 16][4];
                v3_to_frags<BM>(sa, dpt);
                v3_product_rs<BM, HD>(dk, sa, q_s);               // dK += dS^T Q
                wgmma_commit();
                if constexpr (!OVL) {             // else: retired after the next S^T
                    wgmma_wait<0>();
                    wg_fence_regs<HD / 2>(dk);
                    wg_fence_regs<HD / 2>(dv);
                }
            }
        } else {
            wgmma_wait<0>();                      // keeps "tile i-1's wgmma retired" true here
        }
    }
    wgmma_wait<0>();
    wg_fence_regs<HD / 2>(dk);
    wg_fence_regs<HD / 2>(dv);
    cp_async_wait<0>();
    bf16* dk_g = dqkv + (size_t)b * T * stride + C + h * HD;
    v3_store_acc<HD>(dk_g, dk, scale, key0, T, stride, t4);
    v3_store_acc<HD>(dk_g + C, dv, 1.f, key0, T, stride, t4);
}

// FD (fused D): the block computes D = rowsum(dout * out) of its own rows itself (no preprocess
// kernel; out is read once per row, dout's rows are L2-hot from the tile copy) and writes it to
// Dw for the dK/dV pass, which then runs after this pass. Else D comes from Dv (preprocess).
template <int HD, int NWG, int BN, int MINB, bool FD, bool RA>
__device__ __forceinline__ void flash_bwd_dq_v3(bf16* dqkv, float* Dw, const bf16* qkv, const bf16* dout,
                                                const bf16* out, const float* lse, const float* Dv, int T, int NH,
                                                float scale) {
    constexpr int BM = 64 * NWG, NT = 128 * NWG;
    constexpr int Q_BYTES = BM * HD * 2, KV_BYTES = BN * HD * 2;
    constexpr int NS = BN / 8;
    // hd 64: dQ's wgmma group runs on into the next tile (3 stages; needs the 255-register budget)
    constexpr bool OVL = HD == 64;
    static_assert(!OVL || NWG * MINB <= 2, "hd 64 runs the 3-stage overlapped loop (ops/attention.py sizes smem so)");
    constexpr int ST = OVL ? 3 : 2;               // K/V ring stages
    extern __shared__ unsigned char smem_v3[];
    const u32 raw = smem_u32_asm(smem_v3);
    const u32 sQ = (raw + 1023u) & ~1023u;
    const u32 sO = sQ + Q_BYTES;                  // dout
    const u32 sK = sO + Q_BYTES;                  // ST stages
    const u32 sV = sK + ST * KV_BYTES;            // ST stages

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wg = warp >> 2, w4 = warp & 3, g = lane >> 2, t4 = lane & 3;
    int bh, rank;
    v3_block_order(bh, rank);
    const int b = bh / NH, h = bh % NH;
    const int m0 = (gridDim.y - 1 - rank) * BM;              // heaviest tiles first
    const int C = NH * HD, stride = 3 * C;
    const bf16* q_g = qkv + (size_t)b * T * stride + h * HD;
    const bf16* k_g = q_g + C;
    const bf16* v_g = q_g + 2 * C;
    const bf16* do_g = dout + (size_t)b * T * C + h * HD;
    const int n_tiles = ceil_div(min(T, m0 + BM), BN);

    v3_load_tile<BM, HD, NT>(sQ, q_g, m0, T, stride);
    v3_load_tile<BM, HD, NT>(sO, do_g, m0, T, C);
    v3_load_tile<BN, HD, NT>(sK, k_g, 0, T, stride);
    v3_load_tile<BN, HD, NT>(sV, v_g, 0, T, stride);
    cp_async_commit();

    const int wm0 = m0 + 64 * wg;                 // this warpgroup's first row
    const int row0 = wm0 + 16 * w4 + g, row1 = row0 + 8;
    const float sl2 = scale * FA_LOG2E;
    // Rows >= T: zero Q / dout rows, lse = D = 0: P = 1 or 0, dP = 0, dS finite; never stored.
    const float nl0 = row0 < T ? -lse[(size_t)bh * T + row0] * FA_LOG2E : 0.f;
    const float nl1 = row1 < T ? -lse[(size_t)bh * T + row1] * FA_LOG2E : 0.f;
    float D0, D1;
    if constexpr (FD) {
        // The 4 threads of a row pair (t4 = 0..3) each sum HD/4 columns of both rows, then reduce
        // over t4 with two shuffles (fixed order: deterministic). Outside any branch: full-warp
        // shuffles; rows >= T contribute 0 (and D = 0 as in the non-fused path).
        D0 = v3_row_dot<HD / 4>(out, dout, (size_t)b * T * C + (size_t)row0 * C + h * HD + t4 * (HD / 4), row0 < T);
        D1 = v3_row_dot<HD / 4>(out, dout, (size_t)b * T * C + (size_t)row1 * C + h * HD + t4 * (HD / 4), row1 < T);
        D0 += __shfl_xor_sync(0xffffffffu, D0, 1);
        D1 += __shfl_xor_sync(0xffffffffu, D1, 1);
        D0 += __shfl_xor_sync(0xffffffffu, D0, 2);
        D1 += __shfl_xor_sync(0xffffffffu, D1, 2);
        if (t4 == 0 && row0 < T) Dw[(size_t)bh * T + row0] = D0;
        if (t4 == 0 && row1 < T) Dw[(size_t)bh * T + row1] = D1;
    } else {
        D0 = row0 < T ? Dv[(size_t)bh * T + row0] : 0.f;
        D1 = row1 < T ? Dv[(size_t)bh * T + row1] : 0.f;
    }
    float dq[HD / 2], s[BN / 2], dp[BN / 2];
    #pragma unroll
    for (int e = 0; e < HD / 2; e++) dq[e] = 0.f;
    #pragma unroll
    for (int e = 0; e < BN / 2; e++) s[e] = dp[e] = 0.f;
    wg_fence_regs<HD / 2>(dq);
    static_assert(!RA || BN == 64, "register-A products are m64n64");
    [[maybe_unused]] u32 qa[RA ? HD / 16 : 1][4], oa[RA ? HD / 16 : 1][4];
    if constexpr (RA) {                           // this warpgroup's Q and dout rows, once per block
        cp_async_wait<0>();
        __syncthreads();
        v3_tile_frags<BM, HD>(qa, smem_v3 + (sQ - raw), 64 * wg + 16 * w4 + g, t4);
        v3_tile_frags<BM, HD>(oa, smem_v3 + (sO - raw), 64 * wg + 16 * w4 + g, t4);
    }

    for (int j = 0; j < n_tiles; j++) {
        const int buf = j % ST, nxt = (j + 1) % ST;
        cp_async_wait<0>();                       // tile j landed (this thread's copies)
        fence_proxy_async();
        __syncthreads();                          // everyone's; tile j+1-ST's wgmma all retired
        if (j + 1 < n_tiles) {
            v3_load_tile<BN, HD, NT>(sK + nxt * KV_BYTES, k_g, (j + 1) * BN, T, stride);
            v3_load_tile<BN, HD, NT>(sV + nxt * KV_BYTES, v_g, (j + 1) * BN, T, stride);
        }
        cp_async_commit();
        const int n0 = j * BN;
        if (wm0 < T && n0 <= wm0 + 63) {          // warpgroup-uniform: some key <= some row
            const u32 k_s = sK + buf * KV_BYTES, v_s = sV + buf * KV_BYTES;
            wg_fence_regs<BN / 2>(s);
            wg_fence_regs<BN / 2>(dp);
            wgmma_fence();
            if constexpr (RA) v3_product_rk<HD>(s, qa, k_s);        // S = Q K^T
            else v3_product_kk<BN, HD>(s, sQ + wg * 8192, BM, k_s);
            wgmma_commit();
            if constexpr (RA) v3_product_rk<HD>(dp, oa, v_s);       // dP = dO V^T
            else v3_product_kk<BN, HD>(dp, sO + wg * 8192, BM, v_s);
            wgmma_commit();
            wgmma_wait<1>();                      // S (and the previous tile's dQ) retired
            wg_fence_regs<BN / 2>(s);
            // P = exp(S * scale - lse), 0 where key > row
            const bool mask = n0 + BN - 1 > wm0;
            #pragma unroll
            for (int jj = 0; jj < NS; jj++) {
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    float p = fast_exp2(fmaf(s[4 * jj + e], sl2, e < 2 ? nl0 : nl1));
                    if (mask && n0 + 8 * jj + 2 * t4 + (e & 1) > (e < 2 ? row0 : row1)) p = 0.f;
                    s[4 * jj + e] = p;
                }
            }
            wgmma_wait<0>();
            wg_fence_regs<BN / 2>(dp);
            #pragma unroll
            for (int jj = 0; jj < NS; jj++) {
                s[4 * jj + 0] *= dp[4 * jj + 0] - D0;
                s[4 * jj + 1] *= dp[4 * jj + 1] - D0;
                s[4 * jj + 2] *= dp[4 * jj + 2] - D1;
                s[4 * jj + 3] *= dp[4 * jj + 3] - D1;
            }
            u32 sa[BN / 16][4];
            v3_to_frags<BN>(sa, s);
            v3_product_rs<BN, HD>(dq, sa, k_s);                    // dQ += dS K
            wgmma_commit();
            if constexpr (!OVL) {                 // else: retired after the next S
                wgmma_wait<0>();
                wg_fence_regs<HD / 2>(dq);
            }
        } else {
            wgmma_wait<0>();
        }
    }
    wgmma_wait<0>();
    wg_fence_regs<HD / 2>(dq);
    cp_async_wait<0>();
    v3_store_acc<HD>(dqkv + (size_t)b * T * stride + h * HD, dq, scale, row0, T, stride, t4);
}

#define V3_DKDV_BODY(HD, NWG, BM, MINB, RA) \
    flash_bwd_dkdv_v3<HD, NWG, BM, MINB, RA>(dqkv, qkv, dout, lse, D, T, NH, scale)
#define V3_DQ_BODY(HD, NWG, BN, MINB, RA) \
    flash_bwd_dq_v3<HD, NWG, BN, MINB, false, RA>(dqkv, nullptr, qkv, dout, nullptr, lse, D, T, NH, scale)
#define V3_DQF_BODY(HD, NWG, BN, MINB) \
    flash_bwd_dq_v3<HD, NWG, BN, MINB, true, false>(dqkv, D, qkv, dout, out, lse, nullptr, T, NH, scale)
#else
#define V3_DKDV_BODY(HD, NWG, BM, MINB, RA) __trap()    // not sm_90a: Python never launches this
#define V3_DQ_BODY(HD, NWG, BN, MINB, RA) __trap()
#define V3_DQF_BODY(HD, NWG, BN, MINB) __trap()
#endif

// Configurations; kernel names carry them; gpucore/ops/attention.py launches the
// default per HD (V3_DKDV_CONFIG / V3_DQ_CONFIG); gpucore/ladder/attention.py lists them all. NWG warpgroups = 128 * NWG threads.
//   dkdv (HD, NWG, BM): KV tile 64 * NWG keys, Q tiles of BM rows, ST stages (3 at hd 64, else 2);
//        smem = 1024 + (2 * 64 * NWG + 2 * ST * BM) * HD * 2 + 8 * ST * BM bytes
//   dq   (HD, NWG, BN): Q tile 64 * NWG rows, KV tiles of BN keys, ST stages;
//        smem = 1024 + (2 * 64 * NWG + 2 * ST * BN) * HD * 2 bytes
// MINB = __launch_bounds__' minimum blocks per SM: 2 / NWG keeps 255 registers allowed. (dq hd64
// G2 BN64 at MINB 2 fit 128 registers before the overlapped loop; with it, it spills 8 bytes.)
// The _RA macros instantiate the register-A variants (kernel names end in _ra_bf16; a third config
// element V3_RA = 2 in ops/attention.py): K/V (dK/dV pass) or Q/dout (dQ pass) fragments held in registers.
#define FLASH_V3_DKDV_(HD, NWG, BM, MINB, RA, SUF)                                                   \
    extern "C" __global__ void __launch_bounds__(128 * NWG, MINB)                               \
    attention_backward_dkdv_kernel_v3_hd##HD##_g##NWG##_m##BM##SUF##_bf16(bf16* dqkv,          \
            const bf16* qkv, const bf16* dout, const float* lse, const float* D,               \
            int T, int NH, float scale) {                                                      \
        V3_DKDV_BODY(HD, NWG, BM, MINB, RA);                                                         \
    }
#define FLASH_V3_DQ_(HD, NWG, BN, MINB, RA, SUF)                                                     \
    extern "C" __global__ void __launch_bounds__(128 * NWG, MINB)                               \
    attention_backward_dq_kernel_v3_hd##HD##_g##NWG##_n##BN##SUF##_bf16(bf16* dqkv,            \
            const bf16* qkv, const bf16* dout, const float* lse, const float* D,               \
            int T, int NH, float scale) {                                                      \
        V3_DQ_BODY(HD, NWG, BN, MINB, RA);                                                           \
    }
#define FLASH_V3_DKDV(HD, NWG, BM, MINB) FLASH_V3_DKDV_(HD, NWG, BM, MINB, false, )
#define FLASH_V3_DKDV_RA(HD, NWG, BM, MINB) FLASH_V3_DKDV_(HD, NWG, BM, MINB, true, _ra)
#define FLASH_V3_DQ(HD, NWG, BN, MINB) FLASH_V3_DQ_(HD, NWG, BN, MINB, false, )
#define FLASH_V3_DQ_RA(HD, NWG, BN, MINB) FLASH_V3_DQ_(HD, NWG, BN, MINB, true, _ra)

// dq with fused D (a ladder rung: gpucore/ladder/attention.py, dq config (NWG, BN, V3_FD = 1)): writes D (B, NH, T) as well, so
// the preprocess kernel is gone and the dK/dV pass runs after this one.
#define FLASH_V3_DQF(HD, NWG, BN, MINB)                                                              \
    extern "C" __global__ void __launch_bounds__(128 * NWG, MINB)                               \
    attention_backward_dq_kernel_v3_hd##HD##_g##NWG##_n##BN##_fd_bf16(bf16* dqkv, float* D,    \
            const bf16* qkv, const bf16* dout, const bf16* out, const float* lse,              \
            int T, int NH, float scale) {                                                      \
        V3_DQF_BODY(HD, NWG, BN, MINB);                                                              \
    }

FLASH_V3_DKDV(64, 2, 64, 1)
FLASH_V3_DKDV(64, 1, 64, 2)
FLASH_V3_DKDV_RA(64, 2, 64, 1)
FLASH_V3_DKDV_RA(64, 1, 64, 2)
FLASH_V3_DKDV(128, 2, 64, 1)
FLASH_V3_DQ(64, 2, 64, 1)
FLASH_V3_DQ(64, 1, 64, 2)
FLASH_V3_DQ(64, 2, 128, 1)
FLASH_V3_DQ_RA(64, 2, 64, 1)
FLASH_V3_DQ_RA(64, 1, 64, 2)
FLASH_V3_DQ(128, 2, 64, 1)
FLASH_V3_DQ(128, 1, 64, 2)
FLASH_V3_DQF(64, 2, 128, 1)
FLASH_V3_DQF(64, 2, 64, 1)
FLASH_V3_DQF(128, 2, 64, 1)
