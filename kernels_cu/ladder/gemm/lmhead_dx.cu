/*
 * ladder/gemm/lmhead_dx.cu -- EXPERIMENT (forty-fifth session): the LM head's dx GEMM with the
 * classifier's backward in its operand path, to price that step of a fused LM head.
 *
 * Math:   dx (M, N) = dlogits (M, K) @ W (K, N), bf16 in, f32 accumulation, bf16 out, where
 *           FUSED:   dlogits[r, k] = bf16(scale_r * (exp(logits[r, k] - lse[r]) - (k == t_r))) for k < V,
 *                    0 for V <= k < K (the vocabulary's padding); scale_r = 0 where t_r == -1
 *           control: dlogits is read as given (the same kernel without the transform).
 *         M tokens (one head chunk), K = Vp (50304), N = C (768); W is the (Vp, C) embedding.
 * Needs:  sm_90a; K % 8 == 0, N % 8 == 0; v7's tensor maps (A boxes 128 x 64, B boxes 64 x 64,
 *         C boxes 64 x 64; gpucore/ladder/gemm.py _tma_maps).
 *
 * How: v7's 128 x 192 persistent pipeline (TMA producer thread, 5 stages of 40 KB, two consumer
 * warpgroups of 64 rows, staged TMA-store epilogue), but A goes through REGISTERS: each consumer
 * pulls its 64 x 16 A fragments out of the swizzled stage with ldmatrix.x4, FUSED turns the logits
 * into dlogits there (one FMA and one exp2 per element, the row's lse, scale and target held in
 * registers), and wgmma.m64n192k16 takes A from registers. A warpgroup makes the next A only once
 * its wgmmas have retired (FlashAttention-3's rule; the other warpgroup keeps the tensor cores
 * busy meanwhile); the k-tile loop alternates two register sets.
 * Compared with the control, this isolates the transform's cost; the control against v7n192
 * (A from shared memory) isolates the register path's.
 */
#include "common.cuh"
#include "ptx.cuh"          // smem_u32_asm, ldmatrix_x4
#include "wgmma.cuh"        // wgmma wrappers, descriptors, stmatrix, bulk-group waits
#include "gemm_hopper.cuh"  // raster order, mbarriers, TMA copies

#define BND 192
#define STAGESD 5
#define STAGED_BYTES (A_STAGE5 + BK5 * BND * 2)   // 40 KB
#define C_WG_D (64 * 64 * 2)                      // 8 KB: one 64-column round of 64 rows
// Dynamic shared memory: 5 * 40 KB + 2 * 8 KB + 1 KB = 222208 (tools/probes/lmhead_dx.py).

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ float ex2_approx(float x) {              // MUFU.EX2 alone (-inf -> 0)
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ void named_barrier_arrive8(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ u32 cvt_bf16x2(float lo, float hi) {      // round to nearest even, one cvt
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <bool FUSED>
__device__ __forceinline__ void lmhead_dx(bf16* dx, const unsigned char* maps, const float* lse,
                                          const int* targets, float grad_scale, int M, int N, int K, int V) {
    extern __shared__ unsigned char smemd[];
    __shared__ __align__(8) unsigned long long barsd[2 * STAGESD];
    const u32 smem0 = (smem_u32_asm(smemd) + 1023u) & ~1023u;
    const u32 full0 = smem_u32_asm(barsd), empty0 = full0 + 8 * STAGESD;
    const void* map_a = maps;
    const void* map_b = maps + 128;
    const void* map_c = maps + 256;
    const int tiles_m = (M + BM5 - 1) / BM5, tiles_n = (N + BND - 1) / BND;
    const int tiles = tiles_m * tiles_n, ktiles = (K + BK5 - 1) / BK5;

    const int tid = threadIdx.x, wg = tid >> 7;
    if (tid == 0) {
        for (int s = 0; s < STAGESD; s++) {
            mbar_init6(full0 + 8 * s, 1);
            mbar_init6(empty0 + 8 * s, 256);
        }
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
            tile_origin5<BND>(tile, tiles_m, tiles_n, m0, n0);
            for (int kt = 0; kt < ktiles; kt++, it++) {
                const int s = it % STAGESD;
                if (it >= STAGESD) mbar_wait6(empty0 + 8 * s, ((it / STAGESD) - 1) & 1);
                const u32 base = smem0 + s * STAGED_BYTES, bar = full0 + 8 * s;
                mbar_arrive_expect_tx7(bar, STAGED_BYTES);
                tma_load_2d7(base, map_a, kt * BK5, m0, bar);
                #pragma unroll
                for (int nb = 0; nb < BND / 64; nb++)
                    tma_load_2d7(base + A_STAGE5 + nb * 8192, map_b, n0 + 64 * nb, kt * BK5, bar);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");     // ---- consumers ----
    const int c = wg - 1, lane = tid & 31, warp = (tid >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    const bool leader = (tid & 127) == 0;
    const u32 c_stage = smem0 + STAGESD * STAGED_BYTES + c * C_WG_D;
    if (leader) tensormap_acquire7(map_c);
    const int st_row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), st_blk = lane >> 4;
    // ldmatrix.x4 of a 16 x 16 A block: lanes 0-15 rows 0-15 of chunk 2ks, lanes 16-31 of chunk 2ks+1
    const int lm_row = 64 * c + warp * 16 + (lane & 15), lm_half = lane >> 4;
    constexpr float LOG2E = 1.4426950408889634f;
    int it = 0;
    // Turns: both consumers wait on the same stage, so left alone they would make their A at the
    // same time and then multiply at the same time (exp2 and tensor cores taking turns, measured
    // 1.37-1.44 ms against 0.91 without the exps). Named barriers 3 and 4 alternate their wgmmas
    // instead, FlashAttention-3's way: each makes its A while the other's wgmmas run. Consumer 1
    // hands consumer 0 the first turn.
    if (c == 1) named_barrier_arrive8(3, 256);
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const bool last_tile = tile + (int)gridDim.x >= tiles;
        int m0, n0;
        tile_origin5<BND>(tile, tiles_m, tiles_n, m0, n0);
        // this thread's two rows (g, g + 8 of its warp's 16): the scale folded into the exponent
        // (scale * 2^(x log2e - lse log2e) = 2^(x log2e - (lse log2e - log2 scale))), +inf for an
        // ignored row (its dlogits are 0), the target, and the scale the target's column loses.
        float lse2[2] = {__int_as_float(0x7f800000), __int_as_float(0x7f800000)}, rscale[2] = {0.0f, 0.0f};
        int tgt[2] = {-1, -1};
        if constexpr (FUSED) {
            #pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = m0 + 64 * c + warp * 16 + g + 8 * h;
                if (row < M && targets[row] >= 0) {
                    tgt[h] = targets[row];
                    lse2[h] = lse[row] * LOG2E - log2f(grad_scale);
                    rscale[h] = grad_scale;
                }
            }
        }
        float d[BND / 2];
        #pragma unroll
        for (int i = 0; i < BND / 2; i++) d[i] = 0.0f;

        auto step = [&](int kt, u32 (&a)[4][4]) {
            const int s = it % STAGESD;
            mbar_wait6(full0 + 8 * s, (it / STAGESD) & 1);
            #pragma unroll                           // FlashAttention-3's rule: A registers are written
            for (int ks = 0; ks < 4; ks++) wg_fence_regs<4>(a[ks]);   // only while no wgmma of ours runs
            const u32 sa = smem0 + s * STAGED_BYTES, sb = sa + A_STAGE5;
            #pragma unroll
            for (int ks = 0; ks < 4; ks++) {
                const int chunk = 2 * ks + lm_half;
                ldmatrix_x4(a[ks][0], a[ks][1], a[ks][2], a[ks][3],
                            sa + lm_row * 128 + ((chunk ^ (lm_row & 7)) << 4));
                if constexpr (FUSED) {
                    // per element: one FMA and one exp2 (the scale is in lse2); the target column
                    // (one per row and chunk of 16) and the padding (the last k-tile only) are patched
                    const int kb = kt * BK5 + ks * 16;
                    const bool tail = kb + 16 > V;
                    const bool hit[2] = {(unsigned)(tgt[0] - kb) < 16u, (unsigned)(tgt[1] - kb) < 16u};
                    #pragma unroll
                    for (int q = 0; q < 4; q++) {          // q: row g (+8 if odd), columns 2t, 2t+1 (+8 if q >= 2)
                        const int h = q & 1, k = kb + 2 * t + 8 * (q >> 1);
                        const float lo = __uint_as_float(a[ks][q] << 16), hi = __uint_as_float(a[ks][q] & 0xffff0000u);
                        float p0 = ex2_approx(fmaf(lo, LOG2E, -lse2[h]));
                        float p1 = ex2_approx(fmaf(hi, LOG2E, -lse2[h]));
                        if (hit[h] && (unsigned)(tgt[h] - k) < 2u) {  // rare: this pair holds the target
                            if (k == tgt[h]) p0 -= rscale[h];
                            else p1 -= rscale[h];
                        }
                        if (tail) {
                            p0 = k < V ? p0 : 0.0f;
                            p1 = k + 1 < V ? p1 : 0.0f;
                        }
                        a[ks][q] = cvt_bf16x2(p0, p1);
                    }
                }
            }
            wg_fence_regs<BND / 2>(d);
            #pragma unroll
            for (int ks = 0; ks < 4; ks++) wg_fence_regs<4>(a[ks]);
            named_barrier_sync7(3 + c, 256);         // my turn on the tensor cores (the other has issued)
            wgmma_fence();
            #pragma unroll
            for (int ks = 0; ks < 4; ks++) wgmma_m64n192k16_rs_mn(d, a[ks], smem_desc(sb + 2048 * ks, 8192, 1024));
            wgmma_commit();
            if (!(c == 1 && last_tile && kt == ktiles - 1))   // (consumer 1's very last turn is not taken)
                named_barrier_arrive8(4 - c, 256);   // the other's turn: it made its A while mine ran
            // Wait for this k-tile's group before the next A is made (the other warpgroup's wgmmas
            // fill the gap): making k-tile kt+1's A while kt's wgmmas run makes ptxas serialize every
            // wgmma (C7513) -- measured 1.09 / 1.55 ms (control / fused) against 0.91 / 1.37 here.
            wgmma_wait<0>();
            wg_fence_regs<BND / 2>(d);
            #pragma unroll
            for (int ks = 0; ks < 4; ks++) wg_fence_regs<4>(a[ks]);
            mbar_arrive6(empty0 + 8 * s);
            it++;
        };
        u32 a0[4][4], a1[4][4];
        for (int kt = 0; kt < ktiles; kt += 2) {
            step(kt, a0);
            if (kt + 1 < ktiles) step(kt + 1, a1);
        }
        #pragma unroll
        for (int i = 0; i < BND / 2; i++) asm volatile("" : "+f"(d[i])::"memory");

        #pragma unroll
        for (int h = 0; h < BND / 64; h++) {                // v7's staged epilogue, rounds of 64 columns
            if (leader) bulk_wait_read<0>();
            named_barrier_sync7(1 + c, 128);
            #pragma unroll
            for (int p = 0; p < 4; p++) {
                const int j = 8 * h + 2 * p, jl = 2 * p + st_blk;
                stmatrix_x4(c_stage + st_row * 128 + (((jl & 7) ^ (st_row & 7)) << 4),
                            cvt_bf16x2(d[4 * j], d[4 * j + 1]), cvt_bf16x2(d[4 * j + 2], d[4 * j + 3]),
                            cvt_bf16x2(d[4 * j + 4], d[4 * j + 5]), cvt_bf16x2(d[4 * j + 6], d[4 * j + 7]));
            }
            fence_proxy_async();
            named_barrier_sync7(1 + c, 128);
            if (leader) {
                tma_store_2d7(map_c, n0 + 64 * h, m0 + 64 * c, c_stage);
                bulk_commit();
            }
        }
    }
    if (leader) bulk_wait_done<0>();
}

#define LMHEAD_DX_BODY(F) lmhead_dx<F>(dx, maps, lse, targets, grad_scale, M, N, K, V)
#else
#define LMHEAD_DX_BODY(F) __trap()
#endif
#define LMHEAD_DX_KERNEL(name, F)                                                                    \
    extern "C" __global__ void __launch_bounds__(384, 1) name(bf16* dx, const unsigned char* maps,   \
            const float* lse, const int* targets, float grad_scale, int M, int N, int K, int V) {      \
        LMHEAD_DX_BODY(F);                                                                           \
    }
LMHEAD_DX_KERNEL(lmhead_dx_fused_kernel, true)      // dlogits made from the logits in registers
LMHEAD_DX_KERNEL(lmhead_dx_control_kernel, false)   // dlogits given, through the same register path
