/*
 * ladder/gemm/tc2.cu -- rungs v4b / v4c of the ladder: v4's mma.sync bf16 GEMM (ladder/gemm/tc.cu),
 * rebuilt for throughput. Same math, same contract:
 *
 * Math:   C (M, N) = A (M, K) @ B (K, N), all row-major; A, B bf16, float32
 *         accumulation, C float32 or bf16 (rounded once, to nearest even).
 * Needs:  K % 8 == 0 and N % 8 == 0 (every 16-byte cp.async chunk is either
 *         wholly inside or wholly outside the matrix), 16-byte aligned bases
 *         (checked in Python). Any M. Out-of-range chunks are zero-filled.
 * Grid:   1-D, ceil(M/BM) * ceil(N/BN) blocks, rasterised in groups of GROUP_M
 *         block-rows (as v4) so that blocks running together share tiles in L2.
 *
 * What changed against v4, and why (4096^3 on an H200: v4 334 TFLOP/s, 43.6% of cuBLAS):
 *  1. 64 x 64 warp tiles (v4: 64 x 32). A warp's k-step of 16 costs 4 ldmatrix.x4
 *     for A and 4 for B for 4 x 8 = 32 mma: 0.25 ldmatrix per mma instead of 0.375.
 *     Shared-memory bytes per mma fall from 192 to 128 -- at 1 mma/clk/SM that
 *     is exactly the 128 B/clk shared-memory port, so v4 could never feed the
 *     tensor cores past ~2/3 of their rate.
 *  2. Fragments double-buffered in registers: the ldmatrix of k-step ks+1 (and,
 *     across the barrier, k-step 0 of the next tile) is issued before the mma of
 *     k-step ks, so its latency hides under 32 mma instead of stalling the warp.
 *  3. BK = 64 (v4: 32): one barrier per 4 k-steps (128 mma per warp), and 128-byte
 *     A rows that take the standard 8-chunk XOR swizzle.
 *  4. Bigger block tiles, less L2 traffic per flop: v4b 128 x 256 (85 flop per byte
 *     loaded into smem, v4 64), v4c 128 x 128 with 2 blocks per SM.
 *
 *   v4b: 128 x 256 x 64 block, 8 warps (2 x 4) of 64 x 64, 3 stages (144 KB smem), 1 block/SM
 *   v4c: 128 x 128 x 64 block, 4 warps (2 x 2) of 64 x 64, 3 stages (96 KB smem), 2 blocks/SM
 *
 * Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16", bf16), lane = 4*g + t:
 *   A (16x16, row): a0 = A[g][2t,2t+1]  a1 = A[g+8][2t,2t+1]  a2 = A[g][2t+8,+9]  a3 = A[g+8][2t+8,+9]
 *   B (16x8, col):  b0 = B[2t,2t+1][g]  b1 = B[2t+8,+9][g]
 *   C (16x8):       c0,c1 = C[g][2t,2t+1]  c2,c3 = C[g+8][2t,2t+1]
 * ldmatrix.x4 (A, stored [m][k]): lane L gives the address of row (L & 15) of the
 *   16-row tile at k-chunk (L >> 4): matrices (m0-7,k0-7) (m8-15,k0-7) (m0-7,k8-15)
 *   (m8-15,k8-15) -> a0 a1 a2 a3.
 * ldmatrix.x4.trans (B, stored [k][n]): lane L gives k-row (L & 15), n-chunk j + (L >> 4):
 *   -> b0, b1 of n-tile j, then b0, b1 of n-tile j+1. (Both exactly as in v4.)
 *
 * Shared memory, one stage = A [BM][64] then B [64][BN], bf16, XOR-swizzled in
 * 16-byte chunks: chunk c of A row m sits at chunk c ^ (m & 7) (128-byte rows);
 * chunk c of B row k at chunk c ^ (k & 7) (low 3 bits only). The 8 row addresses
 * of every ldmatrix phase then fall in 8 different 16-byte bank groups, and so do
 * a warp's cp.async stores. For a lane, with x = (L >> 4) ^ (L & 7), the physical
 * chunk of A k-step ks is (2 ks) ^ x and of B n-tile pair j (j even) is wn0/8 + (j ^ x):
 * one lane constant serves every fragment load.
 */
#include "common.cuh"
#include "ptx.cuh"      // smem_u32_asm, cp.async, ldmatrix, mma.sync
#include "fast_packs.cuh"  // store_pair_rn: C's pairs, bf16 rounded in one instruction

#define BK2 64
#define GROUP_M2 8

template <typename Tout, int BM, int BN, int WARPS_M, int WARPS_N, int STAGES>
__device__ __forceinline__ void gemm_v4b(Tout* C, const bf16* A, const bf16* B,   // (M,N) (M,K) (K,N)
                                         int M, int N, int K) {
    constexpr int THREADS = WARPS_M * WARPS_N * 32;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;         // warp tile
    constexpr int MT = WM / 16, NT = WN / 8;                    // mma tiles per warp
    constexpr int KS = BK2 / 16;                                // k-steps per k-tile
    constexpr int A_STAGE = BM * BK2 * 2, B_STAGE = BK2 * BN * 2, STAGE = A_STAGE + B_STAGE;   // bytes
    constexpr int B_ROW_CHUNKS = BN / 8;                        // 16-byte chunks per B row
    constexpr int A_ITERS = BM * BK2 / 8 / THREADS, B_ITERS = BK2 * BN / 8 / THREADS;
    constexpr int A_ROW_STEP = THREADS / 8, B_ROW_STEP = THREADS / B_ROW_CHUNKS;   // rows between a thread's chunks
    static_assert(WM == 64 && WN == 64, "fragment swizzle arithmetic assumes 64 x 64 warp tiles");
    static_assert(KS % 2 == 0, "fragment buffers alternate per k-step: k-step 0 of every tile uses buffer 0");
    static_assert(A_ITERS * THREADS * 8 == BM * BK2 && B_ITERS * THREADS * 8 == BK2 * BN, "tile / thread mismatch");
    static_assert(A_ROW_STEP % 8 == 0 && B_ROW_STEP % 8 == 0 && THREADS % B_ROW_CHUNKS == 0,
                  "a thread's chunks must keep one swizzle phase (row & 7)");
    extern __shared__ __align__(1024) unsigned char smem[];    // STAGES x (A stage, B stage)
    const u32 smem0 = smem_u32_asm(smem);

    // Grouped rasterisation: GROUP_M2 block-rows advance together along N.
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    const int pid = blockIdx.x;
    const int per_group = GROUP_M2 * tiles_n;
    const int first_m = (pid / per_group) * GROUP_M2;
    const int group_rows = min(tiles_m - first_m, GROUP_M2);
    const int bm = first_m + (pid % per_group) % group_rows;
    const int bn = (pid % per_group) / group_rows;
    const int m0 = bm * BM, n0 = bn * BN;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm0 = (warp / WARPS_N) * WM, wn0 = (warp % WARPS_N) * WN;

    // ---- global -> shared copies: this thread's chunks of a k-tile ----
    // A: chunk column a_c of rows a_r0 + i * A_ROW_STEP; B: chunk column b_c of rows b_r0 + i * B_ROW_STEP.
    const int a_r0 = tid >> 3, a_c = tid & 7;
    const int b_r0 = tid / B_ROW_CHUNKS, b_c = tid % B_ROW_CHUNKS;
    const u32 a_dst = a_r0 * (BK2 * 2) + ((a_c ^ (a_r0 & 7)) << 4);
    const u32 b_dst = A_STAGE + b_r0 * (BN * 2) + ((b_c ^ (b_r0 & 7)) << 4);
    const bf16* a_src = A + (size_t)(m0 + a_r0) * K + a_c * 8;
    const bf16* b_src = B + (size_t)b_r0 * N + n0 + b_c * 8;
    const bool b_col_ok = n0 + b_c * 8 < N;

    auto load_tile = [&](int kt, int s) {
        const int k0 = kt * BK2;
        const u32 base = smem0 + s * STAGE;
        const bool a_k_ok = k0 + a_c * 8 < K;
        #pragma unroll
        for (int i = 0; i < A_ITERS; i++) {
            const bool ok = a_k_ok && m0 + a_r0 + i * A_ROW_STEP < M;
            const bf16* src = a_src + (size_t)i * A_ROW_STEP * K + k0;
            cp_async16(base + a_dst + i * A_ROW_STEP * (BK2 * 2), ok ? src : A, ok ? 16 : 0);
        }
        #pragma unroll
        for (int i = 0; i < B_ITERS; i++) {
            const bool ok = b_col_ok && k0 + b_r0 + i * B_ROW_STEP < K;
            const bf16* src = b_src + (size_t)(k0 + i * B_ROW_STEP) * N;
            cp_async16(base + b_dst + i * B_ROW_STEP * (BN * 2), ok ? src : B, ok ? 16 : 0);
        }
    };

    // ---- shared -> registers: fragments of one k-step (see the header for x) ----
    const u32 x16 = (u32)(((lane >> 4) ^ (lane & 7)) << 4);
    const u32 a_frag = (wm0 + (lane & 15)) * (BK2 * 2);
    const u32 b_frag = A_STAGE + (lane & 15) * (BN * 2) + (wn0 / 8) * 16;
    u32 af[2][MT][4], bfr[2][NT][2];

    auto load_frags = [&](int buf, u32 stage_base, int ks) {
        #pragma unroll
        for (int i = 0; i < MT; i++)
            ldmatrix_x4(af[buf][i][0], af[buf][i][1], af[buf][i][2], af[buf][i][3],
                        stage_base + a_frag + i * 16 * (BK2 * 2) + (((u32)(2 * ks) << 4) ^ x16));
        #pragma unroll
        for (int j = 0; j < NT; j += 2)
            ldmatrix_x4_trans(bfr[buf][j][0], bfr[buf][j][1], bfr[buf][j + 1][0], bfr[buf][j + 1][1],
                              stage_base + b_frag + ks * 16 * (BN * 2) + (((u32)j << 4) ^ x16));
    };

    float acc[MT][NT][4];
    #pragma unroll
    for (int i = 0; i < MT; i++)
        #pragma unroll
        for (int j = 0; j < NT; j++)
            #pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    const int ktiles = (K + BK2 - 1) / BK2;
    #pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ktiles) load_tile(s, s);
        cp_async_commit();                  // empty groups keep the group count uniform
    }
    cp_async_wait<STAGES - 2>();            // this thread's copies of tile 0 have landed
    __syncthreads();                        // ... everyone's
    int rs = 0, ws = STAGES - 1;            // stage read now, stage written next
    load_frags(0, smem0, 0);

    for (int kt = 0; kt < ktiles; kt++) {
        // Stage ws held tile kt-1: every warp finished reading it before the barrier
        // of the previous iteration (its last fragments were loaded one k-step early).
        if (kt + STAGES - 1 < ktiles) load_tile(kt + STAGES - 1, ws);
        cp_async_commit();
        ws = (ws + 1 == STAGES) ? 0 : ws + 1;
        #pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            if (ks == KS - 1) {             // fragments of ks are in registers: move to tile kt+1
                cp_async_wait<STAGES - 2>();         // tile kt+1 has landed (this thread) ...
                __syncthreads();                     // ... everywhere
                rs = (rs + 1 == STAGES) ? 0 : rs + 1;
            }
            if (ks < KS - 1 || kt + 1 < ktiles)
                load_frags((ks + 1) & 1, smem0 + rs * STAGE, (ks + 1) % KS);
            #pragma unroll
            for (int i = 0; i < MT; i++)
                #pragma unroll
                for (int j = 0; j < NT; j++)
                    mma_bf16_16816(acc[i][j], af[ks & 1][i], bfr[ks & 1][j][0], bfr[ks & 1][j][1]);
        }
    }
    cp_async_wait<0>();                     // no copy may still target smem when the block exits

    const int g = lane >> 2, t = lane & 3;
    #pragma unroll
    for (int i = 0; i < MT; i++) {
        #pragma unroll
        for (int j = 0; j < NT; j++) {
            const int row = m0 + wm0 + i * 16 + g, col = n0 + wn0 + j * 8 + 2 * t;
            if (col >= N) continue;         // N % 8 == 0: col < N implies col + 1 < N
            if (row < M) store_pair_rn<Tout>(C + (size_t)row * N + col, acc[i][j][0], acc[i][j][1]);
            if (row + 8 < M) store_pair_rn<Tout>(C + (size_t)(row + 8) * N + col, acc[i][j][2], acc[i][j][3]);
        }
    }
}

// Dynamic shared memory = STAGES * (BM * 64 + 64 * BN) * 2 bytes (ops/matmul.py GEMM_VERSIONS
// must agree): v4b 3 * 48 KB = 147456, v4c 3 * 32 KB = 98304.
#define V4B_CONFIG 128, 256, 2, 4, 3
#define V4C_CONFIG 128, 128, 2, 2, 3
#define GEMM_TC2(VER, CONFIG, THREADS, MIN_BLOCKS, Tout, SUF)                                          \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) gemm_forward_kernel_##VER##_##SUF( \
            Tout* C, const bf16* A, const bf16* B, int M, int N, int K) {                              \
        gemm_v4b<Tout, CONFIG>(C, A, B, M, N, K);                                                      \
    }
GEMM_TC2(v4b, V4B_CONFIG, 256, 1, float, bf16_f32)
GEMM_TC2(v4b, V4B_CONFIG, 256, 1, bf16, bf16_bf16)
GEMM_TC2(v4c, V4C_CONFIG, 128, 2, float, bf16_f32)
GEMM_TC2(v4c, V4C_CONFIG, 128, 2, bf16, bf16_bf16)
