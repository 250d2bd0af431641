/*
 * attention/flash.cuh -- tensor-core building blocks shared by the flash attention
 * forward (attention/flash_fwd.cu) and backward (attention/flash_bwd.cu) kernels.
 * The PTX wrappers themselves (smem_u32, cp_async16_zfill, cp_async4, cp_async_commit/wait,
 * ldmatrix_x4(_trans), mma_bf16_16816) are ptx.cuh's; this header adds the tile loads and the
 * fragment addressing on top of them.
 *
 * - mma.sync m16n8k16 bf16 x bf16 -> f32 and its fragment layouts (PTX ISA,
 *   "Matrix Fragments for mma.m16n8k16"), with g = lane / 4, t = lane % 4:
 *     A (16x16, row-major), 4 x b32 regs of 2 bf16 (low half = lower column):
 *       a0: (g,   2t..2t+1)   a1: (g+8, 2t..2t+1)
 *       a2: (g,   2t+8..+9)   a3: (g+8, 2t+8..+9)
 *     B (16x8, "col": element (k, n)), 2 regs:
 *       b0: (k = 2t..2t+1, n = g)   b1: (k = 2t+8..+9, n = g)
 *     C/D (16x8 f32), 4 regs: c0,c1: (g, 2t..2t+1)   c2,c3: (g+8, 2t..2t+1)
 *   Because C's layout equals A's for one 8-column half, a score tile computed
 *   as C can be fed back as the A operand of the next mma after packing to bf16
 *   (FlashAttention-2's register reuse of P), see frag_a_from_acc.
 * - ldmatrix.x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; each
 *   lane receives, per matrix, elements (lane/4, 2*(lane%4)..+1), or with
 *   .trans the transposed pair (2*(lane%4)..+1, lane/4) -- which is exactly a
 *   B fragment read out of a row-major [k][n] tile (V in P.V).
 * - Address helpers for the three ways a tile of row-major smem is read:
 *     ldsm_a      rows r..r+15 as an A operand (cols k0..k0+15)
 *     ldsm_b      rows n..n+15 of a [n][k] tile as two B operands (n-tiles n, n+8)
 *     ldsm_b_trans rows k..k+15 of a [k][n] tile as two B operands (n-tiles n, n+8)
 * - Tile loads by cp.async 16-byte copies global -> shared with zero-fill of rows past the
 *   end (src-size 0), so tails never read out of bounds and never feed
 *   uninitialised smem (possibly NaN bits) into an mma.
 * - Shared-memory tiles are row-major with a pitch of HD + 8 bf16: 8 rows read
 *   by one ldmatrix phase then start 16 bytes apart modulo 128, which is
 *   bank-conflict free (as are the 16-byte cp.async writes).
 */
#pragma once
#include "common.cuh"
#include "ptx.cuh"       // smem_u32, cp.async, ldmatrix, mma_bf16_16816

#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f
#define FA_NEG_INF (-__int_as_float(0x7f800000))

// ---- cp.async tiles -----------------------------------------------------------

// Rows [r0, r0 + ROWS) of a (T, HD) slice of global memory whose rows are
// `stride` elements apart -> smem tile (ROWS, HD + 8). Rows >= T become zeros.
template <int ROWS, int HD, int NT>
__device__ __forceinline__ void load_tile_async(bf16* s, const bf16* g, int r0, int T, int stride) {
    constexpr int CPR = HD / 8;                    // 16-byte chunks per row
    static_assert((ROWS * CPR) % NT == 0, "tile chunks must divide evenly among threads");
    #pragma unroll
    for (int it = 0; it < ROWS * CPR / NT; it++) {
        const int i = it * NT + threadIdx.x;
        const int row = i / CPR, c = i % CPR;
        const int r = r0 + row;
        const bool valid = r < T;
        const bf16* src = g + (size_t)(valid ? r : 0) * stride + c * 8;
        cp_async16_zfill(s + row * (HD + 8) + c * 8, src, valid);
    }
}

// ROWS floats starting at row r0 of a (T,) vector -> smem; rows >= T become 0.
template <int ROWS, int NT>
__device__ __forceinline__ void load_vec_async(float* s, const float* g, int r0, int T) {
    for (int i = threadIdx.x; i < ROWS; i += NT) {
        const int r = r0 + i;
        const bool valid = r < T;
        cp_async4(smem_u32(s + i), g + (valid ? r : 0), valid ? 4 : 0);
    }
}

// ---- ldmatrix fragment addressing ----------------------------------------------

// A fragment of rows [r, r+16), cols [k0, k0+16) of a row-major tile with pitch LDS.
// Lane l addresses row r + l%16, col k0 + (l/16)*8: matrices (r,k0) (r+8,k0) (r,k0+8) (r+8,k0+8) = a0..a3.
template <int LDS>
__device__ __forceinline__ void ldsm_a(u32 (&a)[4], const bf16* tile, int r, int k0, int lane) {
    ldmatrix_x4(a[0], a[1], a[2], a[3], smem_u32(tile + (r + (lane & 15)) * LDS + k0 + (lane >> 4) * 8));
}

// B fragments for n-tiles [n, n+8) and [n+8, n+16), k in [k0, k0+16), from a row-major
// [n][k] tile (K in Q.K^T: element (k, n) of B is tile[n][k]). Lane l addresses row
// n + (l/16)*8 + l%8, col k0 + ((l/8)%2)*8: r0,r1 = b0,b1 of n-tile n; r2,r3 = of n-tile n+8.
template <int LDS>
__device__ __forceinline__ void ldsm_b(u32 (&b)[4], const bf16* tile, int n, int k0, int lane) {
    ldmatrix_x4(b[0], b[1], b[2], b[3],
                smem_u32(tile + (n + (lane >> 4) * 8 + (lane & 7)) * LDS + k0 + ((lane >> 3) & 1) * 8));
}

// B fragments for n-tiles [n, n+8) and [n+8, n+16), k in [k0, k0+16), from a row-major
// [k][n] tile (V in P.V: element (k, n) of B is tile[k][n]), via ldmatrix.trans. Lane l
// addresses row k0 + ((l/8)%2)*8 + l%8, col n + (l/16)*8: r0,r1 = b0,b1 of n-tile n; r2,r3 of n+8.
template <int LDS>
__device__ __forceinline__ void ldsm_b_trans(u32 (&b)[4], const bf16* tile, int k0, int n, int lane) {
    ldmatrix_x4_trans(b[0], b[1], b[2], b[3],
                      smem_u32(tile + (k0 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LDS + n + (lane >> 4) * 8));
}

// Two floats -> bf16x2 (round to nearest even), `lo` in the low half. One cvt instruction.
__device__ __forceinline__ u32 pack_bf16x2_rn(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^x on the SFU (rel. error ~2^-22); 2^-inf = +0.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// A fragment (16 rows x 16 k) from two f32 accumulator tiles c[j] (cols k..k+7) and
// c[j+1] (cols k+8..k+15) of the same 16 rows: the C layout matches A's, see above.
__device__ __forceinline__ void frag_a_from_acc(u32 (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = pack_bf16x2_rn(c0[0], c0[1]);
    a[1] = pack_bf16x2_rn(c0[2], c0[3]);
    a[2] = pack_bf16x2_rn(c1[0], c1[1]);
    a[3] = pack_bf16x2_rn(c1[2], c1[3]);
}

// Write a warp's 16 x HD f32 accumulator tile (scaled per row) as bf16 into rows
// [0, 16) of a smem tile (pitch LDS), the layout the 16-byte global stores read back.
template <int HD, int LDS>
__device__ __forceinline__ void stage_acc_bf16(bf16* s, const float (&acc)[HD / 8][4], float s0, float s1, int lane) {
    const int g = lane >> 2, t = lane & 3;
    #pragma unroll
    for (int dt = 0; dt < HD / 8; dt++) {
        *reinterpret_cast<u32*>(s + g * LDS + dt * 8 + 2 * t) = pack_bf16x2_rn(acc[dt][0] * s0, acc[dt][1] * s0);
        *reinterpret_cast<u32*>(s + (g + 8) * LDS + dt * 8 + 2 * t) = pack_bf16x2_rn(acc[dt][2] * s1, acc[dt][3] * s1);
    }
}

// 16 rows x HD of a smem tile (pitch LDS) -> global rows r0.. (stride elements apart),
// rows >= T skipped; 16-byte stores, one warp. Call after __syncwarp().
template <int HD, int LDS>
__device__ __forceinline__ void store_rows16(bf16* g, const bf16* s, int r0, int T, int stride, int lane) {
    constexpr int CPR = HD / 8;
    #pragma unroll
    for (int it = 0; it < 16 * CPR / 32; it++) {
        const int i = it * 32 + lane;
        const int row = i / CPR, c = i % CPR;
        if (r0 + row < T)
            store16(g + (size_t)(r0 + row) * stride + c * 8, load16(s + row * LDS + c * 8));
    }
}
