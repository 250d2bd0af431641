/*
 * attention/flash_bwd.cu -- causal multi-head attention backward, FlashAttention-2 style (v2).
 *
 * Op: gradient of attention/flash_fwd.cu's forward. With s_ij = scale * q_i . k_j,
 * P_ij = exp(s_ij - lse_i) (j <= i, else 0), out_i = sum_j P_ij v_j:
 *   D_i   = sum_d dout_id * out_id                      (= sum_j P_ij dP_ij)
 *   dP_ij = dout_i . v_j
 *   dS_ij = P_ij (dP_ij - D_i)
 *   dv_j  = sum_i P_ij dout_i
 *   dk_j  = scale * sum_i dS_ij q_i
 *   dq_i  = scale * sum_j dS_ij k_j
 * Shapes: qkv (B, T, 3C) bf16, out and dout (B, T, C) bf16, lse and D (B, NH, T) f32,
 * dqkv (B, T, 3C) bf16 in qkv's layout. dqkv is an activation gradient: written [=],
 * every element of every row t < T exactly once.
 *
 * Three launches, all deterministic (no atomics: every output element is
 * produced by one thread in a fixed order):
 *   1. preprocess: D = rowsum(dout * out) (one 16-byte chunk per lane).
 *   2. dkdv: one block per (KV tile of BN = 16 * NWARPS keys, head); each warp owns
 *      16 keys and accumulates their dK, dV (16 x HD each) in registers while the
 *      block streams the Q tiles at or after its keys (Q, dout, lse, D: cp.async,
 *      double-buffered). Per Q tile the warp computes the transposed problem:
 *        S^T = K Q^T, P^T = exp2(S^T * scale*log2e - lse*log2e), dV += P^T dO,
 *        dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q.
 *   3. dq: one block per (Q tile of BM = 16 * NWARPS rows, head); each warp owns 16
 *      rows and streams the KV tiles up to its diagonal:
 *        S = Q K^T, P, dP = dO V^T, dS = P (dP - D), dQ += dS K.
 * That recomputes S and dP twice (7 matmuls of the tile size instead of
 * FlashAttention-2's 5 with atomic dQ), the price of bitwise determinism.
 * Masking: keys > query get P = 0 (assigned, not multiplied, so an overflowing
 * exp2 never turns into NaN); queries >= T get P = 0 too; rows/keys >= T are
 * zero-filled in smem and never stored. Operands whose A fragments are reused
 * (K, V, Q, dO) are re-read from smem per 16-wide k slab rather than kept in
 * registers, so the HD = 128 variants fit without spilling.
 */
#include "attention/flash.cuh"

// D[b, h, t] = sum_d dout[b, t, h*HD + d] * out[b, t, h*HD + d]; HD / 8 lanes per (b, t, h).
template <int HD>
__device__ __forceinline__ void flash_bwd_preprocess(float* D,            // (B, NH, T)
                                                     const bf16* dout,    // (B, T, C)
                                                     const bf16* out,     // (B, T, C)
                                                     int rows, int T, int NH) {
    constexpr int G = HD / 8;
    const int gid = blockIdx.x * blockDim.x + threadIdx.x;
    const int row = gid / G, c = gid % G;                     // row = (b*T + t)*NH + h
    float acc = 0.f;
    if (row < rows) {
        const Pack16<bf16> a = load16(dout + (size_t)row * HD + c * 8);
        const Pack16<bf16> o = load16(out + (size_t)row * HD + c * 8);
        #pragma unroll
        for (int k = 0; k < 8; k++) acc += to_float(a.v[k]) * to_float(o.v[k]);
    }
    #pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (row < rows && c == 0) {
        const int h = row % NH, bt = row / NH;
        D[((size_t)(bt / T) * NH + h) * T + bt % T] = acc;
    }
}

template <int HD, int NWARPS, int BM>
__device__ __forceinline__ void flash_bwd_dkdv(bf16* dqkv,          // (B, T, 3C)
                                               const bf16* qkv,     // (B, T, 3C)
                                               const bf16* dout,    // (B, T, C)
                                               const float* lse,    // (B, NH, T)
                                               const float* Dv,     // (B, NH, T)
                                               int T, int NH, float scale) {
    constexpr int BN = 16 * NWARPS, NT = 32 * NWARPS, LDS = HD + 8;
    constexpr int KT = HD / 16, NQ = BM / 8, ND = HD / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* sK = reinterpret_cast<bf16*>(smem);     // (BN, LDS); later: staging of dK
    bf16* sV = sK + BN * LDS;                     // (BN, LDS); later: staging of dV
    bf16* sQ = sV + BN * LDS;                     // 2 x (BM, LDS)
    bf16* sO = sQ + 2 * BM * LDS;                 // 2 x (BM, LDS): dout
    float* sL = reinterpret_cast<float*>(sO + 2 * BM * LDS);   // 2 x (BM,): lse
    float* sD = sL + 2 * BM;                                   // 2 x (BM,): D

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int n0 = blockIdx.y * BN;               // tile 0 has the most Q tiles: launched first
    const int C = NH * HD, stride = 3 * C;
    const bf16* q_g = qkv + (size_t)b * T * stride + h * HD;
    const bf16* k_g = q_g + C;
    const bf16* v_g = q_g + 2 * C;
    const bf16* do_g = dout + (size_t)b * T * C + h * HD;
    const float* l_g = lse + (size_t)bh * T;
    const float* d_g = Dv + (size_t)bh * T;
    const int i_first = n0 / BM, i_end = ceil_div(T, BM);    // Q tiles with a row >= n0

    load_tile_async<BN, HD, NT>(sK, k_g, n0, T, stride);
    load_tile_async<BN, HD, NT>(sV, v_g, n0, T, stride);
    load_tile_async<BM, HD, NT>(sQ, q_g, i_first * BM, T, stride);
    load_tile_async<BM, HD, NT>(sO, do_g, i_first * BM, T, C);
    load_vec_async<BM, NT>(sL, l_g, i_first * BM, T);
    load_vec_async<BM, NT>(sD, d_g, i_first * BM, T);
    cp_async_commit();

    const int wk0 = n0 + 16 * warp;               // this warp's first key
    const int key0 = wk0 + g, key1 = wk0 + g + 8; // this thread's two keys (rows of S^T)
    const bool warp_active = wk0 < T;
    const float sl2 = scale * FA_LOG2E;
    float dk[ND][4], dv[ND][4];
    #pragma unroll
    for (int dt = 0; dt < ND; dt++)
        #pragma unroll
        for (int e = 0; e < 4; e++) dk[dt][e] = dv[dt][e] = 0.f;

    for (int i = i_first; i < i_end; i++) {
        const int buf = (i - i_first) & 1;
        if (i + 1 < i_end) {
            const int r = (i + 1) * BM;
            load_tile_async<BM, HD, NT>(sQ + (buf ^ 1) * BM * LDS, q_g, r, T, stride);
            load_tile_async<BM, HD, NT>(sO + (buf ^ 1) * BM * LDS, do_g, r, T, C);
            load_vec_async<BM, NT>(sL + (buf ^ 1) * BM, l_g, r, T);
            load_vec_async<BM, NT>(sD + (buf ^ 1) * BM, d_g, r, T);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const int m0 = i * BM;
        if (warp_active && m0 + BM - 1 >= wk0) {  // some query of the tile >= some key of the warp
            const bf16* q_s = sQ + buf * BM * LDS;
            const bf16* o_s = sO + buf * BM * LDS;
            const float* l_s = sL + buf * BM;
            const float* d_s = sD + buf * BM;
            // S^T = K Q^T  (16 keys x BM queries)
            float st[NQ][4];
            #pragma unroll
            for (int nt = 0; nt < NQ; nt++) st[nt][0] = st[nt][1] = st[nt][2] = st[nt][3] = 0.f;
            #pragma unroll 1                                // rolled: caps registers
            for (int kk = 0; kk < KT; kk++) {
                u32 ka[4];
                ldsm_a<LDS>(ka, sK, 16 * warp, kk * 16, lane);
                #pragma unroll
                for (int np = 0; np < NQ / 2; np++) {
                    u32 qb[4];
                    ldsm_b<LDS>(qb, q_s, np * 16, kk * 16, lane);
                    mma_bf16_16816(st[2 * np], ka, qb[0], qb[1]);
                    mma_bf16_16816(st[2 * np + 1], ka, qb[2], qb[3]);
                }
            }
            // P^T = exp(S^T * scale - lse[query]); 0 where key > query or query >= T.
            const bool mask = wk0 + 15 > m0 || m0 + BM > T;
            #pragma unroll
            for (int nt = 0; nt < NQ; nt++) {
                #pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int q = nt * 8 + 2 * t4 + e;
                    const float nl = -l_s[q] * FA_LOG2E;
                    float p0 = fast_exp2(fmaf(st[nt][e], sl2, nl));
                    float p1 = fast_exp2(fmaf(st[nt][2 + e], sl2, nl));
                    if (mask) {
                        const int qa = m0 + q;
                        if (key0 > qa || qa >= T) p0 = 0.f;
                        if (key1 > qa || qa >= T) p1 = 0.f;
                    }
                    st[nt][e] = p0;
                    st[nt][2 + e] = p1;
                }
            }
            // dV += P^T dO  (dO is [query][d] = [k][n]: ldmatrix.trans)
            #pragma unroll
            for (int kq = 0; kq < BM / 16; kq++) {
                u32 pa[4];
                frag_a_from_acc(pa, st[2 * kq], st[2 * kq + 1]);
                #pragma unroll
                for (int dp = 0; dp < HD / 16; dp++) {
                    u32 ob[4];
                    ldsm_b_trans<LDS>(ob, o_s, kq * 16, dp * 16, lane);
                    mma_bf16_16816(dv[2 * dp], pa, ob[0], ob[1]);
                    mma_bf16_16816(dv[2 * dp + 1], pa, ob[2], ob[3]);
                }
            }
            // dP^T = V dO^T  (16 keys x BM queries)
            float dpt[NQ][4];
            #pragma unroll
            for (int nt = 0; nt < NQ; nt++) dpt[nt][0] = dpt[nt][1] = dpt[nt][2] = dpt[nt][3] = 0.f;
            #pragma unroll 1
            for (int kk = 0; kk < KT; kk++) {
                u32 va[4];
                ldsm_a<LDS>(va, sV, 16 * warp, kk * 16, lane);
                #pragma unroll
                for (int np = 0; np < NQ / 2; np++) {
                    u32 ob[4];
                    ldsm_b<LDS>(ob, o_s, np * 16, kk * 16, lane);
                    mma_bf16_16816(dpt[2 * np], va, ob[0], ob[1]);
                    mma_bf16_16816(dpt[2 * np + 1], va, ob[2], ob[3]);
                }
            }
            // dS^T = P^T (dP^T - D[query]), in place of P^T
            #pragma unroll
            for (int nt = 0; nt < NQ; nt++) {
                #pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float dq = d_s[nt * 8 + 2 * t4 + e];
                    st[nt][e] *= dpt[nt][e] - dq;
                    st[nt][2 + e] *= dpt[nt][2 + e] - dq;
                }
            }
            // dK += dS^T Q  (Q is [query][d] = [k][n]: ldmatrix.trans)
            #pragma unroll
            for (int kq = 0; kq < BM / 16; kq++) {
                u32 sa[4];
                frag_a_from_acc(sa, st[2 * kq], st[2 * kq + 1]);
                #pragma unroll
                for (int dp = 0; dp < HD / 16; dp++) {
                    u32 qb[4];
                    ldsm_b_trans<LDS>(qb, q_s, kq * 16, dp * 16, lane);
                    mma_bf16_16816(dk[2 * dp], sa, qb[0], qb[1]);
                    mma_bf16_16816(dk[2 * dp + 1], sa, qb[2], qb[3]);
                }
            }
        }
        __syncthreads();
    }
    // Each warp stages its own 16 rows of sK / sV (only it ever read them) and stores.
    bf16* sdk = sK + 16 * warp * LDS;
    bf16* sdv = sV + 16 * warp * LDS;
    stage_acc_bf16<HD, LDS>(sdk, dk, scale, scale, lane);
    stage_acc_bf16<HD, LDS>(sdv, dv, 1.f, 1.f, lane);
    __syncwarp();
    bf16* dq_g = dqkv + (size_t)b * T * stride + h * HD;
    store_rows16<HD, LDS>(dq_g + C, sdk, wk0, T, stride, lane);
    store_rows16<HD, LDS>(dq_g + 2 * C, sdv, wk0, T, stride, lane);
}

template <int HD, int NWARPS, int BN>
__device__ __forceinline__ void flash_bwd_dq(bf16* dqkv,          // (B, T, 3C)
                                             const bf16* qkv,     // (B, T, 3C)
                                             const bf16* dout,    // (B, T, C)
                                             const float* lse,    // (B, NH, T)
                                             const float* Dv,     // (B, NH, T)
                                             int T, int NH, float scale) {
    constexpr int BM = 16 * NWARPS, NT = 32 * NWARPS, LDS = HD + 8;
    constexpr int KT = HD / 16, NS = BN / 8, ND = HD / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* sQ = reinterpret_cast<bf16*>(smem);     // (BM, LDS); later: staging of dQ
    bf16* sO = sQ + BM * LDS;                     // (BM, LDS): dout
    bf16* sK = sO + BM * LDS;                     // 2 x (BN, LDS)
    bf16* sV = sK + 2 * BN * LDS;                 // 2 x (BN, LDS)

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int m0 = (gridDim.y - 1 - blockIdx.y) * BM;        // heaviest tiles first
    const int C = NH * HD, stride = 3 * C;
    const bf16* q_g = qkv + (size_t)b * T * stride + h * HD;
    const bf16* k_g = q_g + C;
    const bf16* v_g = q_g + 2 * C;
    const bf16* do_g = dout + (size_t)b * T * C + h * HD;
    const int n_tiles = ceil_div(min(T, m0 + BM), BN);

    load_tile_async<BM, HD, NT>(sQ, q_g, m0, T, stride);
    load_tile_async<BM, HD, NT>(sO, do_g, m0, T, C);
    load_tile_async<BN, HD, NT>(sK, k_g, 0, T, stride);
    load_tile_async<BN, HD, NT>(sV, v_g, 0, T, stride);
    cp_async_commit();

    const int wm0 = m0 + 16 * warp;
    const int row0 = wm0 + g, row1 = wm0 + g + 8;
    const bool warp_active = wm0 < T;
    const float sl2 = scale * FA_LOG2E;
    // Rows >= T: lse = D = 0 with zero Q and dout rows gives P = 1, dP = 0, dS = 0: finite, never stored.
    const float nl0 = row0 < T ? -lse[(size_t)bh * T + row0] * FA_LOG2E : 0.f;
    const float nl1 = row1 < T ? -lse[(size_t)bh * T + row1] * FA_LOG2E : 0.f;
    const float D0 = row0 < T ? Dv[(size_t)bh * T + row0] : 0.f;
    const float D1 = row1 < T ? Dv[(size_t)bh * T + row1] : 0.f;
    float dq[ND][4];
    #pragma unroll
    for (int dt = 0; dt < ND; dt++) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.f;

    for (int j = 0; j < n_tiles; j++) {
        const int buf = j & 1;
        if (j + 1 < n_tiles) {
            load_tile_async<BN, HD, NT>(sK + (buf ^ 1) * BN * LDS, k_g, (j + 1) * BN, T, stride);
            load_tile_async<BN, HD, NT>(sV + (buf ^ 1) * BN * LDS, v_g, (j + 1) * BN, T, stride);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const int n0 = j * BN;
        if (warp_active && n0 <= wm0 + 15) {
            const bf16* k_s = sK + buf * BN * LDS;
            const bf16* v_s = sV + buf * BN * LDS;
            // S = Q K^T and dP = dO V^T  (16 rows x BN keys each)
            float s[NS][4], dp[NS][4];
            #pragma unroll
            for (int nt = 0; nt < NS; nt++)
                #pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.f;
            #pragma unroll
            for (int kk = 0; kk < KT; kk++) {
                u32 qa[4], oa[4];
                ldsm_a<LDS>(qa, sQ, 16 * warp, kk * 16, lane);
                ldsm_a<LDS>(oa, sO, 16 * warp, kk * 16, lane);
                #pragma unroll
                for (int np = 0; np < NS / 2; np++) {
                    u32 kb[4], vb[4];
                    ldsm_b<LDS>(kb, k_s, np * 16, kk * 16, lane);
                    mma_bf16_16816(s[2 * np], qa, kb[0], kb[1]);
                    mma_bf16_16816(s[2 * np + 1], qa, kb[2], kb[3]);
                    ldsm_b<LDS>(vb, v_s, np * 16, kk * 16, lane);
                    mma_bf16_16816(dp[2 * np], oa, vb[0], vb[1]);
                    mma_bf16_16816(dp[2 * np + 1], oa, vb[2], vb[3]);
                }
            }
            // dS = P (dP - D) with P = exp(S * scale - lse), 0 where key > row.
            const bool mask = n0 + BN - 1 > wm0;
            #pragma unroll
            for (int nt = 0; nt < NS; nt++) {
                #pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int key = n0 + nt * 8 + 2 * t4 + e;
                    float p0 = fast_exp2(fmaf(s[nt][e], sl2, nl0));
                    float p1 = fast_exp2(fmaf(s[nt][2 + e], sl2, nl1));
                    if (mask) {
                        if (key > row0) p0 = 0.f;
                        if (key > row1) p1 = 0.f;
                    }
                    s[nt][e] = p0 * (dp[nt][e] - D0);
                    s[nt][2 + e] = p1 * (dp[nt][2 + e] - D1);
                }
            }
            // dQ += dS K  (K is [key][d] = [k][n]: ldmatrix.trans)
            #pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                u32 sa[4];
                frag_a_from_acc(sa, s[2 * kk], s[2 * kk + 1]);
                #pragma unroll
                for (int dp2 = 0; dp2 < HD / 16; dp2++) {
                    u32 kb[4];
                    ldsm_b_trans<LDS>(kb, k_s, kk * 16, dp2 * 16, lane);
                    mma_bf16_16816(dq[2 * dp2], sa, kb[0], kb[1]);
                    mma_bf16_16816(dq[2 * dp2 + 1], sa, kb[2], kb[3]);
                }
            }
        }
        __syncthreads();
    }
    bf16* sdq = sQ + 16 * warp * LDS;             // this warp's own Q rows: only it read them
    stage_acc_bf16<HD, LDS>(sdq, dq, scale, scale, lane);
    __syncwarp();
    store_rows16<HD, LDS>(dqkv + (size_t)b * T * stride + h * HD, sdq, wm0, T, stride, lane);
}

// Configurations; kernel names carry them. gpucore/ops/attention.py launches the
// default of each HD (V2_DKDV_CONFIG / V2_DQ_CONFIG); gpucore/ladder/attention.py lists them all.
//   dkdv (HD, warps, Q-tile rows): KV tile = 16 * warps keys;
//        smem = (32 * NWARPS + 4 * BM) * (HD + 8) * 2 + 16 * BM bytes
//   dq   (HD, warps, KV-tile keys): Q tile = 16 * warps rows;
//        smem = (32 * NWARPS + 4 * BN) * (HD + 8) * 2 bytes
// HD = 128 defaults to 32-row / 32-key tiles so dK + dV (128 f32 registers per thread)
// fit without spills. (.., 2): without a minimum of two blocks per SM ptxas trims the
// 4-warp kernels to 168 registers and spills.
#define FLASH_BWD_PRE(HD)                                                                        \
    extern "C" __global__ void attention_backward_preprocess_kernel_v2_hd##HD##_bf16(          \
            float* D, const bf16* dout, const bf16* out, int rows, int T, int NH) {            \
        flash_bwd_preprocess<HD>(D, dout, out, rows, T, NH);                                   \
    }
#define FLASH_BWD_DKDV(HD, NWARPS, BM)                                                           \
    extern "C" __global__ void __launch_bounds__(32 * NWARPS, 8 / NWARPS)                      \
    attention_backward_dkdv_kernel_v2_hd##HD##_w##NWARPS##_m##BM##_bf16(bf16* dqkv,            \
            const bf16* qkv, const bf16* dout, const float* lse, const float* D,               \
            int T, int NH, float scale) {                                                      \
        flash_bwd_dkdv<HD, NWARPS, BM>(dqkv, qkv, dout, lse, D, T, NH, scale);                 \
    }
#define FLASH_BWD_DQ(HD, NWARPS, BN)                                                             \
    extern "C" __global__ void __launch_bounds__(32 * NWARPS, 8 / NWARPS)                      \
    attention_backward_dq_kernel_v2_hd##HD##_w##NWARPS##_n##BN##_bf16(bf16* dqkv,              \
            const bf16* qkv, const bf16* dout, const float* lse, const float* D,               \
            int T, int NH, float scale) {                                                      \
        flash_bwd_dq<HD, NWARPS, BN>(dqkv, qkv, dout, lse, D, T, NH, scale);                   \
    }

FLASH_BWD_PRE(64)
FLASH_BWD_PRE(128)
FLASH_BWD_DKDV(64, 4, 64)
FLASH_BWD_DKDV(64, 8, 64)
FLASH_BWD_DKDV(64, 4, 32)
FLASH_BWD_DKDV(128, 4, 32)
FLASH_BWD_DKDV(128, 8, 32)
FLASH_BWD_DQ(64, 4, 64)
FLASH_BWD_DQ(64, 8, 64)
FLASH_BWD_DQ(64, 4, 32)
FLASH_BWD_DQ(128, 4, 32)
FLASH_BWD_DQ(128, 8, 32)
