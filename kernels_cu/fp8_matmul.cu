/*
 * fp8_matmul.cu -- our FP8 GEMM for Hopper (sm_90a): the "TN" product every FP8 GEMM of the engine is,
 * with fast accumulation and an optional bias, where cuBLASLt was the only path before.
 *
 * Math:   out (M, N) bf16 = bf16( (a8 (M, K) @ b8 (N, K)^T) * a_scale_inv * b_scale_inv [+ bias (N,)] )
 *         a8: E4M3 or E5M2 bytes (AFMT), b8: E4M3 bytes, both K-contiguous (FP8 wgmma takes no other
 *         layout); float32 accumulation in the wgmma accumulator across all of K -- cuBLASLt's "fast
 *         accumulation" (CUBLASLT_MATMUL_DESC_FAST_ACCUM), so the forward and the dx GEMMs only:
 *         the weight gradients (K = tokens) keep cuBLASLt's exact accumulation. One rounding to bf16
 *         (cvt.rn.bf16x2); equal to cuBLASLt's within the accumulation's rounding, not bit for bit.
 * Why:    the 47th session's fused-fc experiment (tools/notes/fp8.md) found this kernel 7-18% faster
 *         than cuBLASLt's raced FP8 GEMM at the d12 fc shape.
 * How:    ladder gemm v8's schedule (kernels_cu/ladder/gemm/pingpong.cu) in FP8: a persistent grid,
 *         one producer thread issuing TMA loads into 6 stages, two consumer warpgroups that each own
 *         whole 128 x 128 tiles and ping-pong (one's epilogue under the other's math). A k-tile is 128
 *         bytes of K (one 128B-swizzled row): 4 wgmma.m64n128k32 a 64-row half; the descriptors step
 *         32 bytes a k32 step, as bf16's do a k16 step. The epilogue scales, adds the bias (its pairs
 *         loaded before the math: 16 dependent L2 reads after it cost more than the math they wait
 *         for), rounds with cvt.rn.bf16x2 (common.cuh's pack_bf16x2 rounds in ~10 integer
 *         instructions a pair: it made the first build 25% slower) and leaves by stmatrix + TMA stores.
 * Needs:  sm_90a, M, N, K multiples of 16, 16-byte aligned bases; the three TMA maps of
 *         gpucore/ops/fp8.py (_our_maps): A, B in boxes of 128 rows x 128 bytes, out in 64 x 64 bf16
 *         boxes, all 128B-swizzled.
 * Shared memory: 6 stages of 32 KB (A [128][128 B] then B [128][128 B]) + a 16 KB staging buffer per
 * consumer (h in two rounds of 64 columns) + 1 KB of alignment = 230400 bytes (ops/fp8.py OUR_SMEM).
 */
#include "common.cuh"
#include "ptx.cuh"                     // smem_u32_asm
#include "wgmma.cuh"                   // wgmma (FP8), descriptors, stmatrix, bulk-group waits
#include "fast_packs.cuh"              // cvt_rn_bf16x2
#include "ladder/gemm/gemm_hopper.cuh" // raster order, mbarriers, TMA copies and stores

#define F8_BM 128
#define F8_BN 128
#define F8_BK 128                              // bytes = FP8 elements: one 128B-swizzled row
#define F8_STAGES 6
#define F8_THREADS 384
#define F8_A_BYTES (F8_BM * F8_BK)             // 16 KB
#define F8_STAGE (2 * F8_A_BYTES)              // 32 KB: A and B
#define F8_STAGING (F8_BM * 64 * 2)            // 16 KB: one 64-column round of a tile's h

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <bool A_E5M2>
__device__ __forceinline__ void fp8_matmul_tn(bf16* out, const float* a_scale_inv, const float* b_scale_inv,
                                              const bf16* bias, const unsigned char* maps, int M, int N, int K) {
    extern __shared__ unsigned char smem_f8[];
    __shared__ __align__(8) unsigned long long bars_f8[2 * F8_STAGES + 2];   // full[S], empty[S], mdone[2]
    const u32 smem0 = (smem_u32_asm(smem_f8) + 1023u) & ~1023u;
    const u32 full0 = smem_u32_asm(bars_f8), empty0 = full0 + 8 * F8_STAGES, mdone0 = empty0 + 8 * F8_STAGES;
    const void* map_a = maps;
    const void* map_b = maps + 128;
    const void* map_c = maps + 256;

    const int tiles_m = (M + F8_BM - 1) / F8_BM, tiles_n = (N + F8_BN - 1) / F8_BN;
    const int tiles = tiles_m * tiles_n;
    const int ktiles = (K + F8_BK - 1) / F8_BK;

    const int tid = threadIdx.x, wg = tid >> 7;
    if (tid == 0) {
        for (int s = 0; s < F8_STAGES; s++) {
            mbar_init6(full0 + 8 * s, 1);
            mbar_init6(empty0 + 8 * s, 128);
        }
        mbar_init6(mdone0, 128);
        mbar_init6(mdone0 + 8, 128);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // Registers: 384 threads launch with 168 each; the producer's 168 -> 56 pays the consumers' 168 -> 224.
    if (wg == 0) {                                                    // ---- producer ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
        if (tid != 0) return;
        tensormap_acquire7(map_a);
        tensormap_acquire7(map_b);
        int it = 0;
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            int m0, n0;
            tile_origin5<F8_BN>(tile, tiles_m, tiles_n, m0, n0);
            for (int kt = 0; kt < ktiles; kt++, it++) {
                const int s = it % F8_STAGES;
                if (it >= F8_STAGES) mbar_wait6(empty0 + 8 * s, ((it / F8_STAGES) - 1) & 1);
                const u32 base = smem0 + s * F8_STAGE, bar = full0 + 8 * s;
                mbar_arrive_expect_tx7(bar, F8_STAGE);              // edge boxes count whole: zero-filled
                tma_load_2d7(base, map_a, kt * F8_BK, m0, bar);
                tma_load_2d7(base + F8_A_BYTES, map_b, kt * F8_BK, n0, bar);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");     // ---- consumers ----
    const int c = wg - 1, lane = tid & 31, warp = (tid >> 5) & 3;
    const int t = lane & 3;
    const bool leader = (tid & 127) == 0;
    const u32 stg = smem0 + F8_STAGES * F8_STAGE + c * F8_STAGING;
    if (leader) tensormap_acquire7(map_c);
    const int st_row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), st_blk = lane >> 4;
    const float ab = *a_scale_inv * *b_scale_inv;
    // tile i of this block (i = c, c + 2, ...) is global tile blockIdx.x + i * gridDim.x
    for (int i = c; blockIdx.x + i * gridDim.x < tiles; i += 2) {
        int m0, n0;
        tile_origin5<F8_BN>(blockIdx.x + i * gridDim.x, tiles_m, tiles_n, m0, n0);
        u32 bias2[F8_BN / 8];                                   // this thread's bias pairs (columns 8 j + 2 t, + 1)
        #pragma unroll
        for (int j = 0; j < F8_BN / 8; j++) {
            const int col = n0 + 8 * j + 2 * t;
            bias2[j] = (bias != nullptr && col < N) ? __ldg(reinterpret_cast<const unsigned int*>(bias + col)) : 0u;
        }
        // the other consumer's tile i - 1 is phase ((i - 1) - (1 - c)) / 2 of its mdone
        if (i > 0) mbar_wait6(mdone0 + 8 * (1 - c), (((i - 1) - (1 - c)) / 2) & 1);
        float d0[64], d1[64];                                   // rows 0-63 and 64-127 of the tile
        #pragma unroll
        for (int r = 0; r < 64; r++) { d0[r] = 0.0f; d1[r] = 0.0f; }
        int it = i * ktiles;
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const int s = it % F8_STAGES;
            mbar_wait6(full0 + 8 * s, (it / F8_STAGES) & 1);
            const u32 sa = smem0 + s * F8_STAGE, sb = sa + F8_A_BYTES;
            wgmma_fence();
            #pragma unroll
            for (int ks = 0; ks < F8_BK / 32; ks++) {
                const u64 db = smem_desc(sb + 32 * ks, 16, 1024);
                wgmma_m64n128k32_f8<A_E5M2>(d0, smem_desc(sa + 32 * ks, 16, 1024), db);
                wgmma_m64n128k32_f8<A_E5M2>(d1, smem_desc(sa + 8192 + 32 * ks, 16, 1024), db);
            }
            wgmma_commit();
            wgmma_wait<1>();
            if (kt > 0) mbar_arrive6(empty0 + 8 * ((it - 1) % F8_STAGES));
        }
        mbar_arrive6(mdone0 + 8 * c);                   // all of this tile's math issued: the other may start
        wgmma_wait<0>();
        mbar_arrive6(empty0 + 8 * ((it - 1) % F8_STAGES));
        #pragma unroll
        for (int r = 0; r < 64; r++) {
            asm volatile("" : "+f"(d0[r])::"memory");
            asm volatile("" : "+f"(d1[r])::"memory");
        }
        #pragma unroll
        for (int h = 0; h < F8_BN / 64; h++) {                  // rounds of 64 columns
            if (leader) bulk_wait_read<0>();                    // the staging buffer's last store has read it
            named_barrier_sync7(1 + c, 128);
            #pragma unroll
            for (int p = 0; p < 4; p++) {                       // n8 blocks j, j + 1 of this round
                const int j = 8 * h + 2 * p;
                u32 hv[2][4];                                   // [rows 0-63 / 64-127][2 (j / j+1) + (row g / g+8)]
                #pragma unroll
                for (int b = 0; b < 2; b++) {
                    const float b0 = __uint_as_float(bias2[j + b] << 16), b1 = __uint_as_float(bias2[j + b] & 0xffff0000u);
                    const int q = 4 * (j + b);
                    hv[0][2 * b] = cvt_rn_bf16x2(fmaf(d0[q], ab, b0), fmaf(d0[q + 1], ab, b1));
                    hv[0][2 * b + 1] = cvt_rn_bf16x2(fmaf(d0[q + 2], ab, b0), fmaf(d0[q + 3], ab, b1));
                    hv[1][2 * b] = cvt_rn_bf16x2(fmaf(d1[q], ab, b0), fmaf(d1[q + 1], ab, b1));
                    hv[1][2 * b + 1] = cvt_rn_bf16x2(fmaf(d1[q + 2], ab, b0), fmaf(d1[q + 3], ab, b1));
                }
                const int jl = 2 * p + st_blk;
                const u32 off = st_row * 128 + (((jl & 7) ^ (st_row & 7)) << 4);
                stmatrix_x4(stg + off, hv[0][0], hv[0][1], hv[0][2], hv[0][3]);
                stmatrix_x4(stg + 8192 + off, hv[1][0], hv[1][1], hv[1][2], hv[1][3]);
            }
            fence_proxy_async();
            named_barrier_sync7(1 + c, 128);
            if (leader) {
                tma_store_2d7(map_c, n0 + 64 * h, m0, stg);
                tma_store_2d7(map_c, n0 + 64 * h, m0 + 64, stg + 8192);
                bulk_commit();
            }
        }
    }
    if (leader) bulk_wait_done<0>();
}

#define FP8_MATMUL_BODY(E5) fp8_matmul_tn<E5>(out, a_scale_inv, b_scale_inv, bias, maps, M, N, K)
#else
#define FP8_MATMUL_BODY(E5) __trap()          // not sm_90a: Python never launches this
#endif

// a8 E4M3 (the forward: activations x weights) / E5M2 (the dx GEMMs: output gradients x weights)
extern "C" __global__ void __launch_bounds__(F8_THREADS, 1) fp8_matmul_tn_kernel_e4m3(
        bf16* out, const float* a_scale_inv, const float* b_scale_inv,   // (M, N); (1,), (1,)
        const bf16* bias,                                                // (N,) | null
        const unsigned char* maps, int M, int N, int K) {                // A, B, out tensor maps
    FP8_MATMUL_BODY(false);
}
extern "C" __global__ void __launch_bounds__(F8_THREADS, 1) fp8_matmul_tn_kernel_e5m2(
        bf16* out, const float* a_scale_inv, const float* b_scale_inv, const bf16* bias,
        const unsigned char* maps, int M, int N, int K) {
    FP8_MATMUL_BODY(true);
}
