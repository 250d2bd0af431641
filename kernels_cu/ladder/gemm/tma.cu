/*
 * ladder/gemm/tma.cu -- rung v7 of the ladder: v6 with the Tensor Memory Accelerator (TMA) on both
 * ends -- one thread loads each stage, and C leaves through shared memory while the next tile runs.
 *
 * Math:   C (M, N) = A (M, K) @ B (K, N), all row-major; A, B bf16, float32 accumulation, C bf16
 *         (rounded once, to nearest even) or float32.
 * Needs:  an sm_90 GPU (compiled for sm_90a), K % 8 == 0 and N % 8 == 0 (TMA's row strides are
 *         multiples of 16 bytes), 16-byte aligned bases; any M. Checked in gpucore/ladder/gemm.py.
 * Args:   `maps`: three 128-byte CUtensorMaps in global memory (gpucore/ladder/tma.py encodes them
 *         with the driver's cuTensorMapEncodeTiled): A as boxes of 128 rows x 64 k, B as boxes of
 *         64 k-rows x 64 n, C as boxes of 64 rows x 64 n; all 128B-swizzled. (A map could be a
 *         __grid_constant__ parameter; CuPy passes no 128-byte structs, and a map read from
 *         global memory needs only the fence.proxy.tensormap below.)
 * Grid:   persistent, min(tiles, SMs) blocks of 384 threads walking 128 x BN tiles (BN = 256, or
 *         192 where that takes fewer waves) in v5's grouped raster order (gemm_hopper.cuh); one
 *         block per SM (217-225 KB of shared memory).
 *
 * Why (what held v6 at 60-67% of cuBLAS at K = 768, tools/notes/matmul.md):
 * 1. The loads. v6's producer warpgroup issues 24 cp.async of 16 bytes per thread and stage, each
 *    with its own address; a TMA copy is ONE instruction per box, the address math and the 128-byte
 *    swizzle done by the copy engine, and out-of-bounds elements zero-filled (no edge-tile path).
 *    One producer thread now arms full[s] with the stage's byte count (mbarrier.expect_tx) and
 *    issues 5 copies (A: one 16 KB box; B: four 8 KB boxes of 64 columns); the barrier completes
 *    when all 48 KB have landed. TMA writes through the async proxy, as wgmma reads: no proxy fence.
 * 2. The epilogue. With K = 768 a tile has 12 k-tiles (~7 us of math) and v6's consumers then
 *    spend ~2-4 us storing 64 KB of C straight from registers while the tensor cores idle. Here
 *    each consumer warpgroup writes its 64 x 256 part to shared memory with stmatrix (4 8x8
 *    matrices per instruction, the 128B-swizzled layout: no bank conflicts) in two rounds of
 *    128 columns, and one thread hands each round to a TMA store (cp.async.bulk.tensor, clipped
 *    at the matrix edges) that drains it while the warpgroup goes on to the next tile's math. The
 *    staging buffer is reused only once the previous store has read it (bulk wait_group.read).
 *    C float32 keeps v6's direct stores (its tile would need twice the staging memory).
 *    Still, both warpgroups stage C at the same time while the tensor cores idle: at K = 768 v7
 *    read 85-89% of cuBLAS with C rounded in software, 97-104% with cvt.rn.bf16x2 (47th session).
 *    v8 (pingpong.cu) gives each warpgroup its own tiles to hide that: 106-114% there.
 * 3. The waves. A persistent grid of 132 blocks over 192 tiles of 128 x 256 (the LM head's dx,
 *    8192 x 50304 @ 50304 x 768) runs 1.45 waves: the second one three-quarters idle. 128 x 192
 *    blocks (wgmma m64n192k16, 96 accumulators a thread) make it 256 tiles, 1.94 waves: 77% -> 104%
 *    of cuBLAS there. gemm.py picks the width with fewer (waves x width) and 256 on a tie.
 *
 * Shared memory: the stages (v6's layouts: A [128][64] K-major, B as BN / 64 blocks of [64 k][64 n]
 * MN-major, both 128B-swizzled -- exactly what the TMA boxes with CU_TENSOR_MAP_SWIZZLE_128B
 * write), then the C staging buffer: per consumer warpgroup epi_cols / 64 boxes of [64 rows][64 n]
 * bf16, the same swizzle (V7Config below). Barriers: full[s] (1 arrival + the stage's bytes of
 * transactions), empty[s] (256 consumer arrivals, as v6); named barriers 1 and 2 order each
 * consumer warpgroup's staging writes against its TMA stores.
 */
#include "common.cuh"
#include "ptx.cuh"          // smem_u32_asm
#include "wgmma.cuh"        // wgmma wrappers, descriptors, stmatrix, bulk-group waits
#include "gemm_hopper.cuh"  // the 128x256x64 tile, raster order, C pair stores, mbarriers

// Two block tiles, 128 x BN with BN = 256 or 192 (gemm.py picks per shape, fewer waves first):
//   BN 256: 48 KB stages x 4, C staged in 2 rounds of 128 columns (2 x 16 KB): 230400 B of smem;
//   BN 192: 40 KB stages x 5, C staged in 3 rounds of 64 columns (2 x 8 KB): 222208 B.
// (Measured on an H200: at BN 256, 4 stages and 2 x 128 columns beat 3 stages and 1 x 256 by 1-5%
// and 4 x 64 columns by 1-5%; at BN 192 the 5-stage layout led the 4-stage 1 x 192 by 0-1.5%.)
#define THREADS7 384
template <int BN>
struct V7Config {
    static constexpr int stages = BN == 256 ? 4 : 5;
    static constexpr int epi_cols = BN == 256 ? 128 : 64;        // C columns staged per round
    static constexpr u32 stage_bytes = A_STAGE5 + BK5 * BN * 2;   // 48 / 40 KB: multiples of 1024
    static constexpr u32 c_wg_bytes = 64 * epi_cols * 2;         // one consumer warpgroup's staging
};
#define MAX_STAGES7 5
// Dynamic shared memory: stages * stage_bytes + 2 * c_wg_bytes + 1 KB to align the base (must agree
// with gpucore/ladder/gemm.py V7_SMEM).

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <typename Tout, int BN7>
__device__ __forceinline__ void gemm_v7(Tout* C, const unsigned char* maps, int M, int N, int K) {
    using Cfg = V7Config<BN7>;
    constexpr int STAGES7 = Cfg::stages, EPI_COLS7 = Cfg::epi_cols;
    constexpr u32 STAGE7 = Cfg::stage_bytes, C_WG_STAGE7 = Cfg::c_wg_bytes;
    extern __shared__ unsigned char smem7[];
    __shared__ __align__(8) unsigned long long bars7[2 * MAX_STAGES7];  // full[0..S), empty[0..S)
    const u32 smem0 = (smem_u32_asm(smem7) + 1023u) & ~1023u;          // swizzle atoms: 1024-aligned
    const u32 full0 = smem_u32_asm(bars7), empty0 = full0 + 8 * STAGES7;
    const void* map_a = maps;
    const void* map_b = maps + 128;
    const void* map_c = maps + 256;

    const int tiles_m = (M + BM5 - 1) / BM5, tiles_n = (N + BN7 - 1) / BN7;
    const int tiles = tiles_m * tiles_n;
    const int ktiles = (K + BK5 - 1) / BK5;

    const int tid = threadIdx.x, wg = tid >> 7;
    if (tid == 0) {
        for (int s = 0; s < STAGES7; s++) {
            mbar_init6(full0 + 8 * s, 1);
            mbar_init6(empty0 + 8 * s, 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {                                                    // ---- producer ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
        if (tid != 0) return;                                         // one thread issues every copy
        tensormap_acquire7(map_a);
        tensormap_acquire7(map_b);
        int it = 0;                                                   // k-tiles handed over (all tiles)
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            int m0, n0;
            tile_origin5<BN7>(tile, tiles_m, tiles_n, m0, n0);
            for (int kt = 0; kt < ktiles; kt++, it++) {
                const int s = it % STAGES7;
                if (it >= STAGES7) mbar_wait6(empty0 + 8 * s, ((it / STAGES7) - 1) & 1);
                const u32 base = smem0 + s * STAGE7, bar = full0 + 8 * s;
                mbar_arrive_expect_tx7(bar, STAGE7);                  // edge boxes count whole: zero-filled
                tma_load_2d7(base, map_a, kt * BK5, m0, bar);
                #pragma unroll
                for (int nb = 0; nb < BN7 / 64; nb++)
                    tma_load_2d7(base + A_STAGE5 + nb * 8192, map_b, n0 + 64 * nb, kt * BK5, bar);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");     // ---- consumers ----
    const int c = wg - 1, lane = tid & 31, warp = (tid >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    const bool leader = (tid & 127) == 0;                       // issues this warpgroup's TMA stores
    constexpr bool staged = sizeof(Tout) == 2;
    const u32 c_stage = smem0 + STAGES7 * STAGE7 + c * C_WG_STAGE7;
    if (staged && leader) tensormap_acquire7(map_c);
    // stmatrix: lanes 8m..8m+7 address the rows of matrix m = (rows +8 (m & 1), n8 block +(m >> 1)).
    const int st_row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), st_blk = lane >> 4;
    int it = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int m0, n0;
        tile_origin5<BN7>(tile, tiles_m, tiles_n, m0, n0);
        float d[BN7 / 2];                                 // 64 x BN7 per warpgroup: BN7 / 2 a thread
        #pragma unroll
        for (int i = 0; i < BN7 / 2; i++) d[i] = 0.0f;
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const int s = it % STAGES7;
            mbar_wait6(full0 + 8 * s, (it / STAGES7) & 1);
            const u32 sa = smem0 + s * STAGE7 + c * (64 * 128);
            const u32 sb = smem0 + s * STAGE7 + A_STAGE5;
            wgmma_fence();
            #pragma unroll
            for (int ks = 0; ks < BK5 / 16; ks++)
                if constexpr (BN7 == 256)
                    wgmma_m64n256k16(d, smem_desc(sa + 32 * ks, 16, 1024), smem_desc(sb + 2048 * ks, 8192, 1024));
                else
                    wgmma_m64n192k16(d, smem_desc(sa + 32 * ks, 16, 1024), smem_desc(sb + 2048 * ks, 8192, 1024));
            wgmma_commit();
            wgmma_wait<1>();                 // the previous k-tile's group has retired: its stage is free
            if (kt > 0) mbar_arrive6(empty0 + 8 * ((it - 1) % STAGES7));
        }
        wgmma_wait<0>();
        mbar_arrive6(empty0 + 8 * ((it - 1) % STAGES7));      // the tile's last stage
        #pragma unroll
        for (int i = 0; i < BN7 / 2; i++) asm volatile("" : "+f"(d[i])::"memory");

        if constexpr (staged) {
            #pragma unroll
            for (int h = 0; h < BN7 / EPI_COLS7; h++) {
                if (leader) bulk_wait_read<0>();            // the last store has read the buffer ...
                named_barrier_sync7(1 + c, 128);            // ... before anyone overwrites it
                #pragma unroll
                for (int p = 0; p < EPI_COLS7 / 16; p++) {  // n8 blocks j, j + 1 of this round
                    const int j = h * (EPI_COLS7 / 8) + 2 * p, jl = 2 * p + st_blk;
                    const u32 addr = c_stage + (jl >> 3) * 8192 + st_row * 128 + (((jl & 7) ^ (st_row & 7)) << 4);
                    stmatrix_x4(addr, cvt_rn_bf16x2(d[4 * j], d[4 * j + 1]), cvt_rn_bf16x2(d[4 * j + 2], d[4 * j + 3]),
                                cvt_rn_bf16x2(d[4 * j + 4], d[4 * j + 5]), cvt_rn_bf16x2(d[4 * j + 6], d[4 * j + 7]));
                }
                fence_proxy_async();                        // st.shared -> the TMA store's async-proxy read
                named_barrier_sync7(1 + c, 128);
                if (leader) {
                    #pragma unroll
                    for (int b = 0; b < EPI_COLS7 / 64; b++)
                        tma_store_2d7(map_c, n0 + h * EPI_COLS7 + 64 * b, m0 + 64 * c, c_stage + b * 8192);
                    bulk_commit();
                }
            }
        } else {                                            // float32 C: v6's stores from registers
            store_acc_rows5<Tout, BN7>(C, d, m0 + c * 64 + warp * 16 + g, n0, t, M, N);
        }
    }
    if (staged && leader) bulk_wait_done<0>();              // the block's shared memory outlives the stores
}

#define GEMM_V7_BODY(Tout, BN) gemm_v7<Tout, BN>(C, maps, M, N, K)
#else
#define GEMM_V7_BODY(Tout, BN) __trap()          // not sm_90a: Python never launches this
#endif

// v7: 128 x 256 blocks; v7n192: 128 x 192 blocks (gpucore/ladder/gemm.py picks).
#define GEMM_V7_KERNEL(name, Tout, BN)                                                               \
    extern "C" __global__ void __launch_bounds__(THREADS7, 1) name(Tout* C, const unsigned char* maps, \
                                                                   int M, int N, int K) {            \
        GEMM_V7_BODY(Tout, BN);                                                                      \
    }
GEMM_V7_KERNEL(gemm_forward_kernel_v7_bf16_f32, float, 256)
GEMM_V7_KERNEL(gemm_forward_kernel_v7_bf16_bf16, bf16, 256)
GEMM_V7_KERNEL(gemm_forward_kernel_v7n192_bf16_f32, float, 192)
GEMM_V7_KERNEL(gemm_forward_kernel_v7n192_bf16_bf16, bf16, 192)
