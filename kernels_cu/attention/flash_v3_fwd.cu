/*
 * attention/flash_v3_fwd.cu (v3 forward) -- causal multi-head attention forward on Hopper's wgmma, PIPELINED
 * (v3 "p" variants, sm_90a). Same op, arguments, launch grid and out/lse layouts as
 * ladder/attention/flash_v3_fwd_serial.cu (read its header first); this file only changes the schedule.
 *
 * Op: qkv (B, T, 3C) bf16 -> out (B, T, C) bf16 = causal softmax(scale q k^T) v per head,
 *     lse (B, NH, T) f32 = log sum_j exp(s_ij). HD in {64, 128}. No gradients here.
 *
 * Why: ladder/attention/flash_v3_fwd_serial.cu runs fence -> wgmma -> commit -> wait<0> for every batch, so a
 * warpgroup's tensor-core work and its softmax (MUFU ex2: at hd 64 as many cycles per tile as
 * the matmuls) never overlap, and the per-iteration __syncthreads keeps both warpgroups of a
 * block in the same phase. Measured 244 TFLOP/s on an H200 (B64 NH12 T1024 hd64).
 *
 * Schedule here (FlashAttention-3's intra-warpgroup overlap, Shah et al. 2024, sec. 3.2):
 *   iteration j (per warpgroup, warpgroup-uniform branches):
 *     fence; issue S_j = Q K_j^T (commit group A); issue O += P_{j-1} V_{j-1} (commit group B)
 *     wait<1>          -> group A (S_j) done, group B (P V) may still run
 *     mask + online-softmax statistics + exp of S_j   <- overlaps the P V wgmma on the tensor cores
 *     wait<0>          -> O complete (P_{j-1} registers free again)
 *     O *= alpha_j, l update, P_j = bf16(S_j) into the register-A fragments
 *   after the warpgroup's last tile: one more O += P V (in iteration n_wg, or after the loop).
 *   Register cost: S_j (f32), P_{j-1} (bf16) and O live together.
 * K/V ring of NSTAGE stages (cp.async, all threads, 128B swizzle as in v3), PRE = NSTAGE - 2
 * tiles copied ahead: at the top of iteration j tile j + PRE is copied into stage
 * (j + PRE) % NSTAGE, whose previous tile j + PRE - NSTAGE <= j - 2 is retired: its K by S_{j-2}
 * (waited in iteration j-2) and its V by P_{j-2} V_{j-2} (issued in iteration j-1, waited there
 * with wait<0>), and every thread passed iteration j-1 before the barrier. V_{j-1} (read by the
 * P V issued in iteration j) is never the stage being overwritten because PRE + 1 < NSTAGE.
 * cp.async groups: the prologue commits PRE groups (group 0 = Q + tile 0, then tiles 1..PRE-1),
 * every iteration one (possibly empty): before iteration j's barrier PRE + j groups exist and
 * tile j is group j, so cp.async.wait_group PRE - 1 lands it.
 * Numerics: identical to v3 (same math, same rounding points): out/lse agree bit-for-bit with
 * ladder/attention/flash_v3_fwd_serial.cu up to the order of wgmma accumulation, which is the same.
 */
#include "attention/flash.cuh"   // FA_LOG2E, FA_LN2, FA_NEG_INF, fast_exp2, pack_bf16x2_rn
#include "wgmma.cuh"
#include "attention/flash_v3.cuh"   // v3_off, v3_load_tile, v3_to_frags, v3_mma_ss/rs
#include "fp8_cast.cuh"             // quantize8, store_block4_t, block_amax: the F8 epilogue

// The F8 epilogue (attention_forward_f8_kernel_*, hd 64; --dtype fp8): after v3_fwd_epilogue, the
// output's E4M3 bytes for the attention projection's FP8 GEMM -- the bits fp8_cast makes of the
// bf16 out (ops/fp8.py fp8_quantize(out, "e4m3", scale8, out=, out_t=, amax=)), so that cast's
// pass (a re-read of out) goes. Each warp re-reads its 16 bf16 rows from its own smem rows (still
// there after v3_fwd_epilogue's stores), quantizes each 16-byte chunk (quantize8: bf16 bit max on
// the way), stores out8 (B*T, C) row-major, then rewrites its rows as a byte tile (16 rows of
// HD + 4 bytes: the odd word pitch spreads the transposed gathers over the banks) and stores out8_t
// (C, B*T) in 4 x 4 blocks (store_block4_t): 4 lanes cover a channel's 16 tokens, and the block's
// 8 warps a channel's 128 contiguous tokens. Rows >= T skipped (T % 4 == 0: a block is all in or
// all out). amax8 (optional): max |out| by the same bit max, atomicMax over blocks. All threads call
// it (block_amax's barrier).
template <int HD, int BM>
__device__ __forceinline__ void v3_fwd_epilogue_f8(u8* out8, u8* out8_t, float* amax8, float s8, unsigned char* smem_gen,
                                                   int b, int h, int T, int C, int R, int m0, int wg, int w4, int lane) {
    static_assert(HD == 64, "the F8 epilogue's byte tile fits the warp's smem rows at hd 64");
    constexpr int ND = HD / 8, PITCH = HD + 4;                  // chunks a row; byte-tile row pitch
    const int lr0 = 64 * wg + 16 * w4;
    u32 m = 0;
    uint2 q[16 * ND / 32];
    __syncwarp();                                              // v3_fwd_epilogue's reads are done
    #pragma unroll
    for (int it = 0; it < 16 * ND / 32; it++) {
        const int i = it * 32 + lane;
        const int r = i / ND, c = i % ND;
        const int row = m0 + lr0 + r;
        q[it] = make_uint2(0u, 0u);
        if (row < T) {
            q[it] = quantize8<E4M3>(*reinterpret_cast<const uint4*>(smem_gen + v3_off<BM>(lr0 + r, c)), s8, m);
            if (out8) *reinterpret_cast<uint2*>(out8 + ((size_t)b * T + row) * C + h * HD + c * 8) = q[it];
        }
    }
    if (out8_t) {
        u32* tile = reinterpret_cast<u32*>(smem_gen + v3_off<BM>(lr0, 0));   // the warp's 16 rows: 2 KB, contiguous
        __syncwarp();                                          // every lane has read its chunks
        #pragma unroll
        for (int it = 0; it < 16 * ND / 32; it++) {
            const int i = it * 32 + lane;
            const int r = i / ND, c = i % ND;
            tile[(r * PITCH + c * 8) / 4] = q[it].x;
            tile[(r * PITCH + c * 8) / 4 + 1] = q[it].y;
        }
        __syncwarp();
        #pragma unroll
        for (int k = lane; k < 4 * (HD / 4); k += 32) {        // 4 x 4 blocks: 4 row quads x HD/4 column words
            const int rq = k & 3, cw = k >> 2;
            const int row = m0 + lr0 + 4 * rq;
            if (row < T)
                store_block4_t(out8_t, tile + (4 * rq * PITCH) / 4 + cw, PITCH / 4, R, (long long)h * HD + 4 * cw,
                               (long long)b * T + row);
        }
    }
    if (amax8) block_amax(amax8, m);
}

// K/V tile copies with the per-thread index math done once: the same chunks, addresses and bytes as
// v3_load_tile (thread tid copies rows tid / CPR + it * RSTEP, chunk tid % CPR), but a tile costs
// one 64-bit base per call instead of a row/chunk/swizzle/64-bit-offset computation per 16 bytes
// (SASS of the loop top before: ~60 of its ~90 instructions were that, per warp per tile).
// RSTEP % 8 == 0 keeps the 128B-swizzle phase, so row it's smem offset is soff + it * RSTEP * 128.
// Tiles are copied in order (0, 1, 2, ...): `next` points at this thread's first chunk of the next
// tile and advances by BN rows per copy.
template <int BN, int HD, int NT>
struct V3KvCopier {
    static constexpr int CPR = HD / 8, IT = BN * CPR / NT, RSTEP = NT / CPR;
    static_assert(NT % CPR == 0 && RSTEP % 8 == 0 && (BN * CPR) % NT == 0, "copy walk");
    const bf16* next;       // (row0 + r0, chunk) of the next tile's K
    int row0, rstep;        // this thread's first row in a tile; RSTEP rows in elements
    u32 soff;
    __device__ __forceinline__ V3KvCopier(const bf16* k, int stride) {
        row0 = threadIdx.x / CPR;
        const int c = threadIdx.x % CPR;
        next = k + (size_t)row0 * stride + c * 8;
        rstep = RSTEP * stride;
        soff = v3_off<BN>(row0, c);
    }
    // The next tile, rows [r0, r0 + BN) of K (k: a (T, HD) slice, rows `stride` apart) and of V
    // (k + C), into the swizzled tiles at sk, sv; rows >= T zero-filled (src-size 0, source k).
    __device__ __forceinline__ void load_next(u32 sk, u32 sv, const bf16* k, int C, int r0, int T, int stride) {
        #pragma unroll
        for (int it = 0; it < IT; it++) {
            const bool valid = r0 + row0 + it * RSTEP < T;
            const bf16* src = valid ? next + it * rstep : k;
            cp_async16(sk + soff + it * RSTEP * 128, src, valid ? 16 : 0);
            cp_async16(sv + soff + it * RSTEP * 128, src + C, valid ? 16 : 0);
        }
        next += (size_t)BN * stride;
    }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// O += P V for one KV tile (V stage at shared address vb); issue only (caller commits/waits).
template <int HD, int BN>
__device__ __forceinline__ void v3p_issue_pv(float* o, u32 (&pa)[BN / 16][4], u32 vb) {
    const u64 v_desc = smem_desc(vb, BN * 128, 1024);
    #pragma unroll
    for (int kk = 0; kk < BN / 16; kk++)                       // V k-step: 16 key rows = 2048 B
        v3_mma_rs<HD>(o, pa[kk], desc_add(v_desc, kk * 2048), 1);
}

// The warpgroup's last O += P V (nothing else in flight): fence, issue, wait<0>.
template <int HD, int BN>
__device__ __forceinline__ void v3p_last_pv(float (&o)[HD / 2], u32 (&pa)[BN / 16][4], u32 vb) {
    wg_fence_regs<HD / 2>(o);
    #pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) wg_fence_regs<4>(pa[kk]);
    wgmma_fence();
    v3p_issue_pv<HD, BN>(o, pa, vb);
    wgmma_commit();
    wgmma_wait<0>();
    wg_fence_regs<HD / 2>(o);
    #pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) wg_fence_regs<4>(pa[kk]);
}

// One KV tile j for one warpgroup: S_j = Q K_j^T (group A) and, if PV, O += P_{j-1} V_{j-1}
// (group B, V at vb); wait<1> (S_j done), mask (MASK: tile crosses the diagonal) + online
// softmax of S_j while P V runs; wait<0>; O *= alpha, l update; P_j = bf16(S_j) into pa.
// Registers of an in-flight wgmma (o, pa while group B runs; s while group A runs) are not
// touched between its issue and its wait.
template <int HD, int NWG, int BN, bool PV, bool MASK>
__device__ __forceinline__ void v3p_step(float (&s)[BN / 2], float (&o)[HD / 2], u32 (&pa)[BN / 16][4],
                                         float (&m_run)[2], float (&l_run)[2], u32 sQ, u32 kb, u32 vb,
                                         int wg, int n0, int row0, int t4, float sl2) {
    constexpr int BM = 64 * NWG, NS = BN / 8, ND = HD / 8;
    // All register writes by ordinary code (last softmax, rescale, pack) stay above the fence.
    wg_fence_regs<BN / 2>(s);
    wg_fence_regs<HD / 2>(o);
    #pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) wg_fence_regs<4>(pa[kk]);
    wgmma_fence();
    const u64 q_desc = smem_desc(sQ + wg * (64 * 128), 16, 1024), k_desc = smem_desc(kb, 16, 1024);
    #pragma unroll
    for (int ks = 0; ks < HD / 16; ks++)                       // S_j: k-step ks = 16 head dims
        v3_mma_ss<BN>(s, desc_add(q_desc, (ks >> 2) * (BM * 128) + (ks & 3) * 32),
                      desc_add(k_desc, (ks >> 2) * (BN * 128) + (ks & 3) * 32), ks > 0);
    wgmma_commit();
    if (PV) {                                                  // compile-time
        v3p_issue_pv<HD, BN>(o, pa, vb);
        wgmma_commit();
        wgmma_wait<1>();                                       // S_j done; P V may still run
    } else {
        wgmma_wait<0>();
    }
    wg_fence_regs<BN / 2>(s);                                  // S reads stay below the wait

    // ---- softmax of S_j: touches s, m_run and scalars only (o and pa are in flight) ----
    if (MASK) {                                                // compile-time
        #pragma unroll
        for (int nt = 0; nt < NS; nt++) {
            #pragma unroll
            for (int e = 0; e < 2; e++) {
                const int key = n0 + nt * 8 + 2 * t4 + e;
                s[4 * nt + e] = key > row0 ? FA_NEG_INF : s[4 * nt + e];
                s[4 * nt + 2 + e] = key > row0 + 8 ? FA_NEG_INF : s[4 * nt + 2 + e];
            }
        }
    }
    float alpha[2], rsum[2];
    #pragma unroll
    for (int r = 0; r < 2; r++) alpha[r] = v3_softmax_row<BN>(s, m_run[r], sl2, r, rsum[r]);
    if (PV) {                                                  // O and P_{j-1} free again
        wgmma_wait<0>();
        wg_fence_regs<HD / 2>(o);
        #pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) wg_fence_regs<4>(pa[kk]);
    }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        l_run[r] = l_run[r] * alpha[r] + rsum[r];
        #pragma unroll
        for (int dt = 0; dt < ND; dt++) {
            o[4 * dt + 2 * r] *= alpha[r];
            o[4 * dt + 2 * r + 1] *= alpha[r];
        }
    }
    // P_j: k-step kk (keys 16kk..16kk+15) = S n8 blocks 2kk, 2kk+1 as bf16.
    v3_to_frags<BN>(pa, s);
}

template <int HD, int NWG, int BN, int NSTAGE, bool F8 = false>
__device__ __forceinline__ void flash_forward_v3p(bf16* out,          // (B, T, C)
                                                  float* lse,         // (B, NH, T)
                                                  const bf16* qkv,    // (B, T, 3C)
                                                  int T, int NH, float scale,
                                                  u8* out8 = nullptr, u8* out8_t = nullptr,   // F8 only
                                                  float* amax8 = nullptr, const float* scale8 = nullptr) {
    constexpr int BM = 64 * NWG, NT = 128 * NWG;
    constexpr int PRE = NSTAGE - 2;                           // tiles copied ahead of the one in use
    static_assert(PRE >= 1, "NSTAGE >= 3: V_{j-1}, tile j and PRE tiles in flight");
    constexpr u32 Q_BYTES = BM * HD * 2, KV_BYTES = BN * HD * 2;
    extern __shared__ unsigned char smem_v3p[];
    const u32 sQ = (smem_u32_asm(smem_v3p) + 1023u) & ~1023u;  // swizzle atoms: 1024-byte aligned
    const u32 sK = sQ + Q_BYTES;                               // NSTAGE x KV_BYTES
    const u32 sV = sK + NSTAGE * KV_BYTES;                     // NSTAGE x KV_BYTES
    unsigned char* const smem_gen = smem_v3p + (sQ - smem_u32_asm(smem_v3p));

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, w4 = warp & 3;
    const int g = lane >> 2, t4 = lane & 3;
    int bh, rank;
    v3_block_order(bh, rank);
    const int b = bh / NH, h = bh % NH;
    const int m0 = (gridDim.y - 1 - rank) * BM;                 // heaviest tiles first
    const int C = NH * HD, stride = 3 * C;
    const bf16* q_g = qkv + (size_t)b * T * stride + h * HD;
    const bf16* k_g = q_g + C;
    const int n_tiles = ceil_div(min(T, m0 + BM), BN);         // KV tiles with a key <= last row

    // Prologue: group 0 = Q + tile 0, groups 1..PRE-1 = tiles 1..PRE-1 (empty past the end).
    v3_load_tile<BM, HD, NT>(sQ, q_g, m0, T, stride);
    V3KvCopier<BN, HD, NT> kv_copy(k_g, stride);
    #pragma unroll
    for (int p = 0; p < PRE; p++) {
        if (p < n_tiles) kv_copy.load_next(sK + p * KV_BYTES, sV + p * KV_BYTES, k_g, C, p * BN, T, stride);
        cp_async_commit();
    }

    const int wm0 = m0 + 64 * wg;                              // this warpgroup's first row
    // Tiles this warpgroup computes: keys <= its last row (0 if all its rows are >= T).
    const int n_wg = wm0 < T ? min(n_tiles, (wm0 + 63) / BN + 1) : 0;
    const int row0 = wm0 + 16 * w4 + g;                        // this thread's rows: row0, row0 + 8
    const float sl2 = scale * FA_LOG2E;                        // scores in log2 units

    float s[BN / 2], o[HD / 2];
    u32 pa[BN / 16][4];                                        // P_{j-1} as register-A fragments
    #pragma unroll
    for (int i = 0; i < BN / 2; i++) s[i] = 0.f;
    #pragma unroll
    for (int i = 0; i < HD / 2; i++) o[i] = 0.f;
    #pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
    float m_run[2] = {FA_NEG_INF, FA_NEG_INF}, l_run[2] = {0.f, 0.f};

    for (int j = 0; j < n_tiles; j++) {
        cp_async_wait<PRE - 1>();                              // tile j landed (this thread's copies)
        fence_proxy_async();                                   // ... visible to wgmma (async proxy)
        __syncthreads();                                       // ... everyone's; stage of j-2 retired
        {
            const int jn = j + PRE;
            if (jn < n_tiles)
                kv_copy.load_next(sK + (jn % NSTAGE) * KV_BYTES, sV + (jn % NSTAGE) * KV_BYTES, k_g, C, jn * BN, T,
                                  stride);
            cp_async_commit();                                 // one group per iteration, maybe empty
        }
        // Warpgroup-uniform dispatch. Each step is a complete fence ... wait<0> unit with no
        // branch while a wgmma is in flight (ptxas serialises wgmma across divergent paths,
        // C7520), hence the MASK template instead of a run-time mask branch.
        const int n0 = j * BN;
        const bool diag = n0 + BN - 1 > wm0;                   // crosses this warpgroup's diagonal
        const u32 kb = sK + (j % NSTAGE) * KV_BYTES;
        const u32 vb = sV + ((j + NSTAGE - 1) % NSTAGE) * KV_BYTES;   // V_{j-1}
        if (j < n_wg) {
            if (j == 0) {
                if (diag) v3p_step<HD, NWG, BN, false, true>(s, o, pa, m_run, l_run, sQ, kb, vb, wg, n0, row0, t4, sl2);
                else v3p_step<HD, NWG, BN, false, false>(s, o, pa, m_run, l_run, sQ, kb, vb, wg, n0, row0, t4, sl2);
            } else {
                if (diag) v3p_step<HD, NWG, BN, true, true>(s, o, pa, m_run, l_run, sQ, kb, vb, wg, n0, row0, t4, sl2);
                else v3p_step<HD, NWG, BN, true, false>(s, o, pa, m_run, l_run, sQ, kb, vb, wg, n0, row0, t4, sl2);
            }
        } else if (j == n_wg && j > 0) {
            v3p_last_pv<HD, BN>(o, pa, vb);                    // P_{n_wg-1} V_{n_wg-1}
        }
    }
    // The warpgroup's last P V when it ran to the block's last tile (no copies after the loop,
    // so V stage (n_tiles - 1) % NSTAGE is intact).
    if (n_wg > 0 && n_wg == n_tiles) v3p_last_pv<HD, BN>(o, pa, sV + ((n_tiles - 1) % NSTAGE) * KV_BYTES);
    cp_async_wait<0>();

    // Epilogue (as v3): quad sums, lse, O / l as bf16 into this warp's own 16 Q rows (only this
    // warpgroup's wgmma read them, all retired), then 16-byte coalesced stores.
    v3_fwd_epilogue<HD, BM>(out, lse, o, m_run, l_run, n_wg > 0, smem_gen, row0, bh, b, h, T, C, m0, wg, w4, lane);
    if constexpr (F8)
        v3_fwd_epilogue_f8<HD, BM>(out8, out8_t, amax8, *scale8, smem_gen, b, h, T, C, (int)(gridDim.x / NH) * T, m0,
                                   wg, w4, lane);
}

#define FLASH_V3P_BODY(HD, NWG, BN, NSTAGE) flash_forward_v3p<HD, NWG, BN, NSTAGE>(out, lse, qkv, T, NH, scale)
#define FLASH_V3P_F8_BODY(HD, NWG, BN, NSTAGE) \
    flash_forward_v3p<HD, NWG, BN, NSTAGE, true>(out, lse, qkv, T, NH, scale, out8, out8_t, amax8, scale8)
#else
#define FLASH_V3P_BODY(HD, NWG, BN, NSTAGE) __trap()   // not sm_90a: Python never launches this
#define FLASH_V3P_F8_BODY(HD, NWG, BN, NSTAGE) __trap()
#endif

// Configurations (HD, consumer warpgroups, keys per KV tile, K/V stages, MINB = blocks per SM
// for __launch_bounds__ (not in the name)); ops/attention.py launches V3_FWD_CONFIG,
// gpucore/ladder/attention.py lists all of them (V3_FWD_CONFIGS) as (warpgroups, BN, stages). Dynamic shared memory = 1024 + (64 * NWG + 2 * NSTAGE * BN) * HD * 2.
#define FLASH_FWD_V3P(HD, NWG, BN, NSTAGE, MINB)                                               \
    extern "C" __global__ void __launch_bounds__(128 * NWG, MINB)                               \
    attention_forward_kernel_v3_hd##HD##_g##NWG##_n##BN##_s##NSTAGE##_bf16(                     \
            bf16* out, float* lse, const bf16* qkv, int T, int NH, float scale) {               \
        FLASH_V3P_BODY(HD, NWG, BN, NSTAGE);                                                    \
    }

FLASH_FWD_V3P(64, 2, 64, 3, 2)
FLASH_FWD_V3P(64, 2, 128, 3, 1)
FLASH_FWD_V3P(64, 2, 64, 4, 2)
FLASH_FWD_V3P(128, 2, 64, 3, 1)

// The F8 variant of the production configuration (ops/attention.py V3_FWD_CONFIG[64]): also the
// output's E4M3 bytes (v3_fwd_epilogue_f8). out8 / out8_t / amax8 may be null (not all three).
#define FLASH_FWD_V3P_F8(HD, NWG, BN, NSTAGE, MINB)                                            \
    extern "C" __global__ void __launch_bounds__(128 * NWG, MINB)                               \
    attention_forward_f8_kernel_v3_hd##HD##_g##NWG##_n##BN##_s##NSTAGE##_bf16(                  \
            bf16* out, float* lse, const bf16* qkv, int T, int NH, float scale,                 \
            u8* out8, u8* out8_t, float* amax8, const float* scale8) {                          \
        FLASH_V3P_F8_BODY(HD, NWG, BN, NSTAGE);                                                 \
    }

FLASH_FWD_V3P_F8(64, 2, 64, 3, 2)
