/*
 * ladder/attention/flash_v3_fwd_serial.cu -- causal multi-head attention forward on Hopper's wgmma (v3, sm_90a).
 *
 * Op (same as attention/flash_fwd.cu, v2; outputs bit-layout compatible so v2's backward runs on them):
 *   qkv (B, T, 3C) bf16: q = qkv[..., :C], k = qkv[..., C:2C], v = qkv[..., 2C:3C];
 *   head h is columns h*HD .. (h+1)*HD of each, C = NH * HD, HD in {64, 128}.
 *   s_ij = scale * q_i . k_j, causal j <= i;  out_i = softmax(s_i.) V   out (B, T, C) bf16
 *   lse_i = log sum_{j<=i} exp(s_ij)                                   lse (B, NH, T) f32
 * No gradients here (the backward is v2's attention/flash_bwd.cu, or a v3 backward).
 * Needs an sm_90 GPU: compiled for sm_90a (gpucore/ladder/attention.py loads it with arch "90a");
 * compiled for anything else (kernels check --arch 80/90) the kernels trap.
 *
 * Algorithm (FlashAttention-3 without the warp-specialised producer, Shah et al. 2024):
 * one block per (Q tile of BM = 64 * NWG rows, head), NWG consumer warpgroups of 128
 * threads, warpgroup w owns query rows 64w..64w+63 of the tile. All threads copy
 * (cp.async.cg, 16 B) into 128B-swizzled shared memory (layout and descriptors in
 * wgmma.cuh): Q once, then K/V tiles of BN keys double-buffered (tile j+1 copies while
 * tile j computes). Per KV tile, per warpgroup:
 *   S (64 x BN, f32 regs) = Q K^T         HD/16 x wgmma.m64nBNk16, A = Q, B = K, both from
 *                                         smem, K-major (K stored (BN, HD) row-major = B^T)
 *   causal mask (only tiles crossing this warpgroup's diagonal), online softmax in log2 units
 *   exactly as v2 (a row's 2*BN/8 values live in the 4 lanes of a quad: same fragment as
 *   mma.sync's C, see wgmma.cuh), O rescaled by 2^(m_old - m_new)
 *   P -> bf16 A fragments in registers (accumulator n8 blocks 2k, 2k+1 = A fragment of k-step k)
 *   O (64 x HD, f32 regs) += P V           BN/16 x wgmma.m64nHDk16, A from registers,
 *                                         B = V (BN, HD) row-major = MN-major, imm-trans-b 1
 * wgmma ordering per batch: wgmma_fence (registers written by ordinary code since the last
 * wgmma) -> wgmma x n -> commit -> wait<0> -> wg_fence_regs (reads stay after the wait).
 * Overlap comes from the other warpgroup / block on the SM (no intra-warpgroup pipelining).
 * Barriers: iteration j: cp.async.wait_group 0 (tile j, this thread's copies) ->
 * fence.proxy.async (generic-proxy writes -> visible to wgmma's async proxy) ->
 * __syncthreads (everyone's copies landed; every warpgroup has retired its tile j-1 wgmma,
 * so buffer (j+1)&1 is free) -> copy tile j+1 -> compute tile j.
 * Causality: the block visits KV tiles with a key <= its last row; a warpgroup skips tiles
 * entirely after its rows (warpgroup-uniform branch: wgmma is warpgroup-collective; no
 * barrier inside). Rows/keys >= T are zero-filled (finite, never NaN), masked keys -inf,
 * stores skip rows >= T. Q tiles launched heaviest first.
 * Epilogue: O / l, rounded to bf16, staged in the warp's own (swizzled) Q rows, written
 * with 16-byte coalesced stores; lse = (m + log2 l) ln 2.
 * Numerics: as v2 (f32 accumulation and statistics, P rounded to bf16, ex2.approx).
 */
#include "attention/flash.cuh"   // FA_LOG2E, FA_LN2, FA_NEG_INF, fast_exp2, pack_bf16x2_rn
#include "wgmma.cuh"
#include "attention/flash_v3.cuh"   // v3_off, v3_load_tile, v3_to_frags, v3_mma_ss/rs

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <int HD, int NWG, int BN>
__device__ __forceinline__ void flash_forward_v3(bf16* out,          // (B, T, C)
                                                 float* lse,         // (B, NH, T)
                                                 const bf16* qkv,    // (B, T, 3C)
                                                 int T, int NH, float scale) {
    constexpr int BM = 64 * NWG, NT = 128 * NWG;
    constexpr int NS = BN / 8;                 // n8 blocks of S per thread row pair
    constexpr int ND = HD / 8;                 // n8 blocks of O
    constexpr u32 Q_BYTES = BM * HD * 2, KV_BYTES = BN * HD * 2;
    extern __shared__ unsigned char smem_v3[];
    const u32 sQ = (smem_u32_asm(smem_v3) + 1023u) & ~1023u;  // swizzle atoms: 1024-byte aligned
    const u32 sK = sQ + Q_BYTES;                               // 2 x KV_BYTES
    const u32 sV = sK + 2 * KV_BYTES;                          // 2 x KV_BYTES
    unsigned char* const smem_gen = smem_v3 + (sQ - smem_u32_asm(smem_v3));  // generic pointer to sQ

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, w4 = warp & 3;
    const int g = lane >> 2, t4 = lane & 3;
    int bh, rank;
    v3_block_order(bh, rank);
    const int b = bh / NH, h = bh % NH;
    const int m0 = (gridDim.y - 1 - rank) * BM;                 // heaviest tiles first
    const int C = NH * HD, stride = 3 * C;
    const bf16* q_g = qkv + (size_t)b * T * stride + h * HD;
    const bf16* k_g = q_g + C;
    const bf16* v_g = q_g + 2 * C;
    const int n_tiles = ceil_div(min(T, m0 + BM), BN);         // KV tiles with a key <= last row

    v3_load_tile<BM, HD, NT>(sQ, q_g, m0, T, stride);
    v3_load_tile<BN, HD, NT>(sK, k_g, 0, T, stride);
    v3_load_tile<BN, HD, NT>(sV, v_g, 0, T, stride);
    cp_async_commit();                                         // group: Q + KV tile 0

    const int wm0 = m0 + 64 * wg;                              // this warpgroup's first row
    const bool wg_active = wm0 < T;
    const int row0 = wm0 + 16 * w4 + g;                        // this thread's rows: row0, row0 + 8
    const float sl2 = scale * FA_LOG2E;                        // scores in log2 units

    float s[BN / 2], o[HD / 2];
    #pragma unroll
    for (int i = 0; i < BN / 2; i++) s[i] = 0.f;
    #pragma unroll
    for (int i = 0; i < HD / 2; i++) o[i] = 0.f;
    float m_run[2] = {FA_NEG_INF, FA_NEG_INF}, l_run[2] = {0.f, 0.f};

    for (int j = 0; j < n_tiles; j++) {
        const int buf = j & 1;
        cp_async_wait<0>();                                    // tile j (and Q) landed: own copies
        fence_proxy_async();                                   // ... visible to wgmma (async proxy)
        __syncthreads();                                       // ... everyone's; buffer buf^1 retired
        if (j + 1 < n_tiles) {
            v3_load_tile<BN, HD, NT>(sK + (buf ^ 1) * KV_BYTES, k_g, (j + 1) * BN, T, stride);
            v3_load_tile<BN, HD, NT>(sV + (buf ^ 1) * KV_BYTES, v_g, (j + 1) * BN, T, stride);
        }
        cp_async_commit();
        const int n0 = j * BN;
        if (wg_active && n0 <= wm0 + 63) {                     // warpgroup-uniform
            const u32 kb = sK + buf * KV_BYTES, vb = sV + buf * KV_BYTES;
            // S = Q K^T. k-step ks: 16 head dims, inside 64-wide column block ks/4.
            wg_fence_regs<BN / 2>(s);
            wgmma_fence();
            #pragma unroll
            for (int ks = 0; ks < HD / 16; ks++) {
                const u64 da = smem_desc(sQ + (ks >> 2) * (BM * 128) + wg * (64 * 128) + (ks & 3) * 32, 16, 1024);
                const u64 db = smem_desc(kb + (ks >> 2) * (BN * 128) + (ks & 3) * 32, 16, 1024);
                v3_mma_ss<BN>(s, da, db, ks > 0);
            }
            wgmma_commit();
            wgmma_wait<0>();
            wg_fence_regs<BN / 2>(s);

            if (n0 + BN - 1 > wm0) {                           // crosses this warpgroup's diagonal
                #pragma unroll
                for (int nt = 0; nt < NS; nt++) {
                    #pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int key = n0 + nt * 8 + 2 * t4 + e;
                        if (key > row0) s[4 * nt + e] = FA_NEG_INF;
                        if (key > row0 + 8) s[4 * nt + 2 + e] = FA_NEG_INF;
                    }
                }
            }
            // Online softmax (v2's): row r of this thread = s[4 nt + 2 r + e].
            #pragma unroll
            for (int r = 0; r < 2; r++) {
                float rs;
                const float alpha = v3_softmax_row<BN>(s, m_run[r], sl2, r, rs);
                l_run[r] = l_run[r] * alpha + rs;
                #pragma unroll
                for (int dt = 0; dt < ND; dt++) {
                    o[4 * dt + 2 * r] *= alpha;
                    o[4 * dt + 2 * r + 1] *= alpha;
                }
            }
            // O += P V: P's k-step kk (keys 16kk..16kk+15) = S n8 blocks 2kk, 2kk+1 as bf16.
            u32 pa[BN / 16][4];
            v3_to_frags<BN>(pa, s);
            wg_fence_regs<HD / 2>(o);
            wgmma_fence();
            #pragma unroll
            for (int kk = 0; kk < BN / 16; kk++)                // V k-step: 16 key rows = 2048 B
                v3_mma_rs<HD>(o, pa[kk], smem_desc(vb + kk * 2048, BN * 128, 1024), 1);
            wgmma_commit();
            wgmma_wait<0>();
            wg_fence_regs<HD / 2>(o);
            #pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) wg_fence_regs<4>(pa[kk]);   // pa live until the wait
        }
    }
    cp_async_wait<0>();

    // Epilogue (attention/flash_v3.cuh, shared with v3p): quad sums, lse, O / l as bf16 into this
    // warp's own 16 Q rows (only this warpgroup's wgmma read them, all retired), coalesced stores.
    v3_fwd_epilogue<HD, BM>(out, lse, o, m_run, l_run, wg_active, smem_gen, row0, bh, b, h, T, C, m0, wg, w4, lane);
}

#define FLASH_V3_BODY(HD, NWG, BN) flash_forward_v3<HD, NWG, BN>(out, lse, qkv, T, NH, scale)
#else
#define FLASH_V3_BODY(HD, NWG, BN) __trap()          // not sm_90a: Python never launches this
#endif

// Configurations (HD, consumer warpgroups, keys per KV tile); names carry them
// (attention_forward_kernel_v3_hd64_g2_n128_bf16). gpucore/ladder/attention.py lists the
// same (V3_SERIAL_FWD_CONFIGS). Dynamic shared memory =
// 1024 (alignment) + (64 * NWG + 4 * BN) * HD * 2 bytes. MINB (blocks per SM for
// __launch_bounds__, not in the name): 2 caps registers at 128 so two blocks (4 warpgroups)
// share an SM and one's softmax overlaps the other's wgmma.
#define FLASH_FWD_V3(HD, NWG, BN, MINB)                                                         \
    extern "C" __global__ void __launch_bounds__(128 * NWG, MINB)                               \
    attention_forward_kernel_v3_hd##HD##_g##NWG##_n##BN##_bf16(                                 \
            bf16* out, float* lse, const bf16* qkv, int T, int NH, float scale) {               \
        FLASH_V3_BODY(HD, NWG, BN);                                                             \
    }

FLASH_FWD_V3(64, 2, 64, 2)
FLASH_FWD_V3(64, 2, 128, 1)
FLASH_FWD_V3(64, 1, 128, 2)
FLASH_FWD_V3(128, 2, 64, 1)
FLASH_FWD_V3(128, 2, 128, 1)
