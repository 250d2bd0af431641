/*
 * ladder/gemm/wgmma.cu -- rungs v5 and v6 of the ladder: Hopper's warpgroup MMA (wgmma.mma_async, sm_90a);
 * v6 (at the end) is v5 warp-specialized: a producer warpgroup and mbarrier-handed stages.
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
#include "ptx.cuh"       // smem_u32_asm, cp.async
#include "wgmma.cuh"     // wgmma wrappers, descriptors, fences (shared with attention v3)
#include "gemm_hopper.cuh"  // the 128x256x64 tile, its raster order, C stores, mbarriers (shared with v7)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <typename Tout>
__device__ __forceinline__ void gemm_v5(Tout* C, const bf16* A, const bf16* B, int M, int N, int K) {   // (M,N) (M,K) (K,N)
    extern __shared__ unsigned char smem5[];
    const u32 smem0 = (smem_u32_asm(smem5) + 1023u) & ~1023u;  // swizzle atoms need 1024-byte alignment

    int m0, n0;
    tile_origin5(blockIdx.x, (M + BM5 - 1) / BM5, (N + BN5 - 1) / BN5, m0, n0);

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
            cp_async16(base + a_dst + 4096 * i, ok ? src : A, ok ? 16 : 0);
        }
        #pragma unroll
        for (int i = 0; i < 8; i++) {
            const bool ok = b_col_ok && k0 + b_r0 + 8 * i < K;
            const bf16* src = b_src + (size_t)(k0 + 8 * i) * N;
            cp_async16(base + b_dst + 1024 * i, ok ? src : B, ok ? 16 : 0);
        }
    };

    float d[128];
    #pragma unroll
    for (int i = 0; i < 128; i++) d[i] = 0.0f;

    const int ktiles = (K + BK5 - 1) / BK5;
    #pragma unroll
    for (int s = 0; s < STAGES5 - 2; s++) {                 // tiles 0 .. STAGES5-3: group index = tile index
        if (s < ktiles) load_tile(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; kt++) {
        cp_async_wait<STAGES5 - 3>();        // groups 0..kt complete: this thread's tile kt landed
        fence_proxy_async();                 // ... visible to the async proxy (wgmma)
        __syncthreads();                     // ... for every thread; all tile kt-2 wgmma retired
        if (kt + STAGES5 - 2 < ktiles) load_tile(kt + STAGES5 - 2, (kt + STAGES5 - 2) % STAGES5);
        cp_async_commit();                   // (empty groups keep the count uniform)
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
    cp_async_wait<0>();

    const int g = lane >> 2, t = lane & 3;
    store_acc_rows5<Tout, BN5>(C, d, m0 + wg * 64 + (warp & 3) * 16 + g, n0, t, M, N);
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

// ---------------------------------------------------------------------------------------------
// v6: the same block tile and shared-memory layout as v5, warp-specialized and persistent. 384 threads:
// warpgroup 0 is the PRODUCER (only copies), warpgroups 1 and 2 are CONSUMERS (only wgmma;
// consumer c owns C rows 64c..64c+63). v5's every thread copies, waits for its copies and meets
// every other thread at a __syncthreads per k-tile, so the tensor cores idle while the slowest
// warp catches up. Here the stages are handed over by mbarriers, two per stage:
//   full[s]  (count 128): each producer thread's cp.async.mbarrier.arrive.noinc fires when ITS
//            copies into stage s have landed; the phase completes when all 128 have.
//   empty[s] (count 256): each consumer thread arrives once the wgmma group that read stage s
//            has retired (wgmma_wait<1> after the next k-tile's group is issued).
// With `it` counting k-tiles over all of a block's tiles, use u = it / STAGES6 of stage s is phase
// u of both barriers: consumers wait full[s] with parity u & 1, the producer waits empty[s] with
// parity (u - 1) & 1 before refilling it.
// setmaxnreg moves registers from the producer (56) to the consumers (224: 128 accumulators).
// After the wait, a consumer's fence.proxy.async makes the (generic-proxy) cp.async writes
// that the barrier published visible to its (async-proxy) wgmma reads.
// Persistent: the grid is min(tiles, SMs) blocks walking tiles blockIdx.x, + gridDim.x, ...
// (v5's raster order, tile_origin5), so the producer runs on into the next tile while the consumers write this one's C (with K = 768, 12 k-tiles
// per tile, a non-persistent block spends a fifth of its time filling and draining).
#define STAGES6 4
#define THREADS6 384

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <typename Tout>
__device__ __forceinline__ void gemm_v6(Tout* C, const bf16* A, const bf16* B, int M, int N, int K) {   // (M,N) (M,K) (K,N)
    extern __shared__ unsigned char smem6[];
    __shared__ __align__(8) unsigned long long bars6[2 * STAGES6];      // full[0..S), empty[0..S)
    const u32 smem0 = (smem_u32_asm(smem6) + 1023u) & ~1023u;
    const u32 full0 = smem_u32_asm(bars6), empty0 = full0 + 8 * STAGES6;

    const int tiles_m = (M + BM5 - 1) / BM5, tiles_n = (N + BN5 - 1) / BN5;
    const int tiles = tiles_m * tiles_n;
    const int ktiles = (K + BK5 - 1) / BK5;

    const int tid = threadIdx.x, wg = tid >> 7;
    if (tid == 0) {
        for (int s = 0; s < STAGES6; s++) {
            mbar_init6(full0 + 8 * s, 128);
            mbar_init6(empty0 + 8 * s, 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {                                                    // ---- producer ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
        const int p = tid;
        // A: chunk column a_c (8 k) of rows a_r0 + 16 i, i < 8. B: chunk column b_c (8 n) of
        // k-rows b_r0 + 4 i, i < 16 (k-row & 7 = b_r0 + 4 (i & 1), b_r0 < 4).
        const int a_r0 = p >> 3, a_c = p & 7, b_r0 = p >> 5, b_c = p & 31;
        const u32 a_dst = a_r0 * 128 + ((a_c ^ (a_r0 & 7)) << 4);       // + 2048 i
        const u32 a_row_step = 16u * K * 2, b_row_step = 4u * N * 2;
        const u32 b_dst_even = A_STAGE5 + (b_c >> 3) * 8192 + b_r0 * 128 + (((b_c & 7) ^ b_r0) << 4);
        const u32 b_dst_odd = A_STAGE5 + (b_c >> 3) * 8192 + b_r0 * 128 + (((b_c & 7) ^ (b_r0 + 4)) << 4);
        int it = 0;                                      // k-tiles handed over so far (all tiles)
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            int m0, n0;
            tile_origin5(tile, tiles_m, tiles_n, m0, n0);
            const bf16* a_src = A + (size_t)(m0 + a_r0) * K + a_c * 8;
            const bf16* b_src = B + (size_t)b_r0 * N + n0 + b_c * 8;
            const bool b_col_ok = n0 + b_c * 8 < N;
            // Fast path (whole tile inside the matrices): no bounds checks, no zero-fill, and every
            // source address one IMAD.WIDE off a pointer that advances per k-tile -- a single warp
            // per scheduler issues all copies, so its instruction count per tile is the budget
            // (with v5's per-copy index math and checks, this warpgroup could not keep up).
            const bool mn_inside = m0 + BM5 <= M && n0 + BN5 <= N;
            const char* a_tile = reinterpret_cast<const char*>(a_src);   // advances BK5 * 2 bytes per k-tile
            const char* b_tile = reinterpret_cast<const char*>(b_src);   // advances BK5 * N * 2 bytes
            for (int kt = 0; kt < ktiles; kt++, it++, a_tile += BK5 * 2, b_tile += (size_t)BK5 * N * 2) {
                const int s = it % STAGES6;
                if (it >= STAGES6) mbar_wait6(empty0 + 8 * s, ((it / STAGES6) - 1) & 1);
                const int k0 = kt * BK5;
                const u32 base = smem0 + s * STAGE5;
                if (mn_inside && k0 + BK5 <= K) {
                    #pragma unroll
                    for (int i = 0; i < 8; i++) cp_async16(base + a_dst + 2048 * i, a_tile + i * a_row_step, 16);
                    #pragma unroll
                    for (int i = 0; i < 16; i++)
                        cp_async16(base + ((i & 1) ? b_dst_odd : b_dst_even) + 512 * i, b_tile + i * b_row_step, 16);
                    cp_async_mbar_arrive6(full0 + 8 * s);
                    continue;
                }
                const bool a_k_ok = k0 + a_c * 8 < K;       // edge tiles: checked, zero-filled
                #pragma unroll
                for (int i = 0; i < 8; i++) {
                    const bool ok = a_k_ok && m0 + a_r0 + 16 * i < M;
                    cp_async16(base + a_dst + 2048 * i, ok ? a_src + (size_t)(16 * i) * K + k0 : A, ok ? 16 : 0);
                }
                #pragma unroll
                for (int i = 0; i < 16; i++) {
                    const int kr = b_r0 + 4 * i;
                    const bool ok = b_col_ok && k0 + kr < K;
                    cp_async16(base + ((i & 1) ? b_dst_odd : b_dst_even) + 512 * i,
                                 ok ? b_src + (size_t)(k0 + 4 * i) * N : B, ok ? 16 : 0);
                }
                cp_async_mbar_arrive6(full0 + 8 * s);
            }
        }
        cp_async_wait<0>();
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");     // ---- consumers ----
    const int c = wg - 1, lane = tid & 31, warp = (tid >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    int it = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int m0, n0;
        tile_origin5(tile, tiles_m, tiles_n, m0, n0);
        float d[128];
        #pragma unroll
        for (int i = 0; i < 128; i++) d[i] = 0.0f;
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const int s = it % STAGES6;
            mbar_wait6(full0 + 8 * s, (it / STAGES6) & 1);
            fence_proxy_async();
            const u32 sa = smem0 + s * STAGE5 + c * (64 * 128);
            const u32 sb = smem0 + s * STAGE5 + A_STAGE5;
            wgmma_fence();
            #pragma unroll
            for (int ks = 0; ks < BK5 / 16; ks++)
                wgmma_m64n256k16(d, smem_desc(sa + 32 * ks, 16, 1024), smem_desc(sb + 2048 * ks, 8192, 1024));
            wgmma_commit();
            wgmma_wait<1>();                 // the previous k-tile's group has retired: its stage is free
            if (kt > 0) mbar_arrive6(empty0 + 8 * ((it - 1) % STAGES6));
        }
        wgmma_wait<0>();
        mbar_arrive6(empty0 + 8 * ((it - 1) % STAGES6));      // the tile's last stage
        #pragma unroll
        for (int i = 0; i < 128; i++) asm volatile("" : "+f"(d[i])::"memory");

        // Epilogue straight from the accumulators; meanwhile the producer fills the next tile's stages.
        store_acc_rows5<Tout, BN5>(C, d, m0 + c * 64 + warp * 16 + g, n0, t, M, N);
    }
}

#define GEMM_V6_BODY(Tout) gemm_v6<Tout>(C, A, B, M, N, K)
#else
#define GEMM_V6_BODY(Tout) __trap()
#endif

extern "C" __global__ void __launch_bounds__(THREADS6, 1) gemm_forward_kernel_v6_bf16_f32(
        float* C, const bf16* A, const bf16* B, int M, int N, int K) {
    GEMM_V6_BODY(float);
}
extern "C" __global__ void __launch_bounds__(THREADS6, 1) gemm_forward_kernel_v6_bf16_bf16(
        bf16* C, const bf16* A, const bf16* B, int M, int N, int K) {
    GEMM_V6_BODY(bf16);
}
