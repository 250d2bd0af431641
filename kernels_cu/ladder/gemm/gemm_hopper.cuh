/*
 * ladder/gemm/gemm_hopper.cuh -- what the Hopper rungs v5, v6 (wgmma.cu), v7 (tma.cu) and v8
 * (pingpong.cu) share: the 128 x 256 x 64 block tile and its shared-memory stage sizes, the grouped
 * raster order of the tiles, the accumulator's stores to C from registers, the mbarrier wrappers of the
 * warp-specialized rungs (v6-v8), and the TMA copies and fences (v7, v8). See wgmma.cu's header
 * for the layouts.
 */
#pragma once
#include "common.cuh"
#include "fast_packs.cuh"   // store_pair_rn, cvt_rn_bf16x2: C's bf16 rounding in one instruction a pair

#define BM5 128
#define BN5 256
#define BK5 64
#define STAGES5 4
#define GROUP_M5 8
#define A_STAGE5 (BM5 * BK5 * 2)                 // 16 KB
#define B_STAGE5 (BK5 * BN5 * 2)                 // 32 KB
#define STAGE5 (A_STAGE5 + B_STAGE5)
// v5/v6 dynamic shared memory: STAGES5 * 48 KB + 1 KB to round the base up to 1024 (= 197632;
// gpucore/ladder/gemm.py GEMM_VERSIONS must agree).

// A warpgroup's 64 x COLS wgmma accumulator d, straight from registers into C (M, N) at column n0:
// the thread holds rows `row` and row + 8 (row = the tile's first row + 16 warp + lane / 4) of each
// n8 block j at columns n0 + 8 j + 2 (lane % 4) (t). Edges: N % 8 == 0, so col < N implies col + 1 < N.
template <typename Tout, int COLS>
__device__ __forceinline__ void store_acc_rows5(Tout* C, const float* d, int row, int n0, int t, int M, int N) {
    #pragma unroll
    for (int j = 0; j < COLS / 8; j++) {
        const int col = n0 + j * 8 + 2 * t;
        if (col >= N) continue;
        if (row < M) store_pair_rn<Tout>(C + (size_t)row * N + col, d[4 * j], d[4 * j + 1]);
        if (row + 8 < M) store_pair_rn<Tout>(C + (size_t)(row + 8) * N + col, d[4 * j + 2], d[4 * j + 3]);
    }
}

// Tile `pid` of a (tiles_m x tiles_n) grid of BM5 x BN tiles in grouped raster order: groups of
// GROUP_M5 tile rows, walked column by column, so that consecutive tiles share A rows and B columns in L2.
template <int BN = BN5>
__device__ __forceinline__ void tile_origin5(int pid, int tiles_m, int tiles_n, int& m0, int& n0) {
    const int per_group = GROUP_M5 * tiles_n;
    const int first_m = (pid / per_group) * GROUP_M5;
    const int group_rows = min(tiles_m - first_m, GROUP_M5);
    m0 = (first_m + (pid % per_group) % group_rows) * BM5;
    n0 = ((pid % per_group) / group_rows) * BN;
}

__device__ __forceinline__ void mbar_init6(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait6(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_arrive6(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// arrive on `bar` when all of this thread's earlier cp.async have completed
__device__ __forceinline__ void cp_async_mbar_arrive6(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// ---- TMA (sm_90a): the copies, barriers and fences of the TMA rungs v7 (tma.cu) and v8 (pingpong.cu) ----
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// TMA load of the box at (c0 = inner/column coordinate, c1 = row) of `map` into shared memory at
// dst, completing `bytes` of transactions on mbarrier `bar` (PTX ISA "cp.async.bulk.tensor").
__device__ __forceinline__ void tma_load_2d7(u32 dst, const void* map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
// TMA store of shared memory at src to the box at (c0, c1) of `map`, in the thread's bulk group.
__device__ __forceinline__ void tma_store_2d7(const void* map, int c0, int c1, u32 src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(map),
                 "r"(c0), "r"(c1), "r"(src)
                 : "memory");
}
// This thread's arrival on `bar`, which also expects `bytes` of transactions in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx7(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// A tensor map in global memory is read through the tensormap proxy, whose cache may still hold
// a map an earlier launch left at the same address (the memory pool reuses buffers): acquire
// the generic-proxy writes (the host's copy) before the first TMA instruction that names it.
__device__ __forceinline__ void tensormap_acquire7(const void* map) {
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
}
__device__ __forceinline__ void named_barrier_sync7(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
