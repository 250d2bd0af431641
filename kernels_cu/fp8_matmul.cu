/*
 * fp8_matmul.cu -- the LM head's dx GEMM in FP8 that also writes its A operand transposed (sm_90a):
 * the FP8 head's dwte GEMM wants dlogits8 token-contiguous, and this GEMM reads every byte of it
 * anyway, so the standalone transpose pass (fp8_transpose: 412 MB read back and 412 MB written a
 * d12 chunk) goes away.
 *
 * Math:   out (M, N) bf16 = bf16( (a8 (M, K) @ b8 (N, K)^T) * a_scale_inv * b_scale_inv )
 *         a_t (K, M) uint8 = a8^T, byte for byte (when a_t is not null)
 *         a8: E5M2 or E4M3 bytes (AFMT), b8: E4M3, both K-contiguous (FP8 wgmma takes no other
 *         layout). Accumulation: EXACT promotes the tensor cores' FP8 sums into float32 registers
 *         every k-tile (128 products), as cuBLASLt's default ("exact") FP8 GEMMs and CUTLASS's
 *         promotion do: Hopper's FP8 wgmma keeps only ~14 bits of its running sum, which a long K
 *         (the head's 50,304) would otherwise lose small addends to. !EXACT: the wgmma's own sum
 *         across all of K (cuBLASLt's FAST_ACCUM). One rounding to bf16 (cvt.rn.bf16x2). Equal to
 *         cuBLASLt's within the accumulation's rounding, not bit for bit.
 * How:    a persistent grid over 128 x 192 tiles (N = 768 is 4 column tiles; 64 x 4 = 256 tiles of a
 *         d12 chunk run 1.94 waves on 132 SMs, where 128 x 128 tiles would run 1.45), tile t at
 *         (t / tiles_n, t % tiles_n) so the column tiles of one row block run side by side and
 *         read its A from the L2. 384 threads:
 *         - warp 0, lane 0: the producer, TMA loads of A (128 rows x 128 B) and B (192 rows x 128 B)
 *           into FT_STAGES 40 KB stages (128B-swizzled);
 *         - warps 1-3: the transposer. The tile in column j of tiles_n writes A^T for the k-tiles
 *           kt with kt % tiles_n == j, so every byte is written once and the work is spread over
 *           the row block's tiles. Lane L takes row 32 g + L of a 32-row group and one 16-byte
 *           chunk: one conflict-free ld.shared.v4 (the 8 lanes of a quarter-warp have 8 different
 *           row & 7, so 8 different swizzled chunks), then 16 byte stores a_t[k][m0 + 32 g + L]:
 *           each store instruction of the warp writes one whole 32-byte sector.
 *         - warpgroups 1 and 2: the consumers, rows 0-63 and 64-127 of the tile, 4 wgmma
 *           m64n192k32 a k-tile. EXACT: each k-tile's products go to fresh registers (scale-d 0 on
 *           the first), then are added into the float32 sums once they have landed; the two
 *           warpgroups' groups alternate on the tensor cores meanwhile.
 *         empty[s] waits for both consumers (256 arrivals) and the transposer (96), which reads
 *         every stage's full barrier whether or not it transposes that k-tile.
 *         The epilogue stores bf16 pairs straight from the registers: at K = 50,304 a tile has
 *         393 k-tiles, and its store is ~0.1% of its time.
 * Needs:  sm_90a, K % 16 == 0, N % 8 == 0, 16-byte aligned bases; the TMA maps of
 *         gpucore/ops/fp8.py (_head_maps). Any M; edge tiles are zero-filled by TMA and clipped
 *         at the stores.
 * Shared memory: FT_STAGES x 40 KB + 1 KB of alignment (ops/fp8.py FT_SMEM).
 */
#include "common.cuh"
#include "ptx.cuh"                     // smem_u32_asm
#include "wgmma.cuh"                   // descriptors, fences
#include "fast_packs.cuh"              // cvt_rn_bf16x2
#include "ladder/gemm/gemm_hopper.cuh" // mbarriers, TMA copies

#define FT_BM 128
#define FT_BN 192
#define FT_BK 128                              // bytes = FP8 elements: one 128B-swizzled row
#define FT_STAGES 5
#define FT_THREADS 384
#define FT_A_BYTES (FT_BM * FT_BK)             // 16 KB
#define FT_B_BYTES (FT_BN * FT_BK)             // 24 KB
#define FT_STAGE (FT_A_BYTES + FT_B_BYTES)     // 40 KB
#define FT_TRANSPOSERS 96                      // warps 1-3

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// d (64 x 192 per warpgroup, f32) = [d +] A (64 x 32 FP8, K-major) @ B (192 x 32 E4M3, K-major)^T from
// shared memory; scale_d 0 overwrites d (the k-tile's first product when promoting), 1 accumulates.
#define FT_WGMMA(TYPES)                                                                                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"                                            \
                 "wgmma.mma_async.sync.aligned.m64n192k32.f32." TYPES " {"                               \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "      \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "      \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "      \
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "      \
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "     \
                 "%96, %97, p, 1, 1;\n}\n"                                                               \
                 : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56), \
                   WG_D8(64), WG_D8(72), WG_D8(80), WG_D8(88)                                            \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d))
template <bool A_E5M2>
__device__ __forceinline__ void wgmma_m64n192k32_f8(float* d, u64 desc_a, u64 desc_b, int scale_d) {
    if (A_E5M2) FT_WGMMA("e5m2.e4m3");
    else FT_WGMMA("e4m3.e4m3");
}
#undef FT_WGMMA

__device__ __forceinline__ uint4 lds128(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

// A 4-byte global store that the L2 evicts first: the transposed bytes stream out past the GEMM's B,
// which every row block re-reads from the L2.
__device__ __forceinline__ void stg32_evict_first(void* p, u32 v, u64 policy) {
    asm volatile("st.global.L2::cache_hint.b32 [%0], %1, %2;\n" ::"l"(p), "r"(v), "l"(policy) : "memory");
}

// TMA load as tma_load_2d7 with an L2 cache policy (B: evict_last, re-read by every row block).
__device__ __forceinline__ void tma_load_2d_hint(u32 dst, const void* map, int c0, int c1, u32 bar, u64 policy) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                 " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
                 : "memory");
}

// A 4 x 4 byte transpose across the lane quad q = 0..3 (byte b of quad lane q's word: row q, column b):
// returns column q's bytes, row 0 in byte 0. Two exchanges: 16-bit halves with lane q ^ 2, then bytes
// with lane q ^ 1 (every lane of the warp must take part).
__device__ __forceinline__ u32 quad_transpose(u32 x, int q) {
    const u32 y = __shfl_xor_sync(0xffffffffu, x, 2);
    x = __byte_perm(x, y, (q & 2) ? 0x3276 : 0x5410);      // rows {q & 1, (q & 1) + 2}, columns 2 (q >> 1), + 1
    const u32 z = __shfl_xor_sync(0xffffffffu, x, 1);
    return __byte_perm(x, z, (q & 1) ? 0x3715 : 0x6240);
}

// Byte offset in an A stage (128 rows x 128 B, 128B-swizzled) of transposer unit u's 16 bytes for
// `lane`: row (u & 3) * 32 + lane, 16-byte chunk u >> 2.
__device__ __forceinline__ u32 unit_offset(int u, int lane) {
    const int r = (u & 3) * 32 + lane;
    return (u32)(r * 128 + (((u >> 2) ^ (r & 7)) << 4));
}

template <bool A_E5M2, bool EXACT>
__device__ __forceinline__ void fp8_matmul_at(bf16* __restrict__ out, unsigned char* __restrict__ a_t,
                                              const float* a_scale_inv, const float* b_scale_inv,
                                              const unsigned char* maps, int M, int N, int K) {
    extern __shared__ unsigned char smem_ft[];
    __shared__ __align__(8) unsigned long long bars_ft[2 * FT_STAGES];   // full[S], empty[S]
    const u32 smem0 = (smem_u32_asm(smem_ft) + 1023u) & ~1023u;
    const u32 full0 = smem_u32_asm(bars_ft), empty0 = full0 + 8 * FT_STAGES;
    const void* map_a = maps;
    const void* map_b = maps + 128;

    const int tiles_m = (M + FT_BM - 1) / FT_BM, tiles_n = (N + FT_BN - 1) / FT_BN;
    const int tiles = tiles_m * tiles_n;
    const int ktiles = (K + FT_BK - 1) / FT_BK;

    const int tid = threadIdx.x, wg = tid >> 7;
    if (tid == 0) {
        for (int s = 0; s < FT_STAGES; s++) {
            mbar_init6(full0 + 8 * s, 1);
            mbar_init6(empty0 + 8 * s, 256 + FT_TRANSPOSERS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // Registers: 384 threads launch with 168 each; the producer warpgroup's 168 -> 56 pays the
    // consumers' 168 -> 224 (EXACT holds 2 x 96 accumulators a thread).
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
        if (tid == 0) {                                               // ---- producer ----
            tensormap_acquire7(map_a);
            tensormap_acquire7(map_b);
            const u64 keep_b = l2_evict_last();
            int it = 0;
            for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
                const int m0 = (tile / tiles_n) * FT_BM, n0 = (tile % tiles_n) * FT_BN;
                for (int kt = 0; kt < ktiles; kt++, it++) {
                    const int s = it % FT_STAGES;
                    if (it >= FT_STAGES) mbar_wait6(empty0 + 8 * s, ((it / FT_STAGES) - 1) & 1);
                    const u32 base = smem0 + s * FT_STAGE, bar = full0 + 8 * s;
                    mbar_arrive_expect_tx7(bar, FT_STAGE);           // edge boxes count whole: zero-filled
                    tma_load_2d7(base, map_a, kt * FT_BK, m0, bar);
#ifdef FT_NO_HINTS
                    tma_load_2d7(base + FT_A_BYTES, map_b, kt * FT_BK, n0, bar);
#else
                    tma_load_2d_hint(base + FT_A_BYTES, map_b, kt * FT_BK, n0, bar, keep_b);
#endif
                }
            }
        } else if (tid >= 32) {                                       // ---- transposer ----
            const int tw = (tid >> 5) - 1, lane = tid & 31;
            const u64 stream_out = l2_evict_first();
            int it = 0;
            for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
                const int m0 = (tile / tiles_n) * FT_BM, j = tile % tiles_n;
                for (int kt = 0; kt < ktiles; kt++, it++) {
                    const int s = it % FT_STAGES;
                    mbar_wait6(full0 + 8 * s, (it / FT_STAGES) & 1);
#ifdef FT_EARLY_RELEASE                                               // probe switch (wrong bytes): the stage freed first
                    mbar_arrive6(empty0 + 8 * s);
#endif
                    if (a_t != nullptr && kt % tiles_n == j) {
                        const u32 base = smem0 + s * FT_STAGE;
                        const int k0 = kt * FT_BK;
                        // 32 units: 4 row groups x 8 chunks of 16 bytes; warp tw takes units tw, tw + 3,
                        // ..., each unit's load issued one unit ahead
                        const int q = lane & 3;
                        uint4 v = lds128(base + unit_offset(tw, lane));
                        for (int u = tw; u < 32; u += 3) {
                            const uint4 next = u + 3 < 32 ? lds128(base + unit_offset(u + 3, lane)) : v;
                            const int r = (u & 3) * 32 + lane, k = k0 + 16 * (u >> 2), m = m0 + (r & ~3);
                            // 4 x 4 byte blocks turned within each lane quad (rows r0..r0+3): lane q
                            // ends with column k + 4 j + q of those rows, and the 8 lanes of one q
                            // store 32 consecutive bytes of it (whole sectors).
                            const u32 w[4] = {quad_transpose(v.x, q), quad_transpose(v.y, q),
                                              quad_transpose(v.z, q), quad_transpose(v.w, q)};
#ifdef FT_NO_T_STORES                                                 // probe switch: the turn without the stores
                            if (w[0] == 0x9e3779b9u && w[1] == w[2] && w[3] == 0x7f4a7c15u && m < M && k < K) {
#else
                            if (m < M && k < K) {                     // M, K % 16 == 0: the quad's 4 rows, all 16 columns
#endif
                                unsigned char* p = a_t + (size_t)(k + q) * M + m;
                                #pragma unroll
                                for (int j = 0; j < 4; j++)
                                    stg32_evict_first(p + (size_t)(4 * j) * M, w[j], stream_out);
                            }
                            v = next;
                        }
                    }
#ifndef FT_EARLY_RELEASE
                    mbar_arrive6(empty0 + 8 * s);      // release: the shared loads above are done
#endif
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");     // ---- consumers ----
    const int c = wg - 1, lane = tid & 31, warp = (tid >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    const float ab = *a_scale_inv * *b_scale_inv;
    int it = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int m0 = (tile / tiles_n) * FT_BM, n0 = (tile % tiles_n) * FT_BN;
        float acc[96], d[96];
        #pragma unroll
        for (int r = 0; r < 96; r++) { acc[r] = 0.0f; d[r] = 0.0f; }
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const int s = it % FT_STAGES;
            mbar_wait6(full0 + 8 * s, (it / FT_STAGES) & 1);
            const u32 sa = smem0 + s * FT_STAGE + c * (64 * FT_BK), sb = smem0 + s * FT_STAGE + FT_A_BYTES;
            const u64 da = smem_desc(sa, 16, 1024), db = smem_desc(sb, 16, 1024);
            wgmma_fence();
            #pragma unroll
            for (int ks = 0; ks < FT_BK / 32; ks++)
                wgmma_m64n192k32_f8<A_E5M2>(d, desc_add(da, 32 * ks), desc_add(db, 32 * ks), EXACT ? (ks > 0) : 1);
            wgmma_commit();
            if (EXACT) {
                wgmma_wait<0>();
                wg_fence_regs<96>(d);
                mbar_arrive6(empty0 + 8 * s);
                #pragma unroll
                for (int r = 0; r < 96; r++) acc[r] += d[r];
            } else {
                wgmma_wait<1>();
                if (kt > 0) mbar_arrive6(empty0 + 8 * ((it - 1) % FT_STAGES));
            }
        }
        if (!EXACT) {
            wgmma_wait<0>();
            wg_fence_regs<96>(d);
            mbar_arrive6(empty0 + 8 * ((it - 1) % FT_STAGES));
        }
        const float* sum = EXACT ? acc : d;
        const int row = m0 + 64 * c + 16 * warp + g;
        #pragma unroll
        for (int jn = 0; jn < FT_BN / 8; jn++) {
            const int col = n0 + 8 * jn + 2 * t;
            if (col < N) {                                        // N % 8 == 0: the pair is in too
                if (row < M)
                    *reinterpret_cast<u32*>(out + (size_t)row * N + col) =
                        cvt_rn_bf16x2(sum[4 * jn] * ab, sum[4 * jn + 1] * ab);
                if (row + 8 < M)
                    *reinterpret_cast<u32*>(out + (size_t)(row + 8) * N + col) =
                        cvt_rn_bf16x2(sum[4 * jn + 2] * ab, sum[4 * jn + 3] * ab);
            }
        }
    }
}

#define FT_BODY(E5, EX) fp8_matmul_at<E5, EX>(out, a_t, a_scale_inv, b_scale_inv, maps, M, N, K)
#else
#define FT_BODY(E5, EX) __trap()          // not sm_90a: Python never launches these
#endif

// a8 E5M2 (the head's dlogits8) or E4M3; b8 E4M3; exact (promoted) or fast accumulation.
#define FT_KERNEL(NAME, E5, EX)                                                                        \
    extern "C" __global__ void __launch_bounds__(FT_THREADS, 1) NAME(                                  \
            bf16* out, unsigned char* a_t, const float* a_scale_inv, const float* b_scale_inv,         \
            const unsigned char* maps, int M, int N, int K) {                                          \
        FT_BODY(E5, EX);                                                                               \
    }
FT_KERNEL(fp8_matmul_at_kernel_e5m2_exact, true, true)
FT_KERNEL(fp8_matmul_at_kernel_e5m2_fast, true, false)
FT_KERNEL(fp8_matmul_at_kernel_e4m3_exact, false, true)
FT_KERNEL(fp8_matmul_at_kernel_e4m3_fast, false, false)
