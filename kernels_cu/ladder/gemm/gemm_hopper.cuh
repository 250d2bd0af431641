/*
 * ladder/gemm/gemm_hopper.cuh -- what the Hopper rungs v5, v6 (wgmma.cu) and v7 (tma.cu) share:
 * the 128 x 256 x 64 block tile and its shared-memory stage sizes, the grouped raster order of
 * the tiles, the C pair stores of the accumulator layout, and the mbarrier wrappers of the
 * warp-specialized rungs (v6, v7). See wgmma.cu's header for the layouts.
 */
#pragma once
#include "common.cuh"

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
