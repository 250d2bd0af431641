/*
 * ladder/gemm/cluster.cu -- rung v9 of the ladder: v8's ping-pong pipeline run by CLUSTERS of two
 * blocks that share the B operand: each block loads half of a k-tile's B and the TMA unit
 * MULTICASTS it into both blocks' shared memory.
 *
 * Math:   C (M, N) = A (M, K) @ B (K, N), all row-major; A, B bf16, float32 accumulation, C bf16
 *         (rounded once, to nearest even) or float32. Bit for bit v8's C (same k order).
 * Needs:  as v8 (sm_90a, K % 8 == 0, N % 8 == 0, 16-byte aligned bases; any M), and v7's tensor maps.
 * Grid:   2 x min(pairs, SMs / 2) blocks of 384 threads in clusters of 2 (__cluster_dims__), one block
 *         an SM. A cluster walks PAIRS of 128 x 128 tiles -- rows m, m + 128 of one column n -- in
 *         v5's grouped raster order over the 256 x 128 pair grid; block rank r takes row m + 128 r.
 *
 * Why: v8's 128 x 128 tiles read 1.33x the operand bytes per FLOP of v7's 128 x 256 tiles, which
 * cost it 3-12 points of cuBLAS at long K (tools/notes/matmul.md, 45th session). The two tiles of a
 * pair need the same B k-tile (64 k x 128 n): block r loads its 64-column half once from L2 and
 * multicasts it to both blocks, so the L2-to-SM bytes per FLOP fall back to v7's (A 16 KB + half of
 * B 8 KB a block and k-tile: 24 KB for 2.1 MFLOP), with v8's hidden epilogue kept. This is what
 * CUTLASS's Hopper kernels and cuBLAS's "cluster 2x1" algorithms do.
 *
 * What changes against v8 (everything else is v8's, see pingpong.cu):
 * - full[s] still expects 32 KB: A from this block, B's two halves, one from each block's multicast.
 *   The peer's half may land before this block's producer armed the phase; the barrier's
 *   transaction count may go below zero within a phase, and the phase cannot complete before the
 *   local producer's arrival, so that is sound.
 * - empty[s] counts 8 arrivals a phase: one per consumer warp (lane 0 after __syncwarp) of BOTH
 *   blocks, because the next write of stage s lands in both blocks' shared memory. The remote
 *   arrival goes through `mapa` + `mbarrier.arrive.release.cluster`.
 * - The barriers are initialised before a cluster barrier, so no multicast or remote arrival
 *   reaches an uninitialised peer; and a block's producer, before it exits, waits for the last
 *   release of every stage (the peer's remote arrivals included), so no arrival reaches a block
 *   that has exited (CUTLASS's "producer tail").
 * - A pair's second tile may lie wholly below M (odd tile rows): TMA fills its A with zeros and its
 *   block multiplies them, keeping both blocks' pipelines in step, and stores nothing.
 */
#include "common.cuh"
#include "ptx.cuh"          // smem_u32_asm
#include "wgmma.cuh"        // wgmma wrappers, descriptors, stmatrix, bulk-group waits
#include "gemm_hopper.cuh"  // raster order, C pair stores, mbarriers, TMA copies

#define BN9 128
#define STAGES9 6
#define THREADS9 384
#define A_BYTES9 (BM5 * BK5 * 2)                 // 16 KB
#define B_HALF9 (BK5 * 64 * 2)                   // 8 KB: one 64 k x 64 n box, each block's share of B
#define STAGE9 (A_BYTES9 + 2 * B_HALF9)          // 32 KB
#define C_WG_STAGE9 (BM5 * 64 * 2)               // 16 KB: one 64-column round of a 128-row tile
// Dynamic shared memory: 6 * 32 KB + 2 * 16 KB + 1 KB to align the base = 230400 (gpucore/ladder/gemm.py).
// Measurement switches (tools/probes/gemm_v9_clusters.py): -DV9_NO_MULTICAST loads all of B in each
// block; with -DV9_LOCAL_ONLY too, stages are released to the own block only (v8 in clusters).
#ifndef V9_GROUP
#define V9_GROUP 8               // pair rows (256 rows of A each) per raster group
#endif
#ifdef V9_LOCAL_ONLY
#define V9_RELEASES 4
#else
#define V9_RELEASES 8
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ u32 cluster_rank9() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ u32 cluster_id9() {
    u32 r;
    asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ u32 cluster_count9() {
    u32 r;
    asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r));
    return r;
}
// Every thread of both blocks: arrive, then wait (orders the barriers' init before any peer's use).
__device__ __forceinline__ void cluster_sync9() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// One arrival on the mbarrier at the same shared-memory offset in block `rank` of the cluster, with
// the default .release.cta semantics, as CUTLASS's ClusterBarrier::arrive: what it orders is this
// warp's wgmma reads of the stage, already complete (wgmma.wait_group), before the peer's next TMA
// write. (-DV9_ARRIVE_CLUSTER_SCOPE: .release.cluster, for the probe.)
__device__ __forceinline__ void mbar_arrive_cluster9(u32 bar, u32 rank) {
#ifdef V9_ARRIVE_CLUSTER_SCOPE
    asm volatile("{\n .reg .b32 remote;\n mapa.shared::cluster.u32 remote, %0, %1;\n"
                 " mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar), "r"(rank)
                 : "memory");
#else
    asm volatile("{\n .reg .b32 remote;\n mapa.shared::cluster.u32 remote, %0, %1;\n"
                 " mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar), "r"(rank)
                 : "memory");
#endif
}
// TMA load of the box at (c0, c1) into shared memory at dst of every block in `mask`, each block's
// mbarrier at offset `bar` completing the box's bytes.
__device__ __forceinline__ void tma_load_2d_multicast9(u32 dst, const void* map, int c0, int c1, u32 bar,
                                                       unsigned short mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
                 : "memory");
}

// Pair `pid` of a (pairs_m x tiles_n) grid in v5's grouped raster order, V9_GROUP pair rows a group;
// returns the first row of the pair (its block-rank-0 tile) and its column.
__device__ __forceinline__ void pair_origin9(int pid, int pairs_m, int tiles_n, int& m0, int& n0) {
    const int per_group = V9_GROUP * tiles_n;
    const int first = (pid / per_group) * V9_GROUP;
    const int rows = min(pairs_m - first, V9_GROUP);
    m0 = (first + (pid % per_group) % rows) * 2 * BM5;
    n0 = ((pid % per_group) / rows) * BN9;
}

template <typename Tout>
__device__ __forceinline__ void gemm_v9(Tout* C, const unsigned char* maps, int M, int N, int K) {
    extern __shared__ unsigned char smem9[];
    __shared__ __align__(8) unsigned long long bars9[2 * STAGES9 + 2];   // full[S], empty[S], mdone[2]
    // The same offsets in both blocks (same kernel, same static shared memory): multicast copies and
    // remote arrivals name the peer's stage and barrier by this block's addresses.
    const u32 smem0 = (smem_u32_asm(smem9) + 1023u) & ~1023u;
    const u32 full0 = smem_u32_asm(bars9), empty0 = full0 + 8 * STAGES9, mdone0 = empty0 + 8 * STAGES9;
    const void* map_a = maps;
    const void* map_b = maps + 128;
    const void* map_c = maps + 256;

    const int tiles_m = (M + BM5 - 1) / BM5, tiles_n = (N + BN9 - 1) / BN9;
    const int pairs_m = (tiles_m + 1) / 2, pairs = pairs_m * tiles_n;
    const int ktiles = (K + BK5 - 1) / BK5;
    const int rank = (int)cluster_rank9(), peer = rank ^ 1;
    const int cid = (int)cluster_id9(), clusters = (int)cluster_count9();

    const int tid = threadIdx.x, wg = tid >> 7;
    if (tid == 0) {
        for (int s = 0; s < STAGES9; s++) {
            mbar_init6(full0 + 8 * s, 1);
            mbar_init6(empty0 + 8 * s, V9_RELEASES);             // 4 consumer warps x 2 blocks
        }
        mbar_init6(mdone0, 128);
        mbar_init6(mdone0 + 8, 128);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cluster_sync9();

    if (wg == 0) {                                                    // ---- producer ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
        if (tid != 0) return;
        tensormap_acquire7(map_a);
        tensormap_acquire7(map_b);
        int it = 0;
        for (int pair = cid; pair < pairs; pair += clusters) {
            int m0, n0;
            pair_origin9(pair, pairs_m, tiles_n, m0, n0);
            m0 += BM5 * rank;
            for (int kt = 0; kt < ktiles; kt++, it++) {
                const int s = it % STAGES9;
                if (it >= STAGES9) mbar_wait6(empty0 + 8 * s, ((it / STAGES9) - 1) & 1);
                const u32 base = smem0 + s * STAGE9, bar = full0 + 8 * s;
                mbar_arrive_expect_tx7(bar, STAGE9);
                tma_load_2d7(base, map_a, kt * BK5, m0, bar);
#ifndef V9_NO_MULTICAST
                tma_load_2d_multicast9(base + A_BYTES9 + B_HALF9 * rank, map_b, n0 + 64 * rank, kt * BK5, bar, 3);
#else
                tma_load_2d7(base + A_BYTES9, map_b, n0, kt * BK5, bar);
                tma_load_2d7(base + A_BYTES9 + B_HALF9, map_b, n0 + 64, kt * BK5, bar);
#endif
            }
        }
        // Producer tail: wait for the last release of every stage, both blocks' consumers included,
        // so that no remote arrival is still on its way to this block when it exits.
        for (int j = 0; j < STAGES9; j++, it++)
            if (it >= STAGES9) mbar_wait6(empty0 + 8 * (it % STAGES9), ((it / STAGES9) - 1) & 1);
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");     // ---- consumers ----
    const int c = wg - 1, lane = tid & 31, warp = (tid >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    const bool leader = (tid & 127) == 0;
    constexpr bool staged = sizeof(Tout) == 2;
    const u32 c_stage = smem0 + STAGES9 * STAGE9 + c * C_WG_STAGE9;
    if (staged && leader) tensormap_acquire7(map_c);
    const int st_row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), st_blk = lane >> 4;
    // A stage read by this warp is released to both blocks' producers: one arrival each per warp.
    auto release = [&](int s) {
        __syncwarp();
        if (lane == 0) {
            mbar_arrive6(empty0 + 8 * s);
#ifndef V9_LOCAL_ONLY
            mbar_arrive_cluster9(empty0 + 8 * s, (u32)peer);
#endif
        }
    };
    // tile i of this block (i = c, c + 2, ...) is row `rank` of the cluster's pair cid + i * clusters
    for (int i = c; cid + i * clusters < pairs; i += 2) {
        int m0, n0;
        pair_origin9(cid + i * clusters, pairs_m, tiles_n, m0, n0);
        m0 += BM5 * rank;
        // the other consumer's tile i - 1 is phase ((i - 1) - (1 - c)) / 2 of its mdone
        if (i > 0) mbar_wait6(mdone0 + 8 * (1 - c), (((i - 1) - (1 - c)) / 2) & 1);
        float d0[64], d1[64];                                   // rows 0-63 and 64-127 of the tile
        #pragma unroll
        for (int r = 0; r < 64; r++) { d0[r] = 0.0f; d1[r] = 0.0f; }
        int it = i * ktiles;
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const int s = it % STAGES9;
            mbar_wait6(full0 + 8 * s, (it / STAGES9) & 1);
            const u32 sa = smem0 + s * STAGE9, sb = sa + A_BYTES9;
            wgmma_fence();
            #pragma unroll
            for (int ks = 0; ks < BK5 / 16; ks++) {
                const u64 db = smem_desc(sb + 2048 * ks, 8192, 1024);
                wgmma_m64n128k16_ss_kmn(d0, smem_desc(sa + 32 * ks, 16, 1024), db);
                wgmma_m64n128k16_ss_kmn(d1, smem_desc(sa + 8192 + 32 * ks, 16, 1024), db);
            }
            wgmma_commit();
            wgmma_wait<1>();
            if (kt > 0) release((it - 1) % STAGES9);
        }
        mbar_arrive6(mdone0 + 8 * c);                   // all of this tile's math issued: the other may start
        wgmma_wait<0>();
        release((it - 1) % STAGES9);
        #pragma unroll
        for (int r = 0; r < 64; r++) {
            asm volatile("" : "+f"(d0[r])::"memory");
            asm volatile("" : "+f"(d1[r])::"memory");
        }
        if (m0 >= M) continue;                          // a pair's second tile below M: nothing to store

        if constexpr (staged) {
            #pragma unroll
            for (int h = 0; h < BN9 / 64; h++) {                // rounds of 64 columns
                if (leader) bulk_wait_read<0>();
                named_barrier_sync7(1 + c, 128);
                #pragma unroll
                for (int p = 0; p < 4; p++) {                   // n8 blocks j, j + 1 of this round
                    const int j = 8 * h + 2 * p, jl = 2 * p + st_blk;
                    const u32 off = st_row * 128 + (((jl & 7) ^ (st_row & 7)) << 4);
                    stmatrix_x4(c_stage + off, pack_bf16x2(d0[4 * j], d0[4 * j + 1]),
                                pack_bf16x2(d0[4 * j + 2], d0[4 * j + 3]), pack_bf16x2(d0[4 * j + 4], d0[4 * j + 5]),
                                pack_bf16x2(d0[4 * j + 6], d0[4 * j + 7]));
                    stmatrix_x4(c_stage + 8192 + off, pack_bf16x2(d1[4 * j], d1[4 * j + 1]),
                                pack_bf16x2(d1[4 * j + 2], d1[4 * j + 3]), pack_bf16x2(d1[4 * j + 4], d1[4 * j + 5]),
                                pack_bf16x2(d1[4 * j + 6], d1[4 * j + 7]));
                }
                fence_proxy_async();
                named_barrier_sync7(1 + c, 128);
                if (leader) {
                    tma_store_2d7(map_c, n0 + 64 * h, m0, c_stage);
                    if (m0 + 64 < M) tma_store_2d7(map_c, n0 + 64 * h, m0 + 64, c_stage + 8192);
                    bulk_commit();
                }
            }
        } else {                                                // float32 C: stores from registers
            #pragma unroll
            for (int half = 0; half < 2; half++) {
                const float* d = half ? d1 : d0;
                const int row = m0 + 64 * half + warp * 16 + g;
                #pragma unroll
                for (int j = 0; j < BN9 / 8; j++) {
                    const int col = n0 + j * 8 + 2 * t;
                    if (col >= N) continue;
                    if (row < M) store2_5<Tout>(C + (size_t)row * N + col, d[4 * j], d[4 * j + 1]);
                    if (row + 8 < M) store2_5<Tout>(C + (size_t)(row + 8) * N + col, d[4 * j + 2], d[4 * j + 3]);
                }
            }
        }
    }
    if (staged && leader) bulk_wait_done<0>();
}

#define GEMM_V9_BODY(Tout) gemm_v9<Tout>(C, maps, M, N, K)
#else
#define GEMM_V9_BODY(Tout) __trap()          // not sm_90a: Python never launches this
#endif

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(THREADS9, 1) gemm_forward_kernel_v9_bf16_f32(
        float* C, const unsigned char* maps, int M, int N, int K) {
    GEMM_V9_BODY(float);
}
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(THREADS9, 1) gemm_forward_kernel_v9_bf16_bf16(
        bf16* C, const unsigned char* maps, int M, int N, int K) {
    GEMM_V9_BODY(bf16);
}
