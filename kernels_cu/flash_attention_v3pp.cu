/*
 * flash_attention_v3pp.cu -- causal multi-head attention forward on Hopper's wgmma, WARP-SPECIALISED
 * + PING-PONG (v3 "pp" variants, sm_90a). Same op, arguments, grid and out/lse layouts as
 * flash_attention_v3.cu / flash_attention_v3p.cu (read v3p's header first: the per-warpgroup
 * math, the S_j / P_{j-1} V_{j-1} overlap and the register rules are v3p's v3p_step unchanged).
 *
 * Op: qkv (B, T, 3C) bf16 -> out (B, T, C) bf16 = causal softmax(scale q k^T) v per head,
 *     lse (B, NH, T) f32 = log sum_j exp(s_ij). HD in {64, 128}. No gradients here.
 *
 * Why: v3p (2,64,3) measured 256 TFLOP/s on an H200. Its per-tile __syncthreads keeps the two
 * consumer warpgroups of a block in lockstep (both softmax at the same time, tensor cores idle),
 * and every consumer thread issues 4+ cp.async per tile. Here (FlashAttention-3, Shah et al. 2024,
 * sec. 3.1):
 *  - Producer warp (warp 4 * NWG, 32 threads) copies Q and the K/V tiles with cp.async into an
 *    NSTAGE ring. Per tile t: wait empty[t % NSTAGE] (consumers retired tile t - NSTAGE), issue,
 *    commit; then publish tile t - 1: cp.async.wait_group 1 (own copies of t - 1 landed),
 *    fence.proxy.async (visible to wgmma), mbarrier.arrive full[(t-1) % NSTAGE] (count 32,
 *    release). After the loop: wait_group 0 and publish the last tile. Publishing t needs t + 1
 *    issued, which needs tile t + 1 - NSTAGE retired (consumer iteration t + 2 - NSTAGE < t only
 *    for NSTAGE >= 3, hence the static_assert: NSTAGE 2 would deadlock).
 *  - Consumers never block on each other: iteration j waits full[j % NSTAGE] (parity
 *    (j / NSTAGE) & 1, acquire) for every tile j < n_tiles (also tiles it skips), and at the end of iteration j >= 1
 *    every consumer thread arrives on empty[(j-1) % NSTAGE] (count 128 * NWG): by then K_{j-1}
 *    (S_{j-1}, waited in iteration j-1) and V_{j-1} (P_{j-1} V_{j-1}, waited with wait<0> in
 *    iteration j) are retired. Every consumer arrives for every tile, also the ones it skips
 *    (causal), so the counts always match; because it also waited full for that tile first, one
 *    consumer's arrivals can never land two in one phase of empty (a consumer skipping ahead
 *    would otherwise release a stage another warpgroup still reads). No parity ABA: the producer
 *    refills a stage only after every consumer released it.
 *  - PP (ping-pong, FA3 sec. 3.1 "pingpong scheduling"): the consumer warpgroups take turns
 *    issuing their GEMMs. Warpgroup w does bar.sync (1 + w, 256) before issuing and bar.arrive
 *    (1 + (w + 1) % NWG, 256) right after, so while w's GEMMs run on the tensor cores the next
 *    warpgroup's softmax runs and vice versa. Every consumer does exactly one sync + arrive in
 *    each of its n_tiles + 1 iterations (also with nothing to issue). Warpgroup NWG - 1 arrives
 *    on barrier 1 once before the loop (warpgroup 0 goes first) and warpgroup 0 syncs on it once
 *    after the loop (absorbs the last arrive; no barrier phase left open at exit). Strict
 *    alternation: w's arrive of iteration j comes after w's sync of iteration j, which needs the
 *    previous warpgroup's arrive of iteration j, ... back to w + 1's sync of iteration j, so two
 *    arrives on one barrier never meet without the sync between them.
 *  Ordering (as v3/v3p): wgmma never runs across a run-time branch (ptxas C7520): the named
 *  barriers and mbarrier waits sit outside fence ... wait<0> units or are straight-line inside.
 * Numerics: identical to v3p (same math, same rounding points).
 */
#include "flash_attention.cuh"   // FA_LOG2E, FA_LN2, FA_NEG_INF, fast_exp2, pack_bf16x2_rn
#include "wgmma.cuh"

// Byte offset of 16-byte chunk c of row r in a (ROWS, HD) tile stored as HD/64 column blocks of
// (ROWS x 128 B), each 128B-swizzled (same as flash_attention_v3.cu's v3_off).
template <int ROWS>
__device__ __forceinline__ u32 v3pp_off(int r, int c) { return (u32)((c >> 3) * (ROWS * 128)) + wg_swz128(r, c & 7); }

// Producer warp: rows [r0, r0 + ROWS) of a (T, HD) slice -> swizzled tile at shared address s;
// rows >= T zero-filled. 32 threads (lane = 0..31).
template <int ROWS, int HD>
__device__ __forceinline__ void v3pp_load_tile(u32 s, const bf16* g, int r0, int T, int stride, int lane) {
    constexpr int CPR = HD / 8;
    static_assert((ROWS * CPR) % 32 == 0, "tile chunks must divide evenly among the producer lanes");
    #pragma unroll 8
    for (int it = 0; it < ROWS * CPR / 32; it++) {
        const int i = it * 32 + lane;
        const int row = i / CPR, c = i % CPR;
        const bool valid = r0 + row < T;
        const bf16* src = valid ? g + (size_t)(r0 + row) * stride + c * 8 : g;
        wg_cp_async16(s + v3pp_off<ROWS>(row, c), src, valid ? 16 : 0);
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <int BN> struct V3PPSS;
template <> struct V3PPSS<64> {
    static __device__ __forceinline__ void run(float* d, u64 a, u64 b, int sc) { wgmma_m64n64k16_ss_kk(d, a, b, sc); }
};
template <> struct V3PPSS<128> {
    static __device__ __forceinline__ void run(float* d, u64 a, u64 b, int sc) { wgmma_m64n128k16_ss_kk(d, a, b, sc); }
};
template <int HD> struct V3PPRS;
template <> struct V3PPRS<64> {
    static __device__ __forceinline__ void run(float* d, const u32 (&a)[4], u64 b) { wgmma_m64n64k16_rs_mn(d, a, b, 1); }
};
template <> struct V3PPRS<128> {
    static __device__ __forceinline__ void run(float* d, const u32 (&a)[4], u64 b) { wgmma_m64n128k16_rs_mn(d, a, b, 1); }
};

template <int HD, int BN>
__device__ __forceinline__ void v3pp_issue_pv(float* o, u32 (&pa)[BN / 16][4], u32 vb) {
    #pragma unroll
    for (int kk = 0; kk < BN / 16; kk++)                       // V k-step: 16 key rows = 2048 B
        V3PPRS<HD>::run(o, pa[kk], smem_desc(vb + kk * 2048, BN * 128, 1024));
}

// Ping-pong turn (PP): wait for this warpgroup's turn / hand it to the next warpgroup.
template <bool PP>
__device__ __forceinline__ void v3pp_turn_begin(int bar_own) { if (PP) wg_bar_sync(bar_own, 256); }
template <bool PP>
__device__ __forceinline__ void v3pp_turn_end(int bar_next) { if (PP) wg_bar_arrive(bar_next, 256); }

// The warpgroup's last O += P V (its turn taken; nothing else in flight): fence, issue, wait<0>.
template <int HD, int BN, bool PP>
__device__ __forceinline__ void v3pp_last_pv(float (&o)[HD / 2], u32 (&pa)[BN / 16][4], u32 vb, int bar_own, int bar_next) {
    wg_fence_regs<HD / 2>(o);
    #pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) wg_fence_regs<4>(pa[kk]);
    v3pp_turn_begin<PP>(bar_own);
    wgmma_fence();
    v3pp_issue_pv<HD, BN>(o, pa, vb);
    wgmma_commit();
    v3pp_turn_end<PP>(bar_next);
    wgmma_wait<0>();
    wg_fence_regs<HD / 2>(o);
    #pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) wg_fence_regs<4>(pa[kk]);
}

// One KV tile j for one warpgroup (v3p_step plus the ping-pong turn around the issue): S_j
// (group A) and, if PV, O += P_{j-1} V_{j-1} (group B); wait<1>; mask + online softmax of S_j
// while P V runs; wait<0>; O *= alpha, l update; P_j = bf16(S_j) into pa.
template <int HD, int NWG, int BN, bool PV, bool MASK, bool PP>
__device__ __forceinline__ void v3pp_step(float (&s)[BN / 2], float (&o)[HD / 2], u32 (&pa)[BN / 16][4],
                                          float (&m_run)[2], float (&l_run)[2], u32 sQ, u32 kb, u32 vb,
                                          int wg, int n0, int row0, int t4, float sl2, int bar_own, int bar_next) {
    constexpr int BM = 64 * NWG, NS = BN / 8, ND = HD / 8;
    wg_fence_regs<BN / 2>(s);
    wg_fence_regs<HD / 2>(o);
    #pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) wg_fence_regs<4>(pa[kk]);
    v3pp_turn_begin<PP>(bar_own);
    wgmma_fence();
    #pragma unroll
    for (int ks = 0; ks < HD / 16; ks++) {                     // S_j: k-step ks = 16 head dims
        const u64 da = smem_desc(sQ + (ks >> 2) * (BM * 128) + wg * (64 * 128) + (ks & 3) * 32, 16, 1024);
        const u64 db = smem_desc(kb + (ks >> 2) * (BN * 128) + (ks & 3) * 32, 16, 1024);
        V3PPSS<BN>::run(s, da, db, ks > 0);
    }
    wgmma_commit();
    if (PV) {                                                  // compile-time
        v3pp_issue_pv<HD, BN>(o, pa, vb);
        wgmma_commit();
        v3pp_turn_end<PP>(bar_next);
        wgmma_wait<1>();                                       // S_j done; P V may still run
    } else {
        v3pp_turn_end<PP>(bar_next);
        wgmma_wait<0>();
    }
    wg_fence_regs<BN / 2>(s);

    // ---- softmax of S_j (v3p's code): touches s, m_run and scalars only ----
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
    for (int r = 0; r < 2; r++) {
        float mx = FA_NEG_INF;
        #pragma unroll
        for (int nt = 0; nt < NS; nt++) mx = fmaxf(mx, fmaxf(s[4 * nt + 2 * r], s[4 * nt + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m_run[r], mx * sl2);
        const float ref = mn == FA_NEG_INF ? 0.f : mn;
        alpha[r] = fast_exp2(m_run[r] - ref);
        m_run[r] = mn;
        float rs = 0.f;
        #pragma unroll
        for (int nt = 0; nt < NS; nt++) {
            s[4 * nt + 2 * r] = fast_exp2(fmaf(s[4 * nt + 2 * r], sl2, -ref));
            s[4 * nt + 2 * r + 1] = fast_exp2(fmaf(s[4 * nt + 2 * r + 1], sl2, -ref));
            rs += s[4 * nt + 2 * r] + s[4 * nt + 2 * r + 1];
        }
        rsum[r] = rs;
    }
    if (PV) {
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
    #pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
        pa[kk][0] = pack_bf16x2_rn(s[8 * kk + 0], s[8 * kk + 1]);
        pa[kk][1] = pack_bf16x2_rn(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = pack_bf16x2_rn(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = pack_bf16x2_rn(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

template <int HD, int NWG, int BN, int NSTAGE, bool PP>
__device__ __forceinline__ void flash_forward_v3pp(bf16* out,          // (B, T, C)
                                                   float* lse,         // (B, NH, T)
                                                   const bf16* qkv,    // (B, T, 3C)
                                                   int T, int NH, float scale) {
    constexpr int BM = 64 * NWG, NC = 128 * NWG;               // NC consumer threads, then 1 producer warp
    constexpr int ND = HD / 8;
    static_assert(NSTAGE >= 3, "the producer publishes tile t after issuing t + 1: NSTAGE 2 deadlocks");
    static_assert(!PP || NWG >= 2, "ping-pong needs two consumer warpgroups");
    constexpr u32 Q_BYTES = BM * HD * 2, KV_BYTES = BN * HD * 2;
    extern __shared__ unsigned char smem_v3pp[];
    const u32 sQ = (wg_smem_u32(smem_v3pp) + 1023u) & ~1023u;  // swizzle atoms: 1024-byte aligned
    const u32 sK = sQ + Q_BYTES;                               // NSTAGE x KV_BYTES
    const u32 sV = sK + NSTAGE * KV_BYTES;                     // NSTAGE x KV_BYTES
    const u32 full = sV + NSTAGE * KV_BYTES;                   // NSTAGE mbarriers (8 B each)
    const u32 empty = full + NSTAGE * 8;                       // NSTAGE mbarriers
    unsigned char* const smem_gen = smem_v3pp + (sQ - wg_smem_u32(smem_v3pp));

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int m0 = (gridDim.y - 1 - blockIdx.y) * BM;           // heaviest tiles first
    const int C = NH * HD, stride = 3 * C;
    const bf16* q_g = qkv + (size_t)b * T * stride + h * HD;
    const bf16* k_g = q_g + C;
    const bf16* v_g = q_g + 2 * C;
    const int n_tiles = ceil_div(min(T, m0 + BM), BN);         // KV tiles with a key <= last row

    if (tid == 0) {
        #pragma unroll
        for (int st = 0; st < NSTAGE; st++) {
            wg_mbar_init(full + 8 * st, 32);
            wg_mbar_init(empty + 8 * st, NC);
        }
    }
    __syncthreads();                                           // the only block-wide barrier

    if (warp == 4 * NWG) {                                     // ---------------- producer warp
        for (int t = 0; t < n_tiles; t++) {
            const int st = t % NSTAGE;
            if (t >= NSTAGE) wg_mbar_wait(empty + 8 * st, (u32)((t / NSTAGE - 1) & 1));
            if (t == 0) v3pp_load_tile<BM, HD>(sQ, q_g, m0, T, stride, lane);   // Q rides with tile 0
            v3pp_load_tile<BN, HD>(sK + st * KV_BYTES, k_g, t * BN, T, stride, lane);
            v3pp_load_tile<BN, HD>(sV + st * KV_BYTES, v_g, t * BN, T, stride, lane);
            wg_cp_async_commit();
            if (t >= 1) {                                      // publish tile t - 1
                wg_cp_async_wait<1>();
                fence_proxy_async();
                wg_mbar_arrive(full + 8 * ((t - 1) % NSTAGE));
            }
        }
        wg_cp_async_wait<0>();                                 // publish the last tile
        fence_proxy_async();
        wg_mbar_arrive(full + 8 * ((n_tiles - 1) % NSTAGE));
        return;                                                // no barrier below involves it
    }

    // ---------------------------------------------------------------- consumer warpgroups
    const int wg = warp >> 2, w4 = warp & 3;
    const int g = lane >> 2, t4 = lane & 3;
    const int bar_own = 1 + wg, bar_next = 1 + (wg + 1) % NWG;
    const int wm0 = m0 + 64 * wg;                              // this warpgroup's first row
    const int n_wg = wm0 < T ? min(n_tiles, (wm0 + 63) / BN + 1) : 0;
    const int row0 = wm0 + 16 * w4 + g;                        // this thread's rows: row0, row0 + 8
    const float sl2 = scale * FA_LOG2E;                        // scores in log2 units

    float s[BN / 2], o[HD / 2];
    u32 pa[BN / 16][4];
    #pragma unroll
    for (int i = 0; i < BN / 2; i++) s[i] = 0.f;
    #pragma unroll
    for (int i = 0; i < HD / 2; i++) o[i] = 0.f;
    #pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
    float m_run[2] = {FA_NEG_INF, FA_NEG_INF}, l_run[2] = {0.f, 0.f};

    if (PP && wg == NWG - 1) wg_bar_arrive(1, 256);            // warpgroup 0 takes the first turn

    for (int j = 0; j <= n_tiles; j++) {                       // iteration n_tiles: last P V only
        const int n0 = j * BN;
        const bool diag = n0 + BN - 1 > wm0;
        const u32 kb = sK + (j % NSTAGE) * KV_BYTES;
        const u32 vb = sV + ((j + NSTAGE - 1) % NSTAGE) * KV_BYTES;   // V_{j-1}
        // Every consumer waits for every tile, also one it skips (causal / rows >= T): its arrive
        // on empty for tile j (iteration j + 1) must not count toward the stage's previous phase.
        if (j < n_tiles) wg_mbar_wait(full + 8 * (j % NSTAGE), (u32)((j / NSTAGE) & 1));   // K_j, V_j, Q landed
        if (j < n_wg) {
            if (j == 0) {
                if (diag) v3pp_step<HD, NWG, BN, false, true, PP>(s, o, pa, m_run, l_run, sQ, kb, vb, wg, n0, row0, t4, sl2, bar_own, bar_next);
                else v3pp_step<HD, NWG, BN, false, false, PP>(s, o, pa, m_run, l_run, sQ, kb, vb, wg, n0, row0, t4, sl2, bar_own, bar_next);
            } else {
                if (diag) v3pp_step<HD, NWG, BN, true, true, PP>(s, o, pa, m_run, l_run, sQ, kb, vb, wg, n0, row0, t4, sl2, bar_own, bar_next);
                else v3pp_step<HD, NWG, BN, true, false, PP>(s, o, pa, m_run, l_run, sQ, kb, vb, wg, n0, row0, t4, sl2, bar_own, bar_next);
            }
        } else if (j == n_wg && j > 0) {
            v3pp_last_pv<HD, BN, PP>(o, pa, vb, bar_own, bar_next);   // P_{n_wg-1} V_{n_wg-1}
        } else {
            v3pp_turn_begin<PP>(bar_own);                      // nothing to issue: pass the turn on
            v3pp_turn_end<PP>(bar_next);
        }
        if (j >= 1) wg_mbar_arrive(empty + 8 * ((j - 1) % NSTAGE));   // K_{j-1}, V_{j-1} retired
    }
    if (PP && wg == 0) wg_bar_sync(1, 256);                    // absorb the last warpgroup's final arrive

    // Epilogue (as v3p): quad sums, lse, O / l as bf16 into this warp's own 16 Q rows (read only by
    // this warpgroup's wgmma, all retired; the producer never rewrites Q), then 16-byte stores.
    float inv[2];
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        float l = l_run[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        inv[r] = l > 0.f ? 1.f / l : 0.f;
        const int row = row0 + 8 * r;
        if (n_wg > 0 && t4 == 0 && row < T) lse[(size_t)bh * T + row] = (m_run[r] + log2f(l)) * FA_LN2;
    }
    const int lr0 = 64 * wg + 16 * w4;
    #pragma unroll
    for (int dt = 0; dt < ND; dt++) {
        const u32 cb = 4 * t4;
        *reinterpret_cast<u32*>(smem_gen + v3pp_off<BM>(lr0 + g, dt) + cb) = pack_bf16x2_rn(o[4 * dt] * inv[0], o[4 * dt + 1] * inv[0]);
        *reinterpret_cast<u32*>(smem_gen + v3pp_off<BM>(lr0 + g + 8, dt) + cb) = pack_bf16x2_rn(o[4 * dt + 2] * inv[1], o[4 * dt + 3] * inv[1]);
    }
    __syncwarp();
    bf16* out_g = out + (size_t)b * T * C + h * HD;
    #pragma unroll
    for (int it = 0; it < 16 * ND / 32; it++) {
        const int i = it * 32 + lane;
        const int r = i / ND, c = i % ND;
        const int row = m0 + lr0 + r;
        if (row < T) {
            const uint4 v = *reinterpret_cast<const uint4*>(smem_gen + v3pp_off<BM>(lr0 + r, c));
            *reinterpret_cast<uint4*>(out_g + (size_t)row * C + c * 8) = v;
        }
    }
}

#define FLASH_V3PP_BODY(HD, NWG, BN, NSTAGE, PP) flash_forward_v3pp<HD, NWG, BN, NSTAGE, PP>(out, lse, qkv, T, NH, scale)
#else
#define FLASH_V3PP_BODY(HD, NWG, BN, NSTAGE, PP) __trap()   // not sm_90a: Python never launches this
#endif

// Registers (NVRTC 12.9, sm_90a, no spills, no wgmma serialisation): hd64 g3 n64: 128 (416 threads,
// 1 block/SM = 3 consumer warpgroups); hd64 g2 n64 and hd128 g2 n64: see `kernels check`. Two
// blocks/SM of 288 threads cap registers at 96 (spills, serialised wgmma): all are MINB 1.
// Configurations (HD, consumer warpgroups, keys per KV tile, K/V stages, schedule, MINB = blocks
// per SM for __launch_bounds__ (not in the name)). Schedule pp = producer warp + ping-pong, ws =
// producer warp only. ops/attention.py V3_FWD_CONFIGS lists them as (warpgroups, BN, stages,
// schedule); block = 128 * NWG + 32 threads; dynamic shared memory =
// 1024 + (64 * NWG + 2 * NSTAGE * BN) * HD * 2 + 16 * NSTAGE (mbarriers).
#define FLASH_FWD_V3PP(HD, NWG, BN, NSTAGE, SCHED, MINB)                                        \
    extern "C" __global__ void __launch_bounds__(128 * NWG + 32, MINB)                           \
    attention_forward_kernel_v3_hd##HD##_g##NWG##_n##BN##_s##NSTAGE##_##SCHED##_bf16(            \
            bf16* out, float* lse, const bf16* qkv, int T, int NH, float scale) {                \
        FLASH_V3PP_BODY(HD, NWG, BN, NSTAGE, V3PP_SCHED_##SCHED);                                \
    }
#define V3PP_SCHED_pp true
#define V3PP_SCHED_ws false

FLASH_FWD_V3PP(64, 3, 64, 3, pp, 1)
FLASH_FWD_V3PP(64, 3, 64, 4, pp, 1)
FLASH_FWD_V3PP(64, 3, 64, 3, ws, 1)
FLASH_FWD_V3PP(64, 2, 64, 3, pp, 1)
FLASH_FWD_V3PP(64, 2, 64, 3, ws, 1)
FLASH_FWD_V3PP(128, 2, 64, 3, pp, 1)
