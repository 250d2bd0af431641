/*
 * gemm_wgmma.cu -- rung v5 of the ladder: Hopper's warpgroup MMA (wgmma.mma_async, sm_90a).
 *
 * Math:   C (M, N) = A (M, K) @ B (K, N), all row-major; A, B bf16, float32
 *         accumulation, C float32 or bf16 (rounded once, to nearest even).
 * Needs:  an sm_90 GPU (compiled for sm_90a: ops/matmul.py loads it with arch "90a"),
 *         K % 8 == 0 and N % 8 == 0, 16-byte aligned bases (checked in Python). Any M.
 *         Compiled for anything else (kernels check --arch 80/90) the kernels trap.
 * Grid:   1-D, ceil(M/128) * ceil(N/256) blocks in GROUP_M5 raster groups (as v4).
 *
 * Why: mma.sync (v4*) makes every warp pull its fragments out of shared memory with
 * ldmatrix -- 128 bytes of shared-memory traffic per m16n8k16 even with 64x64 warp tiles,
 * the whole port at the tensor cores' rate -- and issue one instruction per 16x8x16.
 * wgmma reads both operands straight from shared memory, 64 x 256 x 16 per instruction
 * for a warpgroup (4 warps), asynchronously: the warps issue copies while it runs.
 *
 * Block 128 x 256 x 64, 256 threads = 2 warpgroups; warpgroup w owns C rows 64w..64w+63
 * and all 256 columns: per k-tile 4 x wgmma.m64n256k16 (128 float accumulators per thread).
 * Pipeline: STAGES5 = 4 shared-memory stages of 48 KB filled by cp.async.cg (all 256
 * threads copy, 12 x 16 bytes each per tile). Iteration kt:
 *   wait for tile kt (cp.async.wait_group) -> fence.proxy.async (cp.async writes through
 *   the generic proxy, wgmma reads through the async proxy) -> __syncthreads (everyone's
 *   tile kt is visible; every warpgroup has retired tile kt-2's wgmma) -> copy tile kt+2
 *   into tile kt-2's stage -> wgmma x 4 on tile kt -> commit -> wait until at most one
 *   wgmma group (tile kt's) is in flight, i.e. tile kt-1's have retired.
 * So one tile's wgmma overlaps the next tile's barrier, and copies run two tiles ahead.
 *
 * Shared memory, per stage (1024-byte aligned: a 128B-swizzle atom is 8 rows x 128 B):
 *   A [128][64] bf16, K-major, 128-byte rows: chunk c (8 k) of row m at chunk c ^ (m & 7).
 *     wgmma descriptor (K-major, SWIZZLE_128B): start = A + 64 w rows, LBO = 16 B (unused),
 *     SBO = 1024 B (next 8 rows); k-step ks: start + 32 ks bytes (inside the atom: the
 *     hardware swizzles the final address, so only the atom base must be aligned).
 *   B [4 blocks of 64 n][64 k][64 n] bf16, N-major ("MN-major", wgmma's transposed B):
 *     chunk c (8 n) of k-row k of block nb at nb * 8192 + k * 128 + 16 * (c ^ (k & 7)).
 *     Descriptor (MN-major, SWIZZLE_128B): LBO = 8192 B (next 64 columns), SBO = 1024 B
 *     (next 8 k-rows); k-step ks: start + 2048 ks bytes. imm-trans-b = 1.
 * Descriptor bits: [0,14) start >> 4, [16,30) LBO >> 4, [32,46) SBO >> 4, [62,64) 1 = 128B swizzle.
 * Accumulators (PTX ISA, wgmma D fragments, f32): warp i of the warpgroup holds rows
 *   16i..16i+15; lane 4g+t holds, for n8-block j, d[4j..4j+1] = C[g][8j+2t, +1] and
 *   d[4j+2..4j+3] = C[g+8][8j+2t, +1] -- the m16n8 layout of mma.sync, 32 times over.
 */
#include "common.cuh"
#include "wgmma.cuh"     // wgmma wrappers, descriptors, fences (shared with attention v3)

#define BM5 128
#define BN5 256
#define BK5 64
#define STAGES5 4
#define GROUP_M5 8
#define A_STAGE5 (BM5 * BK5 * 2)                 // 16 KB
#define B_STAGE5 (BK5 * BN5 * 2)                 // 32 KB
#define STAGE5 (A_STAGE5 + B_STAGE5)
// Dynamic shared memory: STAGES5 * 48 KB + 1 KB to round the base up to 1024 (= 197632;
// ops/matmul.py GEMM_VERSIONS must agree).

__device__ __forceinline__ u32 smem_u32_5(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void cp_async16_5(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit_5() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait_5() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

template <typename Tout>
__device__ __forceinline__ void store2_5(Tout* p, float x, float y);
template <>
__device__ __forceinline__ void store2_5<float>(float* p, float x, float y) {
    *reinterpret_cast<float2*>(p) = make_float2(x, y);
}
template <>
__device__ __forceinline__ void store2_5<bf16>(bf16* p, float x, float y) {
    *reinterpret_cast<u32*>(p) = pack_bf16x2(x, y);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <typename Tout>
__device__ __forceinline__ void gemm_v5(Tout* C, const bf16* A, const bf16* B, int M, int N, int K) {   // (M,N) (M,K) (K,N)
    extern __shared__ unsigned char smem5[];
    const u32 smem0 = (smem_u32_5(smem5) + 1023u) & ~1023u;   // swizzle atoms need 1024-byte alignment

    const int tiles_m = (M + BM5 - 1) / BM5, tiles_n = (N + BN5 - 1) / BN5;
    const int pid = blockIdx.x;
    const int per_group = GROUP_M5 * tiles_n;
    const int first_m = (pid / per_group) * GROUP_M5;
    const int group_rows = min(tiles_m - first_m, GROUP_M5);
    const int bm = first_m + (pid % per_group) % group_rows;
    const int bn = (pid % per_group) / group_rows;
    const int m0 = bm * BM5, n0 = bn * BN5;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2;                                    // warpgroup: C rows 64 wg ..

    // Copies. A: chunk column a_c (8 k) of rows a_r0 + 32 i, i < 4.
    // B: chunk column b_c (8 n, 0..31) of k-rows b_r0 + 8 i, i < 8.
    const int a_r0 = tid >> 3, a_c = tid & 7;
    const int b_r0 = tid >> 5, b_c = tid & 31;
    const u32 a_dst = a_r0 * 128 + ((a_c ^ (a_r0 & 7)) << 4);                       // + 4096 i
    const u32 b_dst = A_STAGE5 + (b_c >> 3) * 8192 + b_r0 * 128 + (((b_c & 7) ^ (b_r0 & 7)) << 4);  // + 1024 i
    const bf16* a_src = A + (size_t)(m0 + a_r0) * K + a_c * 8;
    const bf16* b_src = B + (size_t)b_r0 * N + n0 + b_c * 8;
    const bool b_col_ok = n0 + b_c * 8 < N;

    auto load_tile = [&](int kt, int s) {
        const int k0 = kt * BK5;
        const u32 base = smem0 + s * STAGE5;
        const bool a_k_ok = k0 + a_c * 8 < K;
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            const bool ok = a_k_ok && m0 + a_r0 + 32 * i < M;
            const bf16* src = a_src + (size_t)(32 * i) * K + k0;
            cp_async16_5(base + a_dst + 4096 * i, ok ? src : A, ok ? 16 : 0);
        }
        #pragma unroll
        for (int i = 0; i < 8; i++) {
            const bool ok = b_col_ok && k0 + b_r0 + 8 * i < K;
            const bf16* src = b_src + (size_t)(k0 + 8 * i) * N;
            cp_async16_5(base + b_dst + 1024 * i, ok ? src : B, ok ? 16 : 0);
        }
    };

    float d[128];
    #pragma unroll
    for (int i = 0; i < 128; i++) d[i] = 0.0f;

    const int ktiles = (K + BK5 - 1) / BK5;
    #pragma unroll
    for (int s = 0; s < STAGES5 - 2; s++) {                 // tiles 0 .. STAGES5-3: group index = tile index
        if (s < ktiles) load_tile(s, s);
        cp_async_commit_5();
    }
    for (int kt = 0; kt < ktiles; kt++) {
        cp_async_wait_5<STAGES5 - 3>();      // groups 0..kt complete: this thread's tile kt landed
        fence_proxy_async();                 // ... visible to the async proxy (wgmma)
        __syncthreads();                     // ... for every thread; all tile kt-2 wgmma retired
        if (kt + STAGES5 - 2 < ktiles) load_tile(kt + STAGES5 - 2, (kt + STAGES5 - 2) % STAGES5);
        cp_async_commit_5();                 // (empty groups keep the count uniform)
        const u32 sa = smem0 + (kt % STAGES5) * STAGE5 + wg * (64 * 128);
        const u32 sb = smem0 + (kt % STAGES5) * STAGE5 + A_STAGE5;
        wgmma_fence();
        #pragma unroll
        for (int ks = 0; ks < BK5 / 16; ks++)
            wgmma_m64n256k16(d, smem_desc(sa + 32 * ks, 16, 1024), smem_desc(sb + 2048 * ks, 8192, 1024));
        wgmma_commit();
        wgmma_wait<1>();                     // tile kt-1's group has retired (tile kt's may run on)
    }
    wgmma_wait<0>();
    #pragma unroll
    for (int i = 0; i < 128; i++) asm volatile("" : "+f"(d[i])::"memory");   // no read of d before the wait
    cp_async_wait_5<0>();

    const int g = lane >> 2, t = lane & 3;
    const int row = m0 + wg * 64 + (warp & 3) * 16 + g;
    #pragma unroll
    for (int j = 0; j < BN5 / 8; j++) {
        const int col = n0 + j * 8 + 2 * t;
        if (col >= N) continue;              // N % 8 == 0: col < N implies col + 1 < N
        if (row < M) store2_5<Tout>(C + (size_t)row * N + col, d[4 * j], d[4 * j + 1]);
        if (row + 8 < M) store2_5<Tout>(C + (size_t)(row + 8) * N + col, d[4 * j + 2], d[4 * j + 3]);
    }
}

#define GEMM_V5_BODY(Tout) gemm_v5<Tout>(C, A, B, M, N, K)
#else
#define GEMM_V5_BODY(Tout) __trap()          // not sm_90a: Python never launches this
#endif

extern "C" __global__ void __launch_bounds__(256, 1) gemm_forward_kernel_v5_bf16_f32(
        float* C, const bf16* A, const bf16* B, int M, int N, int K) {
    GEMM_V5_BODY(float);
}
extern "C" __global__ void __launch_bounds__(256, 1) gemm_forward_kernel_v5_bf16_bf16(
        bf16* C, const bf16* A, const bf16* B, int M, int N, int K) {
    GEMM_V5_BODY(bf16);
}
