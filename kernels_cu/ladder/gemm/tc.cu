/*
 * ladder/gemm/tc.cu -- our own bf16 tensor-core GEMM, rung v4 of the ladder (Ampere-style mma.sync).
 *
 * Math:   C (M, N) = A (M, K) @ B (K, N), all row-major; A, B bf16, float32
 *         accumulation, C float32 or bf16 (rounded once, to nearest even).
 * Needs:  K % 8 == 0 and N % 8 == 0 (every 16-byte cp.async chunk is either
 *         wholly inside or wholly outside the matrix), 16-byte aligned bases
 *         (checked in Python). Any M. Out-of-range chunks are zero-filled.
 * Grid:   1-D, ceil(M/BM) * ceil(N/BN) blocks, rasterised in groups of GROUP_M
 *         block-rows so that blocks running together share A and B tiles in L2.
 *
 * Block tile BM x BN x 32 = 128 x 128 x 32 (V4_CONFIG at the end, the one instantiation:
 * gemm_forward_kernel_v4_bf16_{f32,bf16}), 8 warps as WARPS_M x WARPS_N
 * (2 x 4): each warp owns a (BM/WARPS_M) x (BN/WARPS_N) = 64 x 32 tile of C as
 * 4 x 4 mma tiles of m16n8k16 (64 float accumulators per thread).
 * Pipeline: STAGES (4) shared-memory stages filled by cp.async.cg (16 bytes,
 * L2 only); while tile kt is multiplied, tiles kt+1 .. kt+STAGES-1 are in flight.
 * (A 128 x 256 variant with 64 x 64 warp tiles, "v4w", was removed: slower than v4 at
 * 4096^3 on an H200. ladder/gemm/tc2.cu's v4b is the rung where 64 x 64 warp tiles pay.)
 * PTX wrappers (cp.async, ldmatrix, mma.sync): ptx.cuh.
 *
 * Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16", bf16), lane = 4*g + t:
 *   A (16x16, row): a0 = A[g][2t,2t+1]  a1 = A[g+8][2t,2t+1]  a2 = A[g][2t+8,+9]  a3 = A[g+8][2t+8,+9]
 *   B (16x8, col):  b0 = B[2t,2t+1][g]  b1 = B[2t+8,+9][g]
 *   C (16x8):       c0,c1 = C[g][2t,2t+1]  c2,c3 = C[g+8][2t,2t+1]
 * ldmatrix.x4 (A, stored [m][k]): lanes 0-7 / 8-15 / 16-23 / 24-31 give the row
 *   addresses of the 8x8 matrices (m0-7,k0-7) (m8-15,k0-7) (m0-7,k8-15) (m8-15,k8-15)
 *   -> registers a0 a1 a2 a3 exactly.
 * ldmatrix.x4.trans (B, stored [k][n], n contiguous): matrices (k0-7,n0-7)
 *   (k8-15,n0-7) (k0-7,n8-15) (k8-15,n8-15); .trans hands lane 4g+t the elements
 *   [k=2t,2t+1][n=g] -> b0, b1 of n-tile 0, then b0, b1 of n-tile 1.
 *
 * Shared-memory layout, XOR-swizzled in 16-byte chunks so that the 8 row
 * addresses of every ldmatrix hit 8 different bank groups:
 *   A stage [BM][32] bf16: 64-byte rows, 4 chunks; chunk c of row m is stored at
 *     chunk c ^ ((m >> 1) & 3). Rows m..m+7 then cover (m & 1, (m >> 1) & 3) =
 *     8 distinct (half-line, chunk) pairs of the 128-byte bank line.
 *   B stage [32][BN] bf16: BN*2-byte rows; chunk c of row k is stored at
 *     chunk c ^ (k & 7) (flips the low 3 bits only: needs BN >= 64).
 */
#include "common.cuh"
#include "ptx.cuh"      // smem_u32_asm, cp.async, ldmatrix, mma.sync
#include "fast_packs.cuh"  // store_pair_rn: C's pairs, bf16 rounded in one instruction

#define BK 32
#define GROUP_M 8

// Byte offsets inside one stage (see the swizzle in the header).
__device__ __forceinline__ int a_off(int m, int c) { return m * (BK * 2) + ((c ^ ((m >> 1) & 3)) << 4); }
template <int BN>
__device__ __forceinline__ int b_off(int k, int c) { return k * (BN * 2) + ((c ^ (k & 7)) << 4); }

template <typename Tout, int BM, int BN, int WARPS_M, int WARPS_N, int STAGES>
__device__ void gemm_v4(Tout* C, const bf16* A, const bf16* B, int M, int N, int K) {   // (M,N) (M,K) (K,N)
    constexpr int THREADS = WARPS_M * WARPS_N * 32;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;     // warp tile
    constexpr int MT = WM / 16, NT = WN / 8;                // mma tiles per warp
    constexpr int A_STAGE = BM * BK * 2, B_STAGE = BK * BN * 2;   // bytes
    constexpr int A_CHUNKS = BM * BK / 8, B_CHUNKS = BK * BN / 8;  // 16-byte chunks per stage
    static_assert(NT % 2 == 0, "B fragments are loaded two n-tiles at a time");
    static_assert(BN >= 64 && A_CHUNKS % THREADS == 0 && B_CHUNKS % THREADS == 0, "tile / thread mismatch");
    extern __shared__ __align__(128) unsigned char smem[];   // STAGES x (A stage, B stage)
    const u32 smem0 = smem_u32_asm(smem);

    // Grouped rasterisation: GROUP_M block-rows advance together along N.
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    const int pid = blockIdx.x;
    const int per_group = GROUP_M * tiles_n;
    const int first_m = (pid / per_group) * GROUP_M;
    const int group_rows = min(tiles_m - first_m, GROUP_M);
    const int bm = first_m + (pid % per_group) % group_rows;
    const int bn = (pid % per_group) / group_rows;
    const int m0 = bm * BM, n0 = bn * BN;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm0 = (warp / WARPS_N) * WM, wn0 = (warp % WARPS_N) * WN;

    // Issue the cp.async copies of k-tile kt into stage s (zero-fill outside the matrix).
    auto load_tile = [&](int kt, int s) {
        const int k0 = kt * BK;
        const u32 sa = smem0 + s * (A_STAGE + B_STAGE), sb = sa + A_STAGE;
        #pragma unroll
        for (int i = 0; i < A_CHUNKS / THREADS; i++) {
            const int id = tid + i * THREADS;
            const int r = id / (BK / 8), c = id % (BK / 8);
            const int gm = m0 + r, gk = k0 + c * 8;
            const bool ok = gm < M && gk < K;
            cp_async16(sa + a_off(r, c), ok ? A + (size_t)gm * K + gk : A, ok ? 16 : 0);
        }
        #pragma unroll
        for (int i = 0; i < B_CHUNKS / THREADS; i++) {
            const int id = tid + i * THREADS;
            const int r = id / (BN / 8), c = id % (BN / 8);
            const int gk = k0 + r, gn = n0 + c * 8;
            const bool ok = gk < K && gn < N;
            cp_async16(sb + b_off<BN>(r, c), ok ? B + (size_t)gk * N + gn : B, ok ? 16 : 0);
        }
    };

    float acc[MT][NT][4];
    #pragma unroll
    for (int i = 0; i < MT; i++)
        #pragma unroll
        for (int j = 0; j < NT; j++)
            #pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    const int ktiles = (K + BK - 1) / BK;
    #pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ktiles) load_tile(s, s);
        cp_async_commit();                  // empty groups keep the group count uniform
    }

    // ldmatrix row addresses of this lane (see the header): A rows / k-chunk offset,
    // B k-rows / n-chunk offset, relative to the warp tile.
    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_kc = lane >> 4;
    const int b_krow = (lane & 7) + ((lane >> 3) & 1) * 8, b_nc = lane >> 4;

    for (int kt = 0; kt < ktiles; kt++) {
        cp_async_wait<STAGES - 2>();        // this thread's copies of tile kt have landed
        __syncthreads();                    // ... everyone's; and tile kt-1's stage is free
        if (kt + STAGES - 1 < ktiles) load_tile(kt + STAGES - 1, (kt + STAGES - 1) % STAGES);
        cp_async_commit();

        const u32 sa = smem0 + (kt % STAGES) * (A_STAGE + B_STAGE), sb = sa + A_STAGE;
        #pragma unroll
        for (int ks = 0; ks < BK / 16; ks++) {
            u32 af[MT][4], bfr[NT][2];
            #pragma unroll
            for (int i = 0; i < MT; i++)
                ldmatrix_x4(af[i][0], af[i][1], af[i][2], af[i][3],
                            sa + a_off(wm0 + i * 16 + a_row, ks * 2 + a_kc));
            #pragma unroll
            for (int j = 0; j < NT; j += 2)
                ldmatrix_x4_trans(bfr[j][0], bfr[j][1], bfr[j + 1][0], bfr[j + 1][1],
                                  sb + b_off<BN>(ks * 16 + b_krow, (wn0 + j * 8) / 8 + b_nc));
            #pragma unroll
            for (int i = 0; i < MT; i++)
                #pragma unroll
                for (int j = 0; j < NT; j++) mma_bf16_16816(acc[i][j], af[i], bfr[j][0], bfr[j][1]);
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

// Dynamic shared memory: STAGES * (BM*32 + 32*BN) * 2 bytes = 65536 for V4_CONFIG
// (ops/matmul.py GEMM_VERSIONS must agree).
#define V4_CONFIG 128, 128, 2, 4, 4
extern "C" __global__ void __launch_bounds__(256) gemm_forward_kernel_v4_bf16_f32(
        float* C, const bf16* A, const bf16* B, int M, int N, int K) {
    gemm_v4<float, V4_CONFIG>(C, A, B, M, N, K);
}
extern "C" __global__ void __launch_bounds__(256) gemm_forward_kernel_v4_bf16_bf16(
        bf16* C, const bf16* A, const bf16* B, int M, int N, int K) {
    gemm_v4<bf16, V4_CONFIG>(C, A, B, M, N, K);
}
