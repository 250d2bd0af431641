/*
 * attention/flash_fwd.cu -- causal multi-head attention forward, FlashAttention-2 style (v2).
 *
 * Op: GPT-2's attention over the fused qkv activation, without ever storing
 * the (T, T) attention matrix.
 *   qkv (B, T, 3C) bf16: q = qkv[..., :C], k = qkv[..., C:2C], v = qkv[..., 2C:3C];
 *   head h is columns h*HD .. (h+1)*HD of each, C = NH * HD, HD in {64, 128}.
 *   s_ij = scale * q_i . k_j   (scale = 1/sqrt(HD)), causal: only j <= i
 *   out_i = sum_j softmax_j(s_i.) v_j                 out (B, T, C) bf16
 *   lse_i = log sum_{j<=i} exp(s_ij)                  lse (B, NH, T) float32
 * lse is all the backward (attention/flash_bwd.cu) needs to recompute P = exp(s - lse).
 * No gradients here (see the backward file: dqkv is written, [=]).
 *
 * Algorithm (FlashAttention-2, Dao 2023): one block per (Q tile of BM = 16 * MT * NWARPS
 * rows, head); each warp owns 16 * MT query rows and keeps them in registers as mma A
 * fragments. K/V tiles of BN keys stream through shared memory (cp.async,
 * double-buffered: tile j+1 loads while tile j is used). Per tile, per warp:
 *   S = Q K^T (mma, f32) -> causal mask on the diagonal -> online softmax in the
 *   log2 domain (running max m and sum l per row; O rescaled by 2^(m_old - m_new))
 *   -> O += P V with P re-packed from the S accumulators as bf16 A fragments.
 * At the end O /= l, lse = (m + log2 l) * ln 2.
 * Causality: the block only visits KV tiles up to its last query row, and a warp
 * skips (warp-uniform branch, no barrier inside) tiles entirely after its rows.
 * Every valid row i sees key 0 <= i in its first tile, so its max is finite
 * from then on; a -inf max is still guarded (no inf - inf). Rows and keys >= T
 * are zero-filled in smem (finite garbage, never NaN), masked keys are -inf,
 * and stores skip rows >= T.
 * Q tiles are launched heaviest (last) first to shorten the causal tail.
 * Numerics: bf16 inputs, f32 accumulation and softmax statistics; P is rounded
 * to bf16 for the P.V mma (as in FlashAttention-2); out is rounded once.
 */
#include "attention/flash.cuh"

template <int HD, int NWARPS, int MT, int BN>
__device__ __forceinline__ void flash_forward(bf16* out,          // (B, T, C)
                                              float* lse,         // (B, NH, T)
                                              const bf16* qkv,    // (B, T, 3C)
                                              int T, int NH, float scale) {
    constexpr int WM = 16 * MT;            // query rows per warp: MT m16 tiles share each K/V fragment
    constexpr int BM = WM * NWARPS, NT = 32 * NWARPS, LDS = HD + 8;
    constexpr int KT = HD / 16;    // 16-wide k slabs of the head dim (S = Q K^T)
    constexpr int NS = BN / 8;     // 8-wide key tiles of S
    constexpr int ND = HD / 8;     // 8-wide column tiles of O
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* sQ = reinterpret_cast<bf16*>(smem);     // (BM, LDS); later: staging of O
    bf16* sK = sQ + BM * LDS;                     // 2 x (BN, LDS)
    bf16* sV = sK + 2 * BN * LDS;                 // 2 x (BN, LDS)

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int m0 = (gridDim.y - 1 - blockIdx.y) * BM;        // heaviest tiles first
    const int C = NH * HD, stride = 3 * C;
    const bf16* q_g = qkv + (size_t)b * T * stride + h * HD;
    const bf16* k_g = q_g + C;
    const bf16* v_g = q_g + 2 * C;
    const int n_tiles = ceil_div(min(T, m0 + BM), BN);       // KV tiles with a key <= last row

    load_tile_async<BM, HD, NT>(sQ, q_g, m0, T, stride);
    cp_async_commit();                                        // group: Q
    load_tile_async<BN, HD, NT>(sK, k_g, 0, T, stride);
    load_tile_async<BN, HD, NT>(sV, v_g, 0, T, stride);
    cp_async_commit();                                        // group: KV tile 0

    const int wm0 = m0 + WM * warp;                           // this warp's first row
    const bool warp_active = wm0 < T;
    const float sl2 = scale * FA_LOG2E;                       // scores in log2 units

    cp_async_wait<1>();                                       // Q has landed
    __syncthreads();
    u32 qf[MT][KT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; mt++)
        #pragma unroll
        for (int kk = 0; kk < KT; kk++) ldsm_a<LDS>(qf[mt][kk], sQ, WM * warp + 16 * mt, kk * 16, lane);

    // Per m-tile mt, this thread owns rows wm0 + 16*mt + g (r = 0) and + 8 (r = 1).
    float o[MT][ND][4];
    float m_run[MT][2], l_run[MT][2];                         // running max (log2 units), sum
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        #pragma unroll
        for (int dt = 0; dt < ND; dt++) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
        m_run[mt][0] = m_run[mt][1] = FA_NEG_INF;
        l_run[mt][0] = l_run[mt][1] = 0.f;
    }

    for (int j = 0; j < n_tiles; j++) {
        const int buf = j & 1;
        if (j + 1 < n_tiles) {                                // prefetch tile j+1 into the other buffer
            load_tile_async<BN, HD, NT>(sK + (buf ^ 1) * BN * LDS, k_g, (j + 1) * BN, T, stride);
            load_tile_async<BN, HD, NT>(sV + (buf ^ 1) * BN * LDS, v_g, (j + 1) * BN, T, stride);
        }
        cp_async_commit();                                    // (maybe empty: keeps the count uniform)
        cp_async_wait<1>();                                   // tile j has landed
        __syncthreads();
        const int n0 = j * BN;
        if (warp_active && n0 <= wm0 + WM - 1) {              // some key of the tile <= some row of the warp
            const bf16* k_s = sK + buf * BN * LDS;
            const bf16* v_s = sV + buf * BN * LDS;
            float s[MT][NS][4];
            #pragma unroll
            for (int mt = 0; mt < MT; mt++)
                #pragma unroll
                for (int nt = 0; nt < NS; nt++) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
            #pragma unroll
            for (int kk = 0; kk < KT; kk++) {
                #pragma unroll
                for (int np = 0; np < NS / 2; np++) {
                    u32 kb[4];
                    ldsm_b<LDS>(kb, k_s, np * 16, kk * 16, lane);
                    #pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_bf16_16816(s[mt][2 * np], qf[mt][kk], kb[0], kb[1]);
                        mma_bf16_16816(s[mt][2 * np + 1], qf[mt][kk], kb[2], kb[3]);
                    }
                }
            }
            if (n0 + BN - 1 > wm0) {                          // the tile crosses the diagonal: mask j > i
                #pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    const int row0 = wm0 + 16 * mt + g, row1 = row0 + 8;
                    #pragma unroll
                    for (int nt = 0; nt < NS; nt++) {
                        #pragma unroll
                        for (int e = 0; e < 2; e++) {
                            const int key = n0 + nt * 8 + 2 * t4 + e;
                            if (key > row0) s[mt][nt][e] = FA_NEG_INF;
                            if (key > row1) s[mt][nt][2 + e] = FA_NEG_INF;
                        }
                    }
                }
            }
            // Online softmax. A row's scores live in the 4 lanes of a quad.
            #pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                #pragma unroll
                for (int r = 0; r < 2; r++) {
                    float mx = FA_NEG_INF;
                    #pragma unroll
                    for (int nt = 0; nt < NS; nt++) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float mn = fmaxf(m_run[mt][r], mx * sl2);
                    const float ref = mn == FA_NEG_INF ? 0.f : mn;   // all masked so far: avoid -inf - -inf
                    const float alpha = fast_exp2(m_run[mt][r] - ref);
                    m_run[mt][r] = mn;
                    float rs = 0.f;
                    #pragma unroll
                    for (int nt = 0; nt < NS; nt++) {
                        s[mt][nt][2 * r] = fast_exp2(fmaf(s[mt][nt][2 * r], sl2, -ref));
                        s[mt][nt][2 * r + 1] = fast_exp2(fmaf(s[mt][nt][2 * r + 1], sl2, -ref));
                        rs += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
                    }
                    l_run[mt][r] = l_run[mt][r] * alpha + rs;
                    #pragma unroll
                    for (int dt = 0; dt < ND; dt++) {
                        o[mt][dt][2 * r] *= alpha;
                        o[mt][dt][2 * r + 1] *= alpha;
                    }
                }
            }
            // O += P V: P (WM x BN) from registers, V (BN x HD) via ldmatrix.trans.
            #pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                u32 pa[MT][4];
                #pragma unroll
                for (int mt = 0; mt < MT; mt++) frag_a_from_acc(pa[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
                #pragma unroll
                for (int dp = 0; dp < HD / 16; dp++) {
                    u32 vb[4];
                    ldsm_b_trans<LDS>(vb, v_s, kk * 16, dp * 16, lane);
                    #pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_bf16_16816(o[mt][2 * dp], pa[mt], vb[0], vb[1]);
                        mma_bf16_16816(o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
                    }
                }
            }
        }
        __syncthreads();                                      // buffer `buf` is refilled next iteration
    }

    // Epilogue: full row sums across the quad, normalise, stage O in this warp's
    // own rows of sQ (no other warp reads them), then coalesced 16-byte stores.
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        float inv[2];
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            float l = l_run[mt][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            inv[r] = l > 0.f ? 1.f / l : 0.f;
            const int row = wm0 + 16 * mt + g + 8 * r;
            if (t4 == 0 && row < T) lse[(size_t)bh * T + row] = (m_run[mt][r] + log2f(l)) * FA_LN2;
        }
        bf16* so = sQ + (WM * warp + 16 * mt) * LDS;
        stage_acc_bf16<HD, LDS>(so, o[mt], inv[0], inv[1], lane);
        __syncwarp();
        store_rows16<HD, LDS>(out + (size_t)b * T * C + h * HD, so, wm0 + 16 * mt, T, C, lane);
    }
}

// Configurations: (HD, warps per block, m16 tiles per warp, keys per KV tile); kernel
// names carry them (..._hd64_w8_mt1_n64_bf16). gpucore/ops/attention.py launches the
// default of each HD (V2_FWD_CONFIG); gpucore/ladder/attention.py lists them all (V2_FWD_CONFIGS); `gpucore bench attention --opt
// sweep=1` times all. MT = 2 (FlashAttention-2's hd 64 choice: 4 warps x 32 rows) reuses
// every K/V fragment read from smem for two mma, halving smem traffic per mma.
// Dynamic shared memory = (16 * MT * NWARPS + 4 * BN) * (HD + 8) * 2 bytes.
#define FLASH_FWD(HD, NWARPS, MT, BN)                                                           \
    extern "C" __global__ void __launch_bounds__(32 * NWARPS)                                   \
    attention_forward_kernel_v2_hd##HD##_w##NWARPS##_mt##MT##_n##BN##_bf16(                     \
            bf16* out, float* lse, const bf16* qkv, int T, int NH, float scale) {               \
        flash_forward<HD, NWARPS, MT, BN>(out, lse, qkv, T, NH, scale);                         \
    }

FLASH_FWD(64, 8, 1, 64)
FLASH_FWD(64, 4, 2, 64)
FLASH_FWD(64, 4, 1, 64)
FLASH_FWD(64, 8, 1, 128)
FLASH_FWD(128, 8, 1, 64)
FLASH_FWD(128, 4, 1, 64)
FLASH_FWD(128, 8, 1, 32)
