/*
 * attention/flash_v3.cuh -- device helpers shared by the Hopper (wgmma, sm_90a) attention kernels:
 * ladder/attention/flash_v3_fwd_serial.cu (forward), attention/flash_v3_fwd.cu (pipelined forward) and
 * attention/flash_v3_bwd.cu (backward). Include after attention/flash.cuh and wgmma.cuh.
 *
 These are __forceinline__: a change here changes the instruction stream of every v3 kernel
 * at once (the helpers were moved here from those files with byte-identical cubins).
 *
 * Shared-memory tiles: a (ROWS, HD) bf16 tile is stored as HD/64 column blocks of
 * (ROWS x 128 B), each 128B-swizzled and 1024-byte aligned (wgmma.cuh's header).
 * Register layouts: accumulators and register-A fragments as in wgmma.cuh's header.
 */
#pragma once
#include "attention/flash.cuh"   // FA_NEG_INF, fast_exp2, pack_bf16x2_rn
#include "wgmma.cuh"

// Block order. The grid is (B*NH heads, tiles); the hardware starts blocks in linear-id order
// (x fastest), so with head = blockIdx.x the tiles of one head started B*NH blocks apart and every
// tile re-read its head's K/V (forward) or Q/dO/K/V (backward) from DRAM: ncu on an H100 read 10%
// L2 hits and 78% of DRAM bandwidth in the forward. Here the linear id walks groups of
// V3_HEAD_GROUP heads, all tile ranks of a group (rank 0 = heaviest, first) before the next group,
// so the blocks running together share a few heads' operands through L2 (16 heads of K/V = 4 MB at
// hd 64, T 1024). V3_HEAD_GROUP 0 keeps the old order (bh = blockIdx.x, rank = blockIdx.y).
#ifndef V3_HEAD_GROUP
#define V3_HEAD_GROUP 16
#endif
__device__ __forceinline__ void v3_block_order(int& bh, int& rank) {
    if (V3_HEAD_GROUP == 0) {
        bh = blockIdx.x;
        rank = blockIdx.y;
        return;
    }
    const int nt = gridDim.y, n_heads = gridDim.x;
    const int lin = blockIdx.x + blockIdx.y * gridDim.x;
    const int g0 = lin / (V3_HEAD_GROUP * nt) * V3_HEAD_GROUP;    // first head of this block's group
    const int hg = min(V3_HEAD_GROUP, n_heads - g0);               // heads in it (the last may be short)
    const int w = lin - g0 * nt;
    rank = w / hg;
    bh = g0 + (w - rank * hg);
}

// Byte offset of 16-byte chunk c (8 bf16 of the head dim) of row r in a (ROWS, HD) tile.
template <int ROWS>
__device__ __forceinline__ u32 v3_off(int r, int c) { return (u32)((c >> 3) * (ROWS * 128)) + wg_swz128(r, c & 7); }

// Rows [r0, r0 + ROWS) of a (T, HD) slice (rows `stride` elements apart) -> swizzled tile at
// shared address s. Rows >= T become zeros (src-size 0; src stays a valid address: row 0).
// Used by the forward (v3, v3p) and the backward. HINT: the copies carry L2 cache policy `policy`
// (e.g. l2_evict_first for tiles read once, so they leave the L2 before what is read again).
template <int ROWS, int HD, int NT, bool HINT = false>
__device__ __forceinline__ void v3_load_tile(u32 s, const bf16* g, int r0, int T, int stride, u64 policy = 0) {
    constexpr int CPR = HD / 8;
    static_assert((ROWS * CPR) % NT == 0, "tile chunks must divide evenly among threads");
    #pragma unroll
    for (int it = 0; it < ROWS * CPR / NT; it++) {
        const int i = it * NT + threadIdx.x;
        const int row = i / CPR, c = i % CPR;
        const bool valid = r0 + row < T;
        const bf16* src = g + (size_t)(valid ? r0 + row : 0) * stride + c * 8;
        if constexpr (HINT) cp_async16_hint(s + v3_off<ROWS>(row, c), src, valid ? 16 : 0, policy);
        else cp_async16(s + v3_off<ROWS>(row, c), src, valid ? 16 : 0);
    }
}

// A fragments (bf16) of a 64 x KN product from f32 values x (wgmma D layout, KN/8 n8 blocks):
// k-step k (16 columns) = n8 blocks 2k, 2k+1, e.g. P = bf16(S) for O += P V.
template <int KN>
__device__ __forceinline__ void v3_to_frags(u32 (&f)[KN / 16][4], const float* x) {
    #pragma unroll
    for (int k = 0; k < KN / 16; k++) {
        f[k][0] = pack_bf16x2_rn(x[8 * k + 0], x[8 * k + 1]);
        f[k][1] = pack_bf16x2_rn(x[8 * k + 2], x[8 * k + 3]);
        f[k][2] = pack_bf16x2_rn(x[8 * k + 4], x[8 * k + 5]);
        f[k][3] = pack_bf16x2_rn(x[8 * k + 6], x[8 * k + 7]);
    }
}


// Online softmax (v2's) of row r (0: the thread's row g, 1: row g + 8) of S (64 x BN f32, wgmma
// D layout: row r of this thread = s[4 nt + 2 r + e]), in log2 units: s <- 2^(s sl2 - m_new),
// m_run <- m_new = max(m_run, rowmax sl2); returns alpha = 2^(m_old - m_new), rs = the thread's
// part of the row sum (the quad's 4 lanes each hold a quarter of the row).
template <int BN>
__device__ __forceinline__ float v3_softmax_row(float* s, float& m_run, float sl2, int r, float& rs_out) {
    constexpr int NS = BN / 8;
    float mx = FA_NEG_INF;
    #pragma unroll
    for (int nt = 0; nt < NS; nt++) mx = fmaxf(mx, fmaxf(s[4 * nt + 2 * r], s[4 * nt + 2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m_run, mx * sl2);
    const float ref = mn == FA_NEG_INF ? 0.f : mn;           // all masked so far: no -inf - -inf
    const float alpha = fast_exp2(m_run - ref);
    m_run = mn;
    float rs = 0.f;
    #pragma unroll
    for (int nt = 0; nt < NS; nt++) {
        s[4 * nt + 2 * r] = fast_exp2(fmaf(s[4 * nt + 2 * r], sl2, -ref));
        s[4 * nt + 2 * r + 1] = fast_exp2(fmaf(s[4 * nt + 2 * r + 1], sl2, -ref));
        rs += s[4 * nt + 2 * r] + s[4 * nt + 2 * r + 1];
    }
    rs_out = rs;
    return alpha;
}

// Forward epilogue (v3 and v3p): quad sums of l, lse = (m + log2 l) ln 2 for active rows < T,
// O / l rounded to bf16 into this warp's own 16 Q rows of the tile at smem_gen (swizzled like Q:
// chunk c of row r at v3_off<BM>(r, c); conflict-free 4-byte writes; only this warpgroup's
// wgmma read those rows, all retired), then the warp reads its rows back as 16-byte chunks and
// stores them coalesced; rows >= T skipped. active: this warpgroup has rows < T.
template <int HD, int BM>
__device__ __forceinline__ void v3_fwd_epilogue(bf16* out, float* lse, const float (&o)[HD / 2], const float (&m_run)[2],
                                                const float (&l_run)[2], bool active, unsigned char* smem_gen,
                                                int row0, int bh, int b, int h, int T, int C, int m0,
                                                int wg, int w4, int lane) {
    constexpr int ND = HD / 8;
    const int g = lane >> 2, t4 = lane & 3;
    float inv[2];
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        float l = l_run[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        inv[r] = l > 0.f ? 1.f / l : 0.f;
        const int row = row0 + 8 * r;
        if (active && t4 == 0 && row < T) lse[(size_t)bh * T + row] = (m_run[r] + log2f(l)) * FA_LN2;
    }
    const int lr0 = 64 * wg + 16 * w4;                          // this warp's first row in the tile
    #pragma unroll
    for (int dt = 0; dt < ND; dt++) {
        const u32 cb = 4 * t4;                                  // byte offset of column 2t in a chunk
        *reinterpret_cast<u32*>(smem_gen + v3_off<BM>(lr0 + g, dt) + cb) = pack_bf16x2_rn(o[4 * dt] * inv[0], o[4 * dt + 1] * inv[0]);
        *reinterpret_cast<u32*>(smem_gen + v3_off<BM>(lr0 + g + 8, dt) + cb) = pack_bf16x2_rn(o[4 * dt + 2] * inv[1], o[4 * dt + 3] * inv[1]);
    }
    __syncwarp();
    bf16* out_g = out + (size_t)b * T * C + h * HD;
    #pragma unroll
    for (int it = 0; it < 16 * ND / 32; it++) {
        const int i = it * 32 + lane;
        const int r = i / ND, c = i % ND;
        const int row = m0 + lr0 + r;
        if (row < T) {
            const uint4 v = *reinterpret_cast<const uint4*>(smem_gen + v3_off<BM>(lr0 + r, c));
            *reinterpret_cast<uint4*>(out_g + (size_t)row * C + c * 8) = v;
        }
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// One wgmma k-step, N picked at compile time. _ss: A, B from smem, K-major (S = Q K^T);
// _rs: A from registers, B MN-major (O += P V).
template <int N>
__device__ __forceinline__ void v3_mma_ss(float* d, u64 a, u64 b, int scale_d) {
    static_assert(N == 64 || N == 128, "N");
    if constexpr (N == 64) wgmma_m64n64k16_ss_kk(d, a, b, scale_d);
    else wgmma_m64n128k16_ss_kk(d, a, b, scale_d);
}
template <int N>
__device__ __forceinline__ void v3_mma_rs(float* d, const u32 (&a)[4], u64 b, int scale_d) {
    static_assert(N == 64 || N == 128, "N");
    if constexpr (N == 64) wgmma_m64n64k16_rs_mn(d, a, b, scale_d);
    else wgmma_m64n128k16_rs_mn(d, a, b, scale_d);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
