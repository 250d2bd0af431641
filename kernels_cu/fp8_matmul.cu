/*
 * fp8_matmul.cu -- the fc layer's FP8 forward in one kernel (Hopper, sm_90a): the GEMM with its bias,
 * and fcproj's FP8 input made in the epilogue -- GELU, scaled, E4M3, in both orientations, with its amax.
 *
 * Math:   h   = bf16( (a8 (M, K) @ b8 (N, K)^T) * a_scale_inv * b_scale_inv + bias (N,) )   -> out (M, N)
 *         g   = bf16( gelu(h) )                     (gelu.cu's bf16 GELU of the rounded h)
 *         x8  = E4M3( g * gelu_scale ), saturating  -> out8 (M, N) and out8_t (N, M), uint8
 *         amax = max |g| over the tile's elements inside (M, N), folded into *amax (atomicMax)
 *         The x8, x8T and amax bits are fp8.cu's fp8_gelu_cast_kernel_e4m3 of h, exactly; h itself
 *         is a fast-accumulation FP8 GEMM (the wgmma accumulator across all of K, as cuBLASLt's
 *         fast_accum), equal to cuBLASLt's within rounding, not bit for bit.
 * Why:    FP8 training made h with cuBLASLt (bias epilogue) and then read it back in a pass of its
 *         own (fp8_gelu_cast: 2 bytes read, 2 written a value, issue-bound on GELU's arithmetic):
 *         ~0.58 ms a d12 layer (H100, tools/notes/fp8.md). Lt's own GELU_AUX epilogue with an FP8 D
 *         cost more than the pass (its epilogue is not hidden at K = 768). Here the consumer
 *         warpgroups ping-pong (ladder gemm v8's schedule): one runs the GELU epilogue while the
 *         other multiplies, so the pass's arithmetic hides under the tensor cores' time.
 * Needs:  sm_90a; K % 16 == 0, N % 16 == 0, M % 16 == 0, 16-byte aligned bases; the five TMA maps
 *         of gpucore/ops/fp8.py (_fp8_gelu_maps): A and B in boxes of 128 rows x 128 bytes, out in
 *         64 x 64 bf16 boxes, out8 and out8_t in 128 x 128 byte boxes, all 128B-swizzled.
 * Grid:   persistent, min(tiles, SMs) blocks of 384 threads (a producer warp and two consumer
 *         warpgroups) walking 128 x 128 tiles in gemm v5's grouped raster order.
 *
 * Shared memory: 5 stages of 32 KB (A [128][128 B], B [128][128 B], K-major, 128B-swizzled by TMA),
 * then per consumer: a 16 KB staging buffer (h in two rounds of 64 columns, then the x8T tile) and a
 * 16 KB x8 tile. 230400 bytes with the alignment slack (ops/fp8.py FP8_GELU_SMEM).
 *
 * The epilogue of a consumer's 128 x 128 tile (its 64 + 64 accumulators a thread hold rows g, g + 8 of
 * each warp's 16, columns 8 j + 2 t, + 1):
 *   1. each element scaled, biased, rounded to bf16 (h) -> stmatrix into the staging buffer (as v8),
 *      a TMA store per 64-column round; GELU of the same bf16 -> E4M3 pairs, which one shuffle with
 *      the neighbour lane turns into 4-byte words of one row (4 columns) -> the x8 tile;
 *   2. the x8 tile turned into x8T in 4 x 4 byte blocks (fp8_cast.cuh's byte permutes): lane L of
 *      warp w takes word column W = L and row block L ^ (8 w + i), i = 0..7 -- both the loads and the
 *      stores then meet 32 distinct banks under the 128-byte swizzle;
 *   3. two TMA stores (x8, x8T), committed with the round's; the next tile's epilogue waits for their
 *      reads of shared memory before it writes there again.
 */
#include "common.cuh"
#include "ptx.cuh"                     // smem_u32_asm
#include "wgmma.cuh"                   // wgmma (E4M3), descriptors, stmatrix, bulk-group waits
#include "fp8_cast.cuh"                // cvt_fp8x2, E4M3
#include "gelu_math.cuh"               // gelu_f, cvt_rn_bf16x2
#include "ladder/gemm/gemm_hopper.cuh" // raster order, mbarriers, TMA copies and stores

#define FG_BM 128
#define FG_BN 128
#define FG_BK 128                              // bytes = E4M3 elements: one 128B-swizzled row
#define FG_STAGES 4
#define FG_THREADS 640                         // producer, 2 MMA, 2 epilogue warpgroups
// Registers: 640 threads launch with 96 each (ptxas, __launch_bounds__(640, 1)). setmaxnreg moves them
// between warpgroups but only within what the block was given: the producer's 96 -> 24 and the epilogue
// warpgroups' 96 -> 56 free 9216 + 10240, the MMA warpgroups' 96 -> 168 take 18432 of them. An .inc that
// asks for more than the others freed waits forever (the first build asked 176 + 64: a hang).
#define FG_A_BYTES (FG_BM * FG_BK)             // 16 KB
#define FG_STAGE (2 * FG_A_BYTES)              // 32 KB: A and B
#define FG_HBUF (FG_BM * FG_BN * 2)            // 32 KB: an h tile as 4 boxes of 64 x 64 bf16; then x8T
#define FG_X8 (FG_BM * FG_BN)                  // 16 KB

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// 8 bf16 of h (a 16-byte pack) -> their GELU's E4M3 bytes (scaled), |g| bits into mbits for the
// elements whose bit in `keep` is set (all of them inside the matrix).
__device__ __forceinline__ uint2 gelu_e4m3_8(uint4 hp, float s, u32& mbits, u32 keep) {
    const u32 w[4] = {hp.x, hp.y, hp.z, hp.w};
    u32 o[2];
    #pragma unroll
    for (int i = 0; i < 4; i += 2) {
        u32 g[2];
        #pragma unroll
        for (int k = 0; k < 2; k++) {
            const u32 h = w[i + k];
            g[k] = cvt_rn_bf16x2(gelu_f<false>(__uint_as_float(h << 16)), gelu_f<false>(__uint_as_float(h & 0xffff0000u)));
            const u32 m = ((keep >> (2 * (i + k))) & 1 ? 0x0000ffffu : 0u) | ((keep >> (2 * (i + k) + 1)) & 1 ? 0xffff0000u : 0u);
            mbits = __vmaxu2(mbits, g[k] & 0x7fff7fffu & m);
        }
        o[i / 2] = (u32)cvt_fp8x2<E4M3>(__uint_as_float(g[0] << 16) * s, __uint_as_float(g[0] & 0xffff0000u) * s) |
                   ((u32)cvt_fp8x2<E4M3>(__uint_as_float(g[1] << 16) * s, __uint_as_float(g[1] & 0xffff0000u) * s) << 16);
    }
    return make_uint2(o[0], o[1]);
}

// The x8 tile's 4 x 4 byte block (row block R4, word column W) into the x8T tile, both 128 x 128 bytes,
// 128B-swizzled: 4 word loads, fp8_cast.cuh's byte permutes, 4 word stores (x8T rows 4 W.., word R4).
__device__ __forceinline__ void transpose_block4(u32 src, u32 dst, int W, int R4) {
    u32 w0, w1, w2, w3;
    const int r = 4 * R4;                      // rows r..r+3 share (r & 7) >> 2; the swizzle uses row & 7
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(w0) : "r"(src + (r + 0) * 128 + (((W >> 2) ^ ((r + 0) & 7)) << 4) + 4 * (W & 3)) : "memory");
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(w1) : "r"(src + (r + 1) * 128 + (((W >> 2) ^ ((r + 1) & 7)) << 4) + 4 * (W & 3)) : "memory");
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(w2) : "r"(src + (r + 2) * 128 + (((W >> 2) ^ ((r + 2) & 7)) << 4) + 4 * (W & 3)) : "memory");
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(w3) : "r"(src + (r + 3) * 128 + (((W >> 2) ^ ((r + 3) & 7)) << 4) + 4 * (W & 3)) : "memory");
    const u32 lo01 = __byte_perm(w0, w1, 0x5140), lo23 = __byte_perm(w2, w3, 0x5140);
    const u32 hi01 = __byte_perm(w0, w1, 0x7362), hi23 = __byte_perm(w2, w3, 0x7362);
    const int c = 4 * W;                       // x8T rows c..c+3
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(dst + (c + 0) * 128 + (((R4 >> 2) ^ ((c + 0) & 7)) << 4) + 4 * (R4 & 3)), "r"(__byte_perm(lo01, lo23, 0x5410)) : "memory");
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(dst + (c + 1) * 128 + (((R4 >> 2) ^ ((c + 1) & 7)) << 4) + 4 * (R4 & 3)), "r"(__byte_perm(lo01, lo23, 0x7632)) : "memory");
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(dst + (c + 2) * 128 + (((R4 >> 2) ^ ((c + 2) & 7)) << 4) + 4 * (R4 & 3)), "r"(__byte_perm(hi01, hi23, 0x5410)) : "memory");
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(dst + (c + 3) * 128 + (((R4 >> 2) ^ ((c + 3) & 7)) << 4) + 4 * (R4 & 3)), "r"(__byte_perm(hi01, hi23, 0x7632)) : "memory");
}

template <bool GELU_OUT>
__device__ __forceinline__ void fp8_matmul_gelu(bf16* out, const float* a_scale_inv, const float* b_scale_inv,
                                                const bf16* bias, const float* gelu_scale, float* amax,
                                                const unsigned char* maps, int M, int N, int K) {
    extern __shared__ unsigned char smem_fg[];
    // full[S], empty[S], mdone[2], hfull[2], hempty[2]
    __shared__ __align__(8) unsigned long long bars_fg[2 * FG_STAGES + 6];
    const u32 smem0 = (smem_u32_asm(smem_fg) + 1023u) & ~1023u;
    const u32 full0 = smem_u32_asm(bars_fg), empty0 = full0 + 8 * FG_STAGES, mdone0 = empty0 + 8 * FG_STAGES;
    const u32 hfull0 = mdone0 + 16, hempty0 = hfull0 + 16;
    const u32 hbuf0 = smem0 + FG_STAGES * FG_STAGE, x8buf0 = hbuf0 + 2 * FG_HBUF;
    const void* map_a = maps;
    const void* map_b = maps + 128;
    const void* map_h = maps + 256;
    const void* map_x8 = maps + 384;
    const void* map_x8t = maps + 512;

    const int tiles_m = (M + FG_BM - 1) / FG_BM, tiles_n = (N + FG_BN - 1) / FG_BN;
    const int tiles = tiles_m * tiles_n;
    const int ktiles = (K + FG_BK - 1) / FG_BK;

    const int tid = threadIdx.x, wg = tid >> 7;
    if (tid == 0) {
        for (int s = 0; s < FG_STAGES; s++) {
            mbar_init6(full0 + 8 * s, 1);
            mbar_init6(empty0 + 8 * s, 128);
        }
        for (int e = 0; e < 2; e++) {
            mbar_init6(mdone0 + 8 * e, 128);
            mbar_init6(hfull0 + 8 * e, 128);
            mbar_init6(hempty0 + 8 * e, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {                                                    // ---- producer ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (tid != 0) return;
        tensormap_acquire7(map_a);
        tensormap_acquire7(map_b);
        int it = 0;
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            int m0, n0;
            tile_origin5<FG_BN>(tile, tiles_m, tiles_n, m0, n0);
            for (int kt = 0; kt < ktiles; kt++, it++) {
                const int s = it % FG_STAGES;
                if (it >= FG_STAGES) mbar_wait6(empty0 + 8 * s, ((it / FG_STAGES) - 1) & 1);
                const u32 base = smem0 + s * FG_STAGE, bar = full0 + 8 * s;
                mbar_arrive_expect_tx7(bar, FG_STAGE);
                tma_load_2d7(base, map_a, kt * FG_BK, m0, bar);
                tma_load_2d7(base + FG_A_BYTES, map_b, kt * FG_BK, n0, bar);
            }
        }
        return;
    }
    const int lane = tid & 31, warp = (tid >> 5) & 3;
    const bool leader = (tid & 127) == 0;

    if (wg <= 2) {                                                    // ---- MMA warpgroups ----
        asm volatile("setmaxnreg.inc.sync.aligned.u32 168;\n");
        const int c = wg - 1, t = lane & 3;
        const u32 hbuf = hbuf0 + c * FG_HBUF;
        const int st_row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), st_blk = lane >> 4;
        const float ab = *a_scale_inv * *b_scale_inv;
        for (int i = c; blockIdx.x + i * gridDim.x < tiles; i += 2) {
            int m0, n0;
            tile_origin5<FG_BN>(blockIdx.x + i * gridDim.x, tiles_m, tiles_n, m0, n0);
            u32 bias2[FG_BN / 8];                                   // this thread's bias pairs, loaded early
            #pragma unroll
            for (int j = 0; j < FG_BN / 8; j++) {
                const int col = n0 + 8 * j + 2 * t;
                bias2[j] = (bias != nullptr && col < N) ? __ldg(reinterpret_cast<const unsigned int*>(bias + col)) : 0u;
            }
            if (i > 0) mbar_wait6(mdone0 + 8 * (1 - c), (((i - 1) - (1 - c)) / 2) & 1);
            float d0[64], d1[64];                                   // rows 0-63 and 64-127 of the tile
            #pragma unroll
            for (int r = 0; r < 64; r++) { d0[r] = 0.0f; d1[r] = 0.0f; }
            int it = i * ktiles;
            for (int kt = 0; kt < ktiles; kt++, it++) {
                const int s = it % FG_STAGES;
                mbar_wait6(full0 + 8 * s, (it / FG_STAGES) & 1);
                const u32 sa = smem0 + s * FG_STAGE, sb = sa + FG_A_BYTES;
                wgmma_fence();
                #pragma unroll
                for (int ks = 0; ks < FG_BK / 32; ks++) {
                    const u64 db = smem_desc(sb + 32 * ks, 16, 1024);
                    wgmma_m64n128k32_e4m3(d0, smem_desc(sa + 32 * ks, 16, 1024), db);
                    wgmma_m64n128k32_e4m3(d1, smem_desc(sa + 8192 + 32 * ks, 16, 1024), db);
                }
                wgmma_commit();
                wgmma_wait<1>();
                if (kt > 0) mbar_arrive6(empty0 + 8 * ((it - 1) % FG_STAGES));
            }
            mbar_arrive6(mdone0 + 8 * c);               // all of this tile's math issued: the other may start
            wgmma_wait<0>();
            mbar_arrive6(empty0 + 8 * ((it - 1) % FG_STAGES));
            #pragma unroll
            for (int r = 0; r < 64; r++) {
                asm volatile("" : "+f"(d0[r])::"memory");
                asm volatile("" : "+f"(d1[r])::"memory");
            }
            // h into this warpgroup's buffer, once its epilogue warpgroup has finished the last one
            const int k = i / 2;
            if (k > 0) mbar_wait6(hempty0 + 8 * c, (k - 1) & 1);
            #pragma unroll
            for (int h = 0; h < FG_BN / 64; h++) {                 // column blocks of 64: boxes (h, 0), (h, 1)
                #pragma unroll
                for (int p = 0; p < 4; p++) {                       // n8 blocks j, j + 1
                    const int j = 8 * h + 2 * p;
                    u32 hv[2][4];
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
                    const u32 off = hbuf + h * 16384 + st_row * 128 + (((jl & 7) ^ (st_row & 7)) << 4);
                    stmatrix_x4(off, hv[0][0], hv[0][1], hv[0][2], hv[0][3]);
                    stmatrix_x4(off + 8192, hv[1][0], hv[1][1], hv[1][2], hv[1][3]);
                }
            }
            fence_proxy_async();                                    // for the TMA store that reads it
            mbar_arrive6(hfull0 + 8 * c);
        }
        return;
    }

    // ---- epilogue warpgroups: e takes MMA warpgroup e's tiles ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
    const int e = wg - 3, te = tid & 127;
    const u32 hbuf = hbuf0 + e * FG_HBUF, x8buf = x8buf0 + e * FG_X8;
    if (leader) {
        tensormap_acquire7(map_h);
        if (GELU_OUT) {
            tensormap_acquire7(map_x8);
            tensormap_acquire7(map_x8t);
        }
    }
    const float gs = GELU_OUT ? *gelu_scale : 0.0f;
    u32 mbits = 0;
    for (int i = e; blockIdx.x + i * gridDim.x < tiles; i += 2) {
        int m0, n0;
        tile_origin5<FG_BN>(blockIdx.x + i * gridDim.x, tiles_m, tiles_n, m0, n0);
        mbar_wait6(hfull0 + 8 * e, (i / 2) & 1);
        if (leader) {                                                 // h leaves from the buffer as it is
            #pragma unroll
            for (int b = 0; b < 4; b++) tma_store_2d7(map_h, n0 + 64 * (b >> 1), m0 + 64 * (b & 1), hbuf + 8192 * b);
            bulk_commit();
        }
        if (GELU_OUT) {
            // 16 packs of 8 columns a thread: pack q = 128 it + te is row q / 16, columns 8 (q % 16) ..
            #pragma unroll 4
            for (int it = 0; it < 16; it++) {
                const int q = 128 * it + te, r = q >> 4, cc = q & 15;
                const int rr = r & 63, cl = cc & 7;
                uint4 hp;
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(hp.x), "=r"(hp.y), "=r"(hp.z), "=r"(hp.w)
                             : "r"(hbuf + ((cc >> 3) * 2 + (r >> 6)) * 8192 + rr * 128 + ((cl ^ (rr & 7)) << 4)) : "memory");
                u32 keep = 0xffu;                                     // elements inside (M, N), for the amax
                if (m0 + r >= M) keep = 0;
                else if (n0 + 8 * cc + 8 > N) keep = n0 + 8 * cc >= N ? 0u : 0xffu >> (n0 + 8 * cc + 8 - N);
                const uint2 b8 = gelu_e4m3_8(hp, gs, mbits, keep);
                asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(x8buf + r * 128 + ((((cc >> 1) ^ (r & 7))) << 4) + 8 * (cc & 1)),
                             "r"(b8.x), "r"(b8.y) : "memory");
            }
            // x8T goes into the h buffer once every h read is done and the h store has read it
            if (leader) bulk_wait_read<0>();
            named_barrier_sync7(1 + e, 128);
            #pragma unroll 2            // fully unrolled, the 32 loads go first and spill at 64 registers
            for (int k = 0; k < 8; k++) transpose_block4(x8buf, hbuf, lane, lane ^ (8 * warp + k));
            fence_proxy_async();
            named_barrier_sync7(1 + e, 128);
            if (leader) {
                tma_store_2d7(map_x8, n0, m0, x8buf);
                tma_store_2d7(map_x8t, m0, n0, hbuf);
                bulk_commit();
            }
        }
        if (leader) {                                                 // the buffers are free again
            bulk_wait_read<0>();
            mbar_arrive6(hempty0 + 8 * e);
        }
    }
    if (leader) bulk_wait_done<0>();
    // the amax: this thread's |g| bits (both halves) -> the warp's -> *amax
    u32 m = max(mbits >> 16, mbits & 0xffffu) << 16;
    m = __reduce_max_sync(0xffffffffu, m);
    if (lane == 0 && amax != nullptr) atomicMax(reinterpret_cast<u32*>(amax), m);
}

#define FP8_MATMUL_BODY(G) fp8_matmul_gelu<G>(out, a_scale_inv, b_scale_inv, bias, gelu_scale, amax, maps, M, N, K)
#else
#define FP8_MATMUL_BODY(G) __trap()          // not sm_90a: Python never launches this
#endif

extern "C" __global__ void __launch_bounds__(FG_THREADS, 1) fp8_matmul_gelu_kernel(
        bf16* out,                                            // (M, N): h, bf16
        const float* a_scale_inv, const float* b_scale_inv,   // (1,) each
        const bf16* bias,                                     // (N,) | null
        const float* gelu_scale, float* amax,                 // (1,), (1,) | null: of gelu(h) in bf16
        const unsigned char* maps,                            // A, B, h, x8, x8T tensor maps (5 x 128 bytes)
        int M, int N, int K) {
    FP8_MATMUL_BODY(true);
}

// The same GEMM with only h written (gelu_scale, amax unused; maps: A, B, h): what the fused epilogue
// costs, measured against the plain kernel (tools/probes/fp8_gelu_fused.py).
extern "C" __global__ void __launch_bounds__(FG_THREADS, 1) fp8_matmul_bias_kernel(
        bf16* out, const float* a_scale_inv, const float* b_scale_inv, const bf16* bias,
        const float* gelu_scale, float* amax, const unsigned char* maps, int M, int N, int K) {
    FP8_MATMUL_BODY(false);
}
