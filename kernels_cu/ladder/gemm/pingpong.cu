/*
 * ladder/gemm/pingpong.cu -- rung v8 of the ladder: v7's TMA pipeline with PING-PONG consumers, so
 * one warpgroup's epilogue runs while the other multiplies.
 *
 * Math:   C (M, N) = A (M, K) @ B (K, N), all row-major; A, B bf16, float32 accumulation, C bf16
 *         (rounded once, to nearest even) or float32.
 * Needs:  as v7 (sm_90a, K % 8 == 0, N % 8 == 0, 16-byte aligned bases; any M), and v7's tensor maps
 *         (gpucore/ladder/gemm.py _tma_maps): A boxes 128 x 64, B boxes 64 x 64, C boxes 64 x 64.
 * Grid:   persistent, min(tiles, SMs) blocks of 384 threads walking 128 x 128 tiles in v5's
 *         grouped raster order; one block per SM (225 KB of shared memory).
 *
 * Why: v7's two consumer warpgroups share each 128 x 256 tile, so both finish its math together
 * and both write C while the tensor cores idle; at K = 768 (12 k-tiles a tile) that holds v7 at
 * 97-104% of cuBLAS gemmEx where v8 reads 106-114% (C rounded by cvt.rn.bf16x2 in both; 85-89% and
 * 88-97% with the earlier software rounding; tools/notes/matmul.md). Here each consumer warpgroup
 * owns whole 128 x 128 tiles (2 x wgmma.m64n128k16 per k-step, the same 128 accumulators a thread): the block's tiles
 * alternate between them (tile i of the block to consumer i % 2), and the producer loads the
 * stages in tile order. Consumer c starts tile i's math only once the other consumer has issued
 * all of tile i-1's (mdone[1-c], an mbarrier of 128 arrivals a phase), then signals mdone[c] after
 * its own last k-tile and writes its C (v7's staged TMA-store epilogue, 2 rounds of 64 columns)
 * while the other multiplies. The order also keeps every stage's barrier phases in sequence: a
 * consumer waits on a stage only after every earlier use of it has completed, which the parity
 * waits need. Cost: a 128 x 128 tile reads A and B for half the FLOPs of v7's 128 x 256 (32 KB a
 * k-tile for 2.1 MFLOP against 48 KB for 4.2): 1.33x the L2-to-SM bytes per FLOP.
 *
 * Shared memory: 6 stages of 32 KB (A [128][64] K-major; B 2 blocks of [64 k][64 n] MN-major; both
 * 128B-swizzled, written by TMA), then per consumer a 16 KB C staging buffer (the two 64-row
 * halves of one 64-column round, each a 64 x 64 box). Barriers: full[s] (1 arrival + 32 KB),
 * empty[s] (128 arrivals: one consumer reads a stage), mdone[2]; named barriers 1, 2 as v7.
 */
#include "common.cuh"
#include "ptx.cuh"          // smem_u32_asm
#include "wgmma.cuh"        // wgmma wrappers, descriptors, stmatrix, bulk-group waits
#include "gemm_hopper.cuh"  // raster order, C pair stores, mbarriers, TMA copies

#define BN8 128
#define STAGES8 6
#define THREADS8 384
#define A_BYTES8 (BM5 * BK5 * 2)                 // 16 KB
#define STAGE8 (A_BYTES8 + BK5 * BN8 * 2)        // 32 KB
#define C_WG_STAGE8 (BM5 * 64 * 2)               // 16 KB: one 64-column round of a 128-row tile
// Dynamic shared memory: 6 * 32 KB + 2 * 16 KB + 1 KB to align the base = 230400 (gpucore/ladder/gemm.py).

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <typename Tout>
__device__ __forceinline__ void gemm_v8(Tout* C, const unsigned char* maps, int M, int N, int K) {
    extern __shared__ unsigned char smem8[];
    __shared__ __align__(8) unsigned long long bars8[2 * STAGES8 + 2];   // full[S], empty[S], mdone[2]
    const u32 smem0 = (smem_u32_asm(smem8) + 1023u) & ~1023u;
    const u32 full0 = smem_u32_asm(bars8), empty0 = full0 + 8 * STAGES8, mdone0 = empty0 + 8 * STAGES8;
    const void* map_a = maps;
    const void* map_b = maps + 128;
    const void* map_c = maps + 256;

    const int tiles_m = (M + BM5 - 1) / BM5, tiles_n = (N + BN8 - 1) / BN8;
    const int tiles = tiles_m * tiles_n;
    const int ktiles = (K + BK5 - 1) / BK5;

    const int tid = threadIdx.x, wg = tid >> 7;
    if (tid == 0) {
        for (int s = 0; s < STAGES8; s++) {
            mbar_init6(full0 + 8 * s, 1);
            mbar_init6(empty0 + 8 * s, 128);
        }
        mbar_init6(mdone0, 128);
        mbar_init6(mdone0 + 8, 128);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {                                                    // ---- producer ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
        if (tid != 0) return;
        tensormap_acquire7(map_a);
        tensormap_acquire7(map_b);
        int it = 0;
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            int m0, n0;
            tile_origin5<BN8>(tile, tiles_m, tiles_n, m0, n0);
            for (int kt = 0; kt < ktiles; kt++, it++) {
                const int s = it % STAGES8;
                if (it >= STAGES8) mbar_wait6(empty0 + 8 * s, ((it / STAGES8) - 1) & 1);
                const u32 base = smem0 + s * STAGE8, bar = full0 + 8 * s;
                mbar_arrive_expect_tx7(bar, STAGE8);
                tma_load_2d7(base, map_a, kt * BK5, m0, bar);
                tma_load_2d7(base + A_BYTES8, map_b, n0, kt * BK5, bar);
                tma_load_2d7(base + A_BYTES8 + 8192, map_b, n0 + 64, kt * BK5, bar);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");     // ---- consumers ----
    const int c = wg - 1, lane = tid & 31, warp = (tid >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    const bool leader = (tid & 127) == 0;
    constexpr bool staged = sizeof(Tout) == 2;
    const u32 c_stage = smem0 + STAGES8 * STAGE8 + c * C_WG_STAGE8;
    if (staged && leader) tensormap_acquire7(map_c);
    const int st_row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), st_blk = lane >> 4;
    // tile i of this block (i = c, c + 2, ...) is global tile blockIdx.x + i * gridDim.x
    for (int i = c; blockIdx.x + i * gridDim.x < tiles; i += 2) {
        int m0, n0;
        tile_origin5<BN8>(blockIdx.x + i * gridDim.x, tiles_m, tiles_n, m0, n0);
        // the other consumer's tile i - 1 is phase ((i - 1) - (1 - c)) / 2 of its mdone
        if (i > 0) mbar_wait6(mdone0 + 8 * (1 - c), (((i - 1) - (1 - c)) / 2) & 1);
        float d0[64], d1[64];                                   // rows 0-63 and 64-127 of the tile
        #pragma unroll
        for (int r = 0; r < 64; r++) { d0[r] = 0.0f; d1[r] = 0.0f; }
        int it = i * ktiles;
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const int s = it % STAGES8;
            mbar_wait6(full0 + 8 * s, (it / STAGES8) & 1);
            const u32 sa = smem0 + s * STAGE8, sb = sa + A_BYTES8;
            wgmma_fence();
            #pragma unroll
            for (int ks = 0; ks < BK5 / 16; ks++) {
                const u64 db = smem_desc(sb + 2048 * ks, 8192, 1024);
                wgmma_m64n128k16_ss_kmn(d0, smem_desc(sa + 32 * ks, 16, 1024), db);
                wgmma_m64n128k16_ss_kmn(d1, smem_desc(sa + 8192 + 32 * ks, 16, 1024), db);
            }
            wgmma_commit();
            wgmma_wait<1>();
            if (kt > 0) mbar_arrive6(empty0 + 8 * ((it - 1) % STAGES8));
        }
        mbar_arrive6(mdone0 + 8 * c);                   // all of this tile's math issued: the other may start
        wgmma_wait<0>();
        mbar_arrive6(empty0 + 8 * ((it - 1) % STAGES8));
        #pragma unroll
        for (int r = 0; r < 64; r++) {
            asm volatile("" : "+f"(d0[r])::"memory");
            asm volatile("" : "+f"(d1[r])::"memory");
        }

        if constexpr (staged) {
            #pragma unroll
            for (int h = 0; h < BN8 / 64; h++) {                // rounds of 64 columns
                if (leader) bulk_wait_read<0>();
                named_barrier_sync7(1 + c, 128);
                #pragma unroll
                for (int p = 0; p < 4; p++) {                   // n8 blocks j, j + 1 of this round
                    const int j = 8 * h + 2 * p, jl = 2 * p + st_blk;
                    const u32 off = st_row * 128 + (((jl & 7) ^ (st_row & 7)) << 4);
                    stmatrix_x4(c_stage + off, cvt_rn_bf16x2(d0[4 * j], d0[4 * j + 1]),
                                cvt_rn_bf16x2(d0[4 * j + 2], d0[4 * j + 3]), cvt_rn_bf16x2(d0[4 * j + 4], d0[4 * j + 5]),
                                cvt_rn_bf16x2(d0[4 * j + 6], d0[4 * j + 7]));
                    stmatrix_x4(c_stage + 8192 + off, cvt_rn_bf16x2(d1[4 * j], d1[4 * j + 1]),
                                cvt_rn_bf16x2(d1[4 * j + 2], d1[4 * j + 3]), cvt_rn_bf16x2(d1[4 * j + 4], d1[4 * j + 5]),
                                cvt_rn_bf16x2(d1[4 * j + 6], d1[4 * j + 7]));
                }
                fence_proxy_async();
                named_barrier_sync7(1 + c, 128);
                if (leader) {
                    tma_store_2d7(map_c, n0 + 64 * h, m0, c_stage);
                    tma_store_2d7(map_c, n0 + 64 * h, m0 + 64, c_stage + 8192);
                    bulk_commit();
                }
            }
        } else {                                                // float32 C: stores from registers
            store_acc_rows5<Tout, BN8>(C, d0, m0 + warp * 16 + g, n0, t, M, N);
            store_acc_rows5<Tout, BN8>(C, d1, m0 + 64 + warp * 16 + g, n0, t, M, N);
        }
    }
    if (staged && leader) bulk_wait_done<0>();
}

#define GEMM_V8_BODY(Tout) gemm_v8<Tout>(C, maps, M, N, K)
#else
#define GEMM_V8_BODY(Tout) __trap()          // not sm_90a: Python never launches this
#endif

extern "C" __global__ void __launch_bounds__(THREADS8, 1) gemm_forward_kernel_v8_bf16_f32(
        float* C, const unsigned char* maps, int M, int N, int K) {
    GEMM_V8_BODY(float);
}
extern "C" __global__ void __launch_bounds__(THREADS8, 1) gemm_forward_kernel_v8_bf16_bf16(
        bf16* C, const unsigned char* maps, int M, int N, int K) {
    GEMM_V8_BODY(bf16);
}
