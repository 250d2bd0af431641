/*
 * attention/flash_v3_bwd.cuh -- device helpers of the Hopper (wgmma, sm_90a) attention backward
 * kernels: attention/flash_v3_bwd.cu (the two-pass dK/dV + dQ backward) and
 * attention/flash_v3_bwd1.cu (the one-pass backward). Include after attention/flash_v3.cuh.
 * Moved here from flash_v3_bwd.cu unchanged (__forceinline__: same instruction streams).
 */
#pragma once
#include "attention/flash.cuh"
#include "wgmma.cuh"
#include "attention/flash_v3.cuh"

// One accumulator row of a warpgroup product -> global bf16 (times `mul`), rows >= T skipped.
// d holds HD/8 n8 blocks in the wgmma D layout; row0 is this thread's row g, row0 + 8 its row g+8.
template <int HD>
__device__ __forceinline__ void v3_store_acc(bf16* g, const float* d, float mul, int row0, int T, int stride,
                                             int t4) {
    #pragma unroll
    for (int j = 0; j < HD / 8; j++) {
        const int col = 8 * j + 2 * t4;
        if (row0 < T)
            *reinterpret_cast<u32*>(g + (size_t)row0 * stride + col) = pack_bf16x2_rn(d[4 * j] * mul, d[4 * j + 1] * mul);
        if (row0 + 8 < T)
            *reinterpret_cast<u32*>(g + (size_t)(row0 + 8) * stride + col) =
                pack_bf16x2_rn(d[4 * j + 2] * mul, d[4 * j + 3] * mul);
    }
}

// sum over N (a multiple of 8) columns of x[off..] * y[off..] (16-byte aligned), 0 if !valid.
template <int N>
__device__ __forceinline__ float v3_row_dot(const bf16* x, const bf16* y, size_t off, bool valid) {
    float acc = 0.f;
    if (valid) {
        #pragma unroll
        for (int c = 0; c < N; c += 8) {
            const Pack16<bf16> a = load16(x + off + c);
            const Pack16<bf16> o = load16(y + off + c);
            #pragma unroll
            for (int k = 0; k < 8; k++) acc = fmaf(to_float(a.v[k]), to_float(o.v[k]), acc);
        }
    }
    return acc;
}

// Register-A fragments (wgmma.cuh's layout) of the 64 x HD rows starting at tile row r0 - g of a
// swizzled (ROWS, HD) bf16 tile at generic address `tile`: this thread's rows r0 and r0 + 8.
// k-step ks covers columns 16ks..16ks+15 = 16-byte chunks 2(ks%4), 2(ks%4)+1 of column block ks/4.
template <int ROWS, int HD>
__device__ __forceinline__ void v3_tile_frags(u32 (&f)[HD / 16][4], const unsigned char* tile, int r0, int t4) {
    #pragma unroll
    for (int ks = 0; ks < HD / 16; ks++) {
        const unsigned char* blk = tile + (ks >> 2) * (ROWS * 128) + 4 * t4;
        const int c = 2 * (ks & 3);
        f[ks][0] = *reinterpret_cast<const u32*>(blk + wg_swz128(r0, c));
        f[ks][1] = *reinterpret_cast<const u32*>(blk + wg_swz128(r0 + 8, c));
        f[ks][2] = *reinterpret_cast<const u32*>(blk + wg_swz128(r0, c + 1));
        f[ks][3] = *reinterpret_cast<const u32*>(blk + wg_swz128(r0 + 8, c + 1));
    }
}


// The dK/dV side's pointwise work on a 64-key x BM-query tile held in the wgmma D layout (this
// thread: keys key0, key0 + 8; queries m0 + 8j + 2t4 (+1)), shared by the two-pass dK/dV kernel
// (flash_v3_bwd.cu) and the one-pass kernel (flash_v3_bwd1.cu).
// P^T = exp(S^T * scale - lse[query]) in place (sl2 = scale * log2 e, l_s: the tile's lse); with
// mask (diagonal or tail tiles) 0 where key > query or query >= T.
// MASK: 0 no tests (a tile wholly below the diagonal and inside T), 1 the tests, -1 the tests where
// the runtime flag `mask` says so. The one-pass kernel branches between 0 and 1 (warpgroup-uniform):
// with -1 ptxas applied the tests to every tile (~4 instructions a value, 13% of the kernel's
// instructions; ncu, sixteenth session). The two-pass dK/dV kernel keeps -1: the same branch there,
// with its register-A dP^T product in flight across it, made its dK and dV wrong (GPU tests; the
// one-pass kernel's dP^T reads shared memory only, and its bits stayed the same).
template <int BM, int MASK = -1>
__device__ __forceinline__ void v3_pt_from_st(float* st, const float* l_s, float sl2, bool mask, int key0, int m0,
                                              int T, int t4) {
    #pragma unroll
    for (int j = 0; j < BM / 8; j++) {
        const float2 l2 = *reinterpret_cast<const float2*>(l_s + 8 * j + 2 * t4);
        const float nl[2] = {-l2.x * FA_LOG2E, -l2.y * FA_LOG2E};
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            float p = fast_exp2(fmaf(st[4 * j + e], sl2, nl[e & 1]));
            if (MASK == 1 || (MASK == -1 && mask)) {
                const int qa = m0 + 8 * j + 2 * t4 + (e & 1);
                if (key0 + 8 * (e >> 1) > qa || qa >= T) p = 0.f;
            }
            st[4 * j + e] = p;
        }
    }
}

// dS^T = P^T (dP^T - D[query]), into dpt (d_s: the tile's D).
template <int BM>
__device__ __forceinline__ void v3_dst_from_pt(float* dpt, const float* pt, const float* d_s, int t4) {
    #pragma unroll
    for (int j = 0; j < BM / 8; j++) {
        const float2 d2 = *reinterpret_cast<const float2*>(d_s + 8 * j + 2 * t4);
        dpt[4 * j + 0] = pt[4 * j + 0] * (dpt[4 * j + 0] - d2.x);
        dpt[4 * j + 1] = pt[4 * j + 1] * (dpt[4 * j + 1] - d2.y);
        dpt[4 * j + 2] = pt[4 * j + 2] * (dpt[4 * j + 2] - d2.x);
        dpt[4 * j + 3] = pt[4 * j + 3] * (dpt[4 * j + 3] - d2.y);
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// One warpgroup's 64 x HD accumulator d (times mul) -> bf16 rows row_base + 0..63 of global g (row
// stride `stride`, rows >= T skipped), through a staging tile: stmatrix puts the accumulator's 8 x 8
// blocks into the warp's 16 rows of the warpgroup's 128B-swizzled (64, HD) tile at shared address
// `stage` (generic address stage_gen; HD / 64 column blocks of 64 x 128 bytes), then each lane
// stores whole 16-byte chunks of rows. v3_store_acc's 4-byte stores (HD / 2 per accumulator and
// thread) filled the store queue at the one-pass kernel's KV-tile ends (ncu: lg stalls, 16% excess
// sectors). A warp touches only its own 16 rows, so __syncwarp orders it; the caller makes sure no
// one else uses the tile meanwhile. Same bits as v3_store_acc.
template <int HD>
__device__ __forceinline__ void v3_store_acc_staged(bf16* g, const float* d, float mul, int row_base, int T,
                                                    int stride, u32 stage, const unsigned char* stage_gen,
                                                    int w4, int lane) {
    const int m = lane >> 3, row_m = 16 * w4 + (lane & 7) + 8 * (m & 1);
    #pragma unroll
    for (int j = 0; j < HD / 8; j += 2) {     // n8 blocks j, j + 1, rows g and g + 8 of each
        const int cc = j + (m >> 1);          // this lane's row address: matrix m's chunk
        stmatrix_x4(stage + (cc >> 3) * (64 * 128) + wg_swz128(row_m, cc & 7),
                    pack_bf16x2_rn(d[4 * j] * mul, d[4 * j + 1] * mul),
                    pack_bf16x2_rn(d[4 * j + 2] * mul, d[4 * j + 3] * mul),
                    pack_bf16x2_rn(d[4 * j + 4] * mul, d[4 * j + 5] * mul),
                    pack_bf16x2_rn(d[4 * j + 6] * mul, d[4 * j + 7] * mul));
    }
    __syncwarp();
    constexpr int CPR = HD / 8;               // 16-byte chunks per row
    #pragma unroll
    for (int k = 0; k < 16 * CPR / 32; k++) {
        const int q = 32 * k + lane, row = 16 * w4 + q / CPR, cc = q % CPR;
        const uint4 v = *reinterpret_cast<const uint4*>(stage_gen + (cc >> 3) * (64 * 128) + wg_swz128(row, cc & 7));
        if (row_base + row < T) *reinterpret_cast<uint4*>(g + (size_t)(row_base + row) * stride + 8 * cc) = v;
    }
    __syncwarp();                             // the next call may overwrite the rows just read
}

// D (64 x 64) = A (64 x HD, fragments held in registers) @ B^T (B: 64 x HD K-major at b, column
// blocks 64 * 128 apart). The RA ("register A") variants use it for S^T = K Q^T, dP^T = V dO^T
// (dK/dV pass) and S = Q K^T, dP = dO V^T (dQ pass): only B is read from shared memory, which
// halves the smem operand traffic of these N = 64 products. No commit.
template <int HD>
__device__ __forceinline__ void v3_product_rk(float* d, const u32 (&a)[HD / 16][4], u32 b) {
    const u64 db = smem_desc(b, 16, 1024);
    #pragma unroll
    for (int ks = 0; ks < HD / 16; ks++)
        wgmma_m64n64k16_rs_kk(d, a[ks], desc_add(db, (ks >> 2) * (64 * 128) + (ks & 3) * 32), ks > 0);
}

// D (64 x N) = A (64 x HD, K-major at a + wgrow bytes, column blocks arows * 128 apart)
//            @ B^T (B: N x HD K-major at b, column blocks N * 128 apart). No commit.
template <int N, int HD>
__device__ __forceinline__ void v3_product_kk(float* d, u32 a, int arows, u32 b) {
    const u64 da = smem_desc(a, 16, 1024), db = smem_desc(b, 16, 1024);
    #pragma unroll
    for (int ks = 0; ks < HD / 16; ks++) {
        const u32 off_a = (ks >> 2) * (arows * 128) + (ks & 3) * 32;
        const u32 off_b = (ks >> 2) * (N * 128) + (ks & 3) * 32;
        v3_mma_ss<N>(d, desc_add(da, off_a), desc_add(db, off_b), ks > 0);
    }
}

// d (64 x HD) += A (64 x KN, fragments f) @ B (KN x HD, MN-major tile at b with KN rows). No commit.
template <int KN, int HD>
__device__ __forceinline__ void v3_product_rs(float* d, u32 (&f)[KN / 16][4], u32 b) {
    wg_fence_regs<KN / 4>(&f[0][0]);
    wgmma_fence();
    const u64 db = smem_desc(b, KN * 128, 1024);
    #pragma unroll
    for (int k = 0; k < KN / 16; k++) v3_mma_rs<HD>(d, f[k], desc_add(db, k * 2048), 1);
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
