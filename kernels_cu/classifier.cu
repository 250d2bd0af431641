/*
 * classifier.cu -- the fused classifier: softmax + cross-entropy loss + its
 * gradient, written in place over the logits, never materialising the
 * probabilities. Also the loss alone (cross_entropy) and a target check.
 *
 * Math, per row r (fp32 accumulation, whatever T is), t = targets[r]:
 *   lse_r       = max_r + log(sum_{c<V} exp(logits[r, c] - max_r))
 *   losses[r]   = lse_r - logits[r, t]
 *   dlogits[r,c] = grad_scale * (softmax(logits[r, :V])[c] - (c == t))  for c < V
 *   dlogits[r,c] = 0                                                     for V <= c < Vp (padding)
 *   t == -1 (ignore index): losses[r] = 0 and the row's dlogits are 0.
 *   t < -1 or t >= V: the host refuses this before launch (ValueError); the
 *   kernels stay in bounds anyway and write a NaN loss.
 * Shapes: logits (N, Vp) T, row stride Vp; targets (N,) int32; losses (N,) fp32.
 * Gradient rule: dlogits is an activation gradient, overwritten (=) -- it IS
 * the logits buffer: every element is read before the block barrier that
 * precedes any write of its row.
 *
 * One block per row, but v3's FP8 kernel: persistent blocks, one row at a time. Versions of the fused kernel:
 *   v1 (any Vp, any alignment): pass 1 an online max/sum over the row
 *      (default caching, so the row stays in L2), pass 2 reads it again --
 *      from L2: 132 SMs x 2 rows x 100 KB << 50 MB -- and writes dlogits
 *      with streaming stores.
 *   v2 (Vp a multiple of the pack, 16-byte aligned, Vp/P <= 1024*CLS_CACHE):
 *      the row is held in registers (CACHE packs per thread, 1024 threads),
 *      read from memory once; the price is one block per SM.
 *   v3 (Vp a multiple of the pack, 16-byte aligned, row <= the device's
 *      shared memory per block): v1 and v2 were instruction-bound (~40
 *      instructions per element: __expf's denormal fix-up twice,
 *      float_to_bf16, per-element column tests). v3 copies the row into shared
 *      memory with cp.async (all of it in flight, no registers held; read from
 *      DRAM once); each thread takes its packs' max (max.bf16x2 on the raw
 *      pairs), then their sum of exp(x - max) in fp32 with ex2.approx, the
 *      exponent of a bf16 logit in one FFMA (x log2e - max log2e); the block
 *      merges the (max, sum) pairs. Pass 2 writes dlogits with the hardware
 *      bf16x2 rounding; the target and padding columns are patched only in
 *      the 1-2 packs that hold them (the FP8 head's thinned rows: after the
 *      row's loop, h16_fixup); every choice (exact or lean, FP8 scale
 *      folded or not) is made once a row, so each row's pass 2 is one
 *      straight-line loop: ~9 instructions + 2 MUFU per element (tools/notes/
 *      profile.md, twenty-fourth session). 512 threads; a bf16 row of 50304
 *      columns is 98 KiB, so two blocks share an SM. The FP8 kernel's grid
 *      is what fits the GPU at once; each block walks rows and copies its
 *      next row into the slots its pass 2 has just consumed (see
 *      classifier_backward_v3; the bf16/fp32 kernels measured slower so).
 *      Rows with NaN/inf take the exact conversion (NaN bits as
 *      float_to_bf16 writes them).
 * FP8 variant (v3, bf16 only; --dtype fp8 with settings.fp8_lm_head): the same kernel also writes
 *   dlogits8[r, c] = e5m2(bf16(dlogits[r, c]) * fp8_scale)   (N, Vp) bytes, saturating, RNE
 *   -- bit for bit the bf16 kernel followed by fp8_quantize -- for the LM head's FP8 dx GEMM. The
 *   scale is fixed by the caller: |dlogits| <= grad_scale, so 2^floor(log2(57344 / grad_scale))
 *   never saturates and needs no amax. write_bf16 = 0: dlogits8 only, the logits left unchanged
 *   (the FP8 LM head with its dwte GEMM in FP8 too reads nothing else); with a power-of-two scale
 *   the kernel then multiplies it into the softmax's scale before the bf16 rounding (exact: the
 *   same bytes, one multiply a logit fewer).
 * Sparse dlogits (v3, bf16 rows; sparse_tau > 0, a power of two): the written dlogits -- the bf16
 *   ones, or with FP8 the scaled values before their E5M2 rounding -- below sparse_tau are thinned
 *   without bias: each becomes +-sparse_tau or 0, kept with probability |v| / sparse_tau, the draw a
 *   hash of the step's seed (read from device memory), the row and the column pack (sparse_pack;
 *   the NumPy rule is ops/classifier.py's sparse_dlogits_reference). Most dlogits are tiny softmax
 *   probabilities, and the LM head's GEMMs draw less power on zeros (tools/notes/fp8.md). The FP8
 *   kernel's thinned rows are f16, not bf16 (fewer instructions at the power cap; see v3_pass2):
 *     dlogits8[r, c] = e5m2(thin(f16(dlogits[r, c] * fp8_scale)))
 * Determinism: fixed element-to-thread mapping and reduction trees.
 */
#include "common.cuh"
#include "fast_packs.cuh"
#include "fp8_cast.cuh"  // quantize8: the FP8 variant's second store
#include "ptx.cuh"       // smem_u32, cp_async16, cp_async_commit / cp_async_wait

#define CLS_BLOCK 1024
#define CLS_CACHE 7   // 7 x 16 B per thread: 57344 bf16 / 28672 fp32 columns; 8 spills at 64 regs (sm_80)

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }
__device__ __forceinline__ float qnan() { return __int_as_float(0x7fc00000); }

// Online max/sum (as in softmax.cu): rescale the running sum when the max grows.
__device__ __forceinline__ void online_rescale(float& m, float& s, float pm) {
    if (pm > m) {
        s *= __expf(m - pm);
        m = pm;
    } else if (pm != pm) {
        m = pm;
        s = pm;
    }
}

__device__ __forceinline__ float online_term(float v, float m) {
    return (m == neg_inf()) ? 0.0f : __expf(v - m);
}

// Streaming 16-byte store: dlogits are not read again by this kernel.
template <typename T>
__device__ __forceinline__ void store16_cs(T* p, const Pack16<T>& x) {
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&x));
}

// Pass 1 of v1 and cross_entropy: the row's (max, sum exp(x - max)) over
// columns [0, V), returned to every thread of the block.
template <typename T>
__device__ void row_max_sum(const T* xr, int V, bool vec, float& m, float& s, float* scratch) {
    constexpr int P = Pack16<T>::size;
    m = neg_inf();
    s = 0.0f;
    int done = 0;
    if (vec) {
        done = (V / P) * P;
        for (int i = threadIdx.x; i < V / P; i += blockDim.x) {
            Pack16<T> p = load16(xr + i * P);
            float pm = neg_inf();
            #pragma unroll
            for (int k = 0; k < P; k++) pm = MaxOp::combine(pm, to_float(p.v[k]));
            online_rescale(m, s, pm);
            #pragma unroll
            for (int k = 0; k < P; k++) s += online_term(to_float(p.v[k]), m);
        }
    }
    for (int c = done + threadIdx.x; c < V; c += blockDim.x) {   // scalar tail (or the whole row)
        const float v = to_float(xr[c]);
        online_rescale(m, s, v);
        s += online_term(v, m);
    }
    const float row_max = block_reduce<MaxOp>(m, scratch);
    s = (m == neg_inf()) ? 0.0f : s * __expf(m - row_max);
    s = block_reduce<SumOp>(s, scratch);
    m = row_max;
}

__device__ __forceinline__ float row_loss(float m, float s, float xt, bool valid) {
    return valid ? logf(s) + m - xt : qnan();
}

// The whole row of an ignored target: zero gradient, no need to read it.
template <typename T>
__device__ void zero_row(T* xr, int Vp, bool vec) {
    constexpr int P = Pack16<T>::size;
    if (vec) {
        Pack16<T> z;
        #pragma unroll
        for (int k = 0; k < P; k++) z.v[k] = from_float<T>(0.0f);
        for (int i = threadIdx.x; i < Vp / P; i += blockDim.x) store16_cs(xr + i * P, z);
    } else {
        for (int c = threadIdx.x; c < Vp; c += blockDim.x) xr[c] = from_float<T>(0.0f);
    }
}

// ------------------------------------------------------ cross_entropy ------

template <typename T>
__device__ void classifier_forward(float* losses, const T* logits, const int* targets,   // (N,) (N, Vp) (N,)
                                   int N, int V, int Vp) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= N) return;
    const int t = targets[row];
    if (t == -1) {                                   // uniform over the block: no barrier skipped unevenly
        if (threadIdx.x == 0) losses[row] = 0.0f;
        return;
    }
    const T* xr = logits + (size_t)row * Vp;
    const bool vec = (Vp % Pack16<T>::size == 0) && is_aligned16(logits);
    const bool valid = t >= 0 && t < V;
    float m, s;
    row_max_sum(xr, V, vec, m, s, scratch);
    if (threadIdx.x == 0) losses[row] = row_loss(m, s, valid ? to_float(xr[t]) : 0.0f, valid);
}

// ------------------------------------------------------ fused, v1 ----------

template <typename T>
__device__ void classifier_backward_v1(float* losses, T* logits, const int* targets,   // (N,) (N, Vp) in: logits, out: dlogits; (N,)
                                       float grad_scale, int N, int V, int Vp) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= N) return;
    constexpr int P = Pack16<T>::size;
    const int t = targets[row];
    T* xr = logits + (size_t)row * Vp;
    const bool vec = (Vp % P == 0) && is_aligned16(logits);
    if (t == -1) {
        if (threadIdx.x == 0) losses[row] = 0.0f;
        zero_row(xr, Vp, vec);
        return;
    }
    const bool valid = t >= 0 && t < V;
    const float xt = (threadIdx.x == 0 && valid) ? to_float(xr[t]) : 0.0f;   // read before the barriers below
    float m, s;
    row_max_sum(xr, V, vec, m, s, scratch);
    if (threadIdx.x == 0) losses[row] = row_loss(m, s, xt, valid);
    const float inv = 1.0f / s;
    if (vec) {
        for (int i = threadIdx.x; i < Vp / P; i += blockDim.x) {
            Pack16<T> p = load16_cs(xr + i * P), q;   // the row's last read
            #pragma unroll
            for (int k = 0; k < P; k++) {
                const int c = i * P + k;
                float g = __expf(to_float(p.v[k]) - m) * inv - (c == t ? 1.0f : 0.0f);
                q.v[k] = from_float<T>(c < V ? grad_scale * g : 0.0f);
            }
            store16_cs(xr + i * P, q);
        }
    } else {
        for (int c = threadIdx.x; c < Vp; c += blockDim.x) {
            float g = __expf(to_float(xr[c]) - m) * inv - (c == t ? 1.0f : 0.0f);
            xr[c] = from_float<T>(c < V ? grad_scale * g : 0.0f);
        }
    }
}

// ------------------------------------------------------ fused, v2 ----------

template <typename T>
__device__ void classifier_backward_v2(float* losses, T* logits, const int* targets,   // (N,) (N, Vp) in/out; (N,)
                                       float grad_scale, int N, int V, int Vp) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= N) return;
    constexpr int P = Pack16<T>::size;
    const int t = targets[row];
    T* xr = logits + (size_t)row * Vp;
    if (t == -1) {
        if (threadIdx.x == 0) losses[row] = 0.0f;
        zero_row(xr, Vp, true);
        return;
    }
    const bool valid = t >= 0 && t < V;
    const int n_packs = Vp / P;
    Pack16<T> buf[CLS_CACHE];
    #pragma unroll
    for (int k = 0; k < CLS_CACHE; k++) {            // the whole row in flight at once
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n_packs) buf[k] = load16_cs(xr + i * P);
    }
    const float xt = (threadIdx.x == 0 && valid) ? to_float(xr[t]) : 0.0f;
    // Online max/sum over this thread's packs (only the pack holding column V
    // is partial), then over the block -- one pass over the registers.
    float m = neg_inf(), s = 0.0f;
    #pragma unroll
    for (int k = 0; k < CLS_CACHE; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        const int nv = V - i * P;                    // valid columns in this pack (may be <= 0 or > P)
        if (i < n_packs && nv > 0) {
            float pm = neg_inf();
            #pragma unroll
            for (int e = 0; e < P; e++)
                if (e < nv) pm = MaxOp::combine(pm, to_float(buf[k].v[e]));
            online_rescale(m, s, pm);
            #pragma unroll
            for (int e = 0; e < P; e++)
                if (e < nv) s += online_term(to_float(buf[k].v[e]), m);
        }
    }
    const float row_max = block_reduce<MaxOp>(m, scratch);
    s = (m == neg_inf()) ? 0.0f : s * __expf(m - row_max);
    s = block_reduce<SumOp>(s, scratch);
    m = row_max;
    if (threadIdx.x == 0) losses[row] = row_loss(m, s, xt, valid);
    const float inv = 1.0f / s;
    #pragma unroll
    for (int k = 0; k < CLS_CACHE; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n_packs) {
            Pack16<T> q;
            #pragma unroll
            for (int e = 0; e < P; e++) {
                const int c = i * P + e;
                float g = __expf(to_float(buf[k].v[e]) - m) * inv - (c == t ? 1.0f : 0.0f);
                q.v[e] = from_float<T>(c < V ? grad_scale * g : 0.0f);
            }
            store16_cs(xr + i * P, q);
        }
    }
}

// ------------------------------------------------------ fused, v3 ----------

#define CLS3_BLOCK 512
#define V3_WALK_K 13   // the largest K whose blocks walk rows (= V3_WALK_K in ops/classifier.py)

// Merge (m2, s2) into (m, s), where s = sum exp(x - shift(m)), shift(-inf) = 0
// (so an all -inf stretch holds s = 0 and a NaN stays NaN). Commutative bit
// for bit, so both lanes of a butterfly step agree.
__device__ __forceinline__ void combine_ms(float& m, float& s, float m2, float s2) {
    const float M = fmaxf(m, m2);
    const float sh = (M == neg_inf()) ? 0.0f : M;
    const float a = (m == neg_inf()) ? s : s * ex2_ftz((m - sh) * LOG2E);
    const float b = (m2 == neg_inf()) ? s2 : s2 * ex2_ftz((m2 - sh) * LOG2E);
    m = M;
    s = a + b;
}

// exp(f - sh) as ex2(f log2e - sh log2e): one FFMA a logit where the subtraction and the
// multiply were two (bf16 rows only: the float32 kernels keep the two-rounding form, whose error the
// fp32-vs-float64 tests budget). c = -sh log2e is made once a thread (pass 1) or a row (pass 2); it
// overflows for |sh| > FLT_MAX / log2e, so shifts beyond EXP_FMA_MAX (absurd logits) take the two-op form.
#define EXP_FMA_MAX 2.0e38f
__device__ __forceinline__ bool exp_fma_ok(float sh) { return fabsf(sh) <= EXP_FMA_MAX; }

// The max of a full bf16 pack from its raw words: max.bf16x2 on the pairs (one instruction for
// two columns), then the last pair's halves. Like fmaxf it skips a NaN unless both sides are NaN,
// so it gives the fmaxf chain's value (a +-0 tie may pick the other zero: the same shift).
__device__ __forceinline__ float pack_max_bf16(const uint4& r) {
    u32 a, b;
    asm("max.bf16x2 %0, %1, %2;" : "=r"(a) : "r"(r.x), "r"(r.y));
    asm("max.bf16x2 %0, %1, %2;" : "=r"(b) : "r"(r.z), "r"(r.w));
    asm("max.bf16x2 %0, %1, %2;" : "=r"(a) : "r"(a), "r"(b));
    return fmaxf(__uint_as_float(a << 16), __uint_as_float(a & 0xffff0000u));
}

// The max of one pack's nv (<= P) valid columns (fmaxf: a NaN is skipped unless all are NaN).
template <typename T>
__device__ __forceinline__ float pack_max(const uint4& r, int nv) {
    constexpr int P = Raw<T>::P;
    if (sizeof(T) == 2 && nv >= P) return pack_max_bf16(r);
    float f[P];
    Raw<T>::unpack(r, f);
    float pm = neg_inf();
    #pragma unroll
    for (int e = 0; e < P; e++)
        if (e < nv) pm = fmaxf(pm, f[e]);
    return pm;
}

// sum over one pack's nv valid columns of exp(x - sh), pairwise; LEAN: the exponent as
// fmaf(x, log2e, c) with c = -sh log2e (exp_fma_ok), else (x - sh) log2e. A NaN poisons the sum.
// FULL (nv >= P): no per-column test -- the same sum of a full pack, in the same order.
template <typename T, bool LEAN, bool FULL>
__device__ __forceinline__ float pack_expsum_cols(const uint4& r, int nv, float sh, float c) {
    constexpr int P = Raw<T>::P;
    float f[P];
    Raw<T>::unpack(r, f);
    #pragma unroll
    for (int e = 0; e < P; e++)
        f[e] = (FULL || e < nv) ? ex2_ftz(LEAN ? fmaf(f[e], LOG2E, c) : (f[e] - sh) * LOG2E) : 0.0f;
    #pragma unroll
    for (int w = 1; w < P; w *= 2)
        #pragma unroll
        for (int e = 0; e < P; e += 2 * w) f[e] += f[e + w];
    return f[0];
}

// Only the row's last valid pack is partial: every other pack takes the test-free body (a pack's
// 8 per-column tests and zero moves were ~2 instructions a logit of the FP8 kernel's ~22; ncu and
// SASS, tools/notes/fp8.md, sixtieth session). A branch the warp takes together but in one lane.
template <typename T, bool LEAN>
__device__ __forceinline__ float pack_expsum(const uint4& r, int nv, float sh, float c) {
    if (nv >= Raw<T>::P) return pack_expsum_cols<T, LEAN, true>(r, nv, sh, c);
    return pack_expsum_cols<T, LEAN, false>(r, nv, sh, c);
}

// A normal positive power of two: sign and mantissa bits clear, exponent neither 0 nor 255.
__device__ __forceinline__ bool is_pow2(float x) {
    const u32 b = __float_as_uint(x);
    return (b & 0x807fffffu) == 0 && (b >> 23) - 1u < 254u;
}

// Two bf16 -> two E5M2 bytes, unscaled (the FP8 kernel's E5M2-only rows fold the scale into the
// softmax's, before the bf16 rounding: see classifier_backward_v3).
__device__ __forceinline__ uint2 e5m2_of_bf16_pack(const uint4& p) {
    const u32 w[4] = {p.x, p.y, p.z, p.w};
    u32 o[2];
    #pragma unroll
    for (int i = 0; i < 4; i += 2)
        o[i / 2] = (u32)cvt_fp8x2<E5M2>(__uint_as_float(w[i] << 16), __uint_as_float(w[i] & 0xffff0000u))
                 | ((u32)cvt_fp8x2<E5M2>(__uint_as_float(w[i + 1] << 16), __uint_as_float(w[i + 1] & 0xffff0000u)) << 16);
    return make_uint2(o[0], o[1]);
}

// ---- stochastic sparsification of the written dlogits (`sparse_tau`: bf16, or FP8's E5M2) ----
// Why: at the 700 W cap a GEMM's power follows its operands' toggling bits, and nearly every dlogit
// is a tiny softmax probability. Made unbiased-sparse, the LM head's two backward GEMMs run ~16%
// faster at the cap (tools/probes/head_sparse_dlogits.py, tools/notes/fp8.md).
//
// murmur3's 32-bit finalizer: a bijection whose every output bit depends on every input bit.
__device__ __forceinline__ u32 fmix32(u32 h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

// The pack's draw: U = (h & 0x7fffff) / 2^23 with h = rowkey + pack * PHI -- a Weyl sequence along the
// row (every U uniform: rowkey is a hash of the step's seed and the row), one add a pack.
#define SPARSE_PHI 0x9e3779b9u

// U tau from the draw h (exact: tau is a power of two).
__device__ __forceinline__ float sparse_draw(u32 h, float tau) {
    return fmaf(__uint_as_float(0x3f800000u | (h & 0x7fffffu)), tau, -tau);
}

// t = the bf16 truncation of U tau, as a bf16 pair.
__device__ __forceinline__ u32 sparse_threshold2(u32 h, float tau) {
    return __byte_perm(__float_as_uint(sparse_draw(h, tau)), 0u, 0x3232);
}

// One pack of 8 scaled bf16 dlogits v >= +0 (every column but the target's; tau2: tau as a bf16
// pair, t2 the pack's threshold): v >= tau and NaN stay; a smaller v becomes tau where v > t, else
// 0. For a bf16 v < tau, P(t < v) = P(U tau < v) = v / tau (to U's 2^-23 steps): each value keeps
// its expectation. One U serves the pack's 8 columns (adjacent tokens, whose wte rows are
// independent): each column stays unbiased, only their errors are correlated. Three instructions
// a pair: a bf16x2 max, a bf16x2 compare to a mask, an and. A negative value (the target column)
// comes out 0 here: v3_pass2 redoes it with sparse_signed. H16: the same on f16 pairs (tau2 and t2
// f16 pairs too; the FP8 kernel's rows, see below): max.NaN.f16x2 (sm_80+), set.gtu.u32.f16x2.
template <bool H16 = false>
__device__ __forceinline__ uint4 sparse_pack(const uint4& p, u32 t2, u32 tau2) {
    u32 w[4] = {p.x, p.y, p.z, p.w};
    #pragma unroll
    for (int k = 0; k < 4; k++) {
        u32 m, keep;
        if (H16) {
            asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(m) : "r"(w[k]), "r"(tau2));
            asm("set.gtu.u32.f16x2 %0, %1, %2;" : "=r"(keep) : "r"(w[k]), "r"(t2));   // NaN: kept
        } else {
            asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(w[k]), "r"(tau2));
#if __CUDA_ARCH__ >= 900
            asm("set.gtu.u32.bf16x2 %0, %1, %2;" : "=r"(keep) : "r"(w[k]), "r"(t2));   // NaN: kept
#else       // set.bf16x2 is sm_90's: compare in fp32 (the same result)
            const float lo = __uint_as_float(w[k] << 16), hi = __uint_as_float(w[k] & 0xffff0000u);
            const float tf = __uint_as_float(t2 << 16);
            keep = (!(lo <= tf) ? 0x0000ffffu : 0u) | (!(hi <= tf) ? 0xffff0000u : 0u);
#endif
        }
        w[k] = m & keep;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// The same rule for one bf16 value of either sign (raw bits), against the same threshold:
// |v| >= tau, inf and NaN stay; else sign(v) tau where |v| > t, else sign(v) 0.
__device__ __forceinline__ u32 sparse_signed(u32 v, u32 t2, float tau) {
    const float a = __uint_as_float((v & 0x7fffu) << 16), t = __uint_as_float(t2 << 16);
    const u32 sign = v & 0x8000u;
    if (!(a < tau)) return v;                                   // big, inf, NaN
    return sign | (a > t ? (__float_as_uint(tau) >> 16) : 0u);
}

// The FP8 kernel's thinned rows (E5M2 only) run the same rule on f16 packs: E5M2 is f16's top byte,
// so the bytes come from one cvt a pair (e5m2_of_f16_pack) instead of bf16 -> fp32 -> E5M2, ~3
// instructions a pair (with the scale in the exponent, an H200's 8192-row chunk alone: x1.036; an
// H100's x1.002, not held by the cap; tools/notes/fp8.md, 59th session). The draw is the same U; t
// is its f16 truncation (cvt.rz keeps f16 subnormals, so t lies on the values' own grid and
// P(v > t) = v / tau stays exact).
__device__ __forceinline__ float f16_bits_to_float(u32 h) {       // the low 16 bits, exactly
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}
__device__ __forceinline__ u32 sparse_threshold2_f16(u32 h, float tau) {   // t in f16, as a pair
    u32 r;
    asm("cvt.rz.f16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(sparse_draw(h, tau)));
    return r;
}
// sparse_signed on one f16 value (raw bits; tau2: tau as an f16 pair).
__device__ __forceinline__ u32 sparse_signed_f16(u32 v, u32 t2, u32 tau2) {
    const float a = f16_bits_to_float(v & 0x7fffu), t = f16_bits_to_float(t2), tau = f16_bits_to_float(tau2);
    if (!(a < tau)) return v;                                   // big, inf, NaN
    return (v & 0x8000u) | (a > t ? (tau2 & 0xffffu) : 0u);
}

// K packs per thread at most (the launcher picks K >= ceil(Vp / P / 512)); the row
// sits in dynamic shared memory, n_packs x 16 bytes. FUSED = false is cross_entropy:
// the loss only, the logits are left as they are. FP8 (bf16 only): dlogits8 gets the E5M2
// copy of each written pack, scaled by fp8_scale; write_bf16 = 0 leaves the logits as they are (the
// FP8 LM head that also takes dwte from dlogits8 never reads the bf16 dlogits).
//
// Persistent blocks (the FP8 kernel; WALK below): the launcher starts as many blocks as fit on
// the GPU at once (two a bf16 row's SM), and each walks rows blockIdx.x, + gridDim.x, ... Why:
// with one block a row, a block loads its row, then computes, then writes, and an SM's two blocks
// can both be computing with nothing in flight from DRAM. The FP8 kernel (E5M2-only writes,
// 1.5x less traffic a row for more conversions) is the one that lost most to that (ncu, H200:
// 55% of DRAM peak against the bf16 kernel's 76%). Walking, each thread, right after the pass-2
// store of one of its packs, copies the same pack of the block's next row into that slot (its
// own slot: the ld.shared that fed the store has returned, since the store used its value), so
// the next row streams in while this one computes and writes. Slots are per thread until the
// barrier after pass 1, so no barrier guards the refill; the one read of another thread's slot
// (the target's logit, by thread 0) sits between pass 1's two barriers. The arithmetic per row
// is unchanged: bit for bit the one-row-a-block kernel.
template <typename T, int K>
__device__ __forceinline__ void v3_copy_row(uint4* s_row, const uint4* xr, int n_packs, int tid) {
    constexpr int KH = (K + 1) / 2;   // two commit groups: the first half is summed while the rest arrives
    #pragma unroll
    for (int k = 0; k < K; k++) {
        const int i = tid + k * CLS3_BLOCK;
        if (i < n_packs) cp_async16(smem_u32(s_row + i), xr + i, 16);
        if (k == KH - 1) cp_async_commit();
    }
    cp_async_commit();
}

// One f16 (low 16 bits) -> its E5M2 byte (e5m2_of_f16_pack's rounding; sm_89+).
__device__ __forceinline__ u8 e5m2_of_f16(u32 h) {
    return (u8)(e5m2_of_f16_pack(make_uint4(h & 0xffffu, 0u, 0u, 0u)).x & 0xffu);
}

// The FP8 head's thinned rows (H16): v3_pass2's loop writes every pack as a plain one, with no test
// a pack, and the row's special columns are rewritten here by the threads that wrote their packs
// (the same thread's later store wins): the target's byte from its logit xt (thread 0 reads it in
// pass 1), exactly as the loop's target pack made it (minus tsub, f16, sparse_signed_f16, E5M2),
// and the padding columns [V, n_packs P) as zeros (the thinning's 0). The logits are not written
// in this mode, so nothing else is lost. Why: three tested-and-skipped branches were ~13 of a pack's
// ~83 instructions on the common path (SASS, tools/notes/fp8.md, sixtieth session).
__device__ __forceinline__ void h16_fixup(u8* d8, int V, int n_packs, int t, int tpack, float xt, float c,
                                          float tsub, u32 rowkey, float tau, u32 tau2) {
    const int tid = threadIdx.x;
    if (tpack >= 0 && tpack % CLS3_BLOCK == tid) {
        const float v = ex2_ftz(fmaf(xt, LOG2E, c)) - tsub;
        const u32 t2 = sparse_threshold2_f16(rowkey + (u32)tpack * SPARSE_PHI, tau);
        d8[t] = e5m2_of_f16(sparse_signed_f16(cvt_rn_f16x2(v, 0.0f) & 0xffffu, t2, tau2));
    }
    const int first_pad = V / 8;                    // the first pack holding a padding column
    for (int i = first_pad + (tid - first_pad % CLS3_BLOCK + CLS3_BLOCK) % CLS3_BLOCK; i < n_packs; i += CLS3_BLOCK) {
        if (i * 8 >= V) *reinterpret_cast<uint2*>(d8 + (size_t)i * 8) = make_uint2(0u, 0u);
        else
            for (int col = V; col < (i + 1) * 8; col++) d8[col] = 0;
    }
}

// Pass 2 of classifier_backward_v3 over a row's packs: dlogits = exp(x - sh) * fscale, minus tsub at
// the target, 0 in the padding; written as bf16 (store_bf16: the FP8 kernel's write_bf16, true
// elsewhere; the call is inlined, so a constant false drops the store) and/or E5M2 (FP8; FOLD:
// fscale and tsub already carry fp8_scale, so the bytes are the bf16 values' plain E5M2
// conversion). LEAN: the exponent in one FFMA and the hardware bf16 rounding (finite rows of bf16);
// otherwise the two-op exponent and the exact rounding (NaN bits, float32 rows). next: the block's
// next row, copied into each slot right after its pack is stored (WALK kernels only; next_bytes 0 on
// a block's last row: the copies then read nothing and zero the slots, so no pack tests `next`).
// FP8 && FOLD && SPARSE (the FP8 head's thinned E5M2-only rows, the --dtype fp8 default) round to f16
// instead (H16): thinned on f16 pairs, E5M2 in one cvt a pair, and fscale is folded into the
// exponent (ex2(x log2e + c + log2 fscale): one FMUL a logit fewer; x1.023 alone on an H200). tau2
// is then an f16 pair.
template <typename T, int K, bool FP8, bool LEAN, bool FOLD, bool SPARSE = false>
__device__ __forceinline__ void v3_pass2(uint4* s_row, uint4* xr, u8* d8, const uint4* next, int next_bytes, int n_packs,
                                         int V, int t, int tpack, float sh, float fscale, float tsub,
                                         float fp8_scale, bool store_bf16,
                                         u32 rowkey = 0u, float tau = 0.0f, u32 tau2 = 0u,
                                         const float* xt_slot = nullptr) {
    using R = Raw<T>;
    constexpr int P = R::P;
    constexpr int KH = (K + 1) / 2;
    const int tid = threadIdx.x;
    constexpr bool H16 = FP8 && FOLD && SPARSE && LEAN && P == 8;
    constexpr bool FIXUP = H16;                         // the special columns after the loop: h16_fixup
    constexpr bool WALK = FP8 && K <= V3_WALK_K;        // classifier_backward_v3's (its live calls pass its FP8)
    // exp(x - sh) [fscale] = ex2(x log2e + c); H16 folds fscale in (h16_fixup is handed this c)
    const float c = -sh * LOG2E + (H16 ? log2f(fscale) : 0.0f);
    #pragma unroll
    for (int k = 0; k < K; k++) {
        const int i = tid + k * CLS3_BLOCK;
        if (i < n_packs) {
            float f[P];
            R::unpack(s_row[i], f);
            #pragma unroll
            for (int e = 0; e < P; e++)
                f[e] = H16 ? ex2_ftz(fmaf(f[e], LOG2E, c))
                           : ex2_ftz(LEAN ? fmaf(f[e], LOG2E, c) : (f[e] - sh) * LOG2E) * fscale;
            if (!FIXUP && i == tpack) {                 // the one pack holding the target
                // a bit mask, not f[t - i * P]: a dynamic index would put f in local memory
                const u32 hit = 1u << (t - i * P);
                #pragma unroll
                for (int e = 0; e < P; e++)
                    if (hit & (1u << e)) f[e] -= tsub;
            }
            if (!FIXUP && (i + 1) * P > V) {            // padding columns [V, Vp)
                #pragma unroll
                for (int e = 0; e < P; e++)
                    if (i * P + e >= V) f[e] = 0.0f;
            }
            uint4 packed;
            if constexpr (H16) packed = pack_f16(f);
            else packed = LEAN ? R::pack_fast(f) : R::pack_exact(f);
            if (SPARSE) {                               // bf16 lean rows (FP8: f16): thinned before they are stored
                const u32 h = rowkey + (u32)i * SPARSE_PHI;
                const u32 t2 = H16 ? sparse_threshold2_f16(h, tau) : sparse_threshold2(h, tau);
                const uint4 dense = packed;
                packed = sparse_pack<H16>(dense, t2, tau2);
                if (!FIXUP && i == tpack) {             // the target column, the one negative value
                    // its bf16 is half e % 2 of word e / 2 (selects, not a dynamic index: that
                    // would put the pack in local memory)
                    const int e = t - i * P, wi = e >> 1;
                    const u32 wd = wi == 0 ? dense.x : wi == 1 ? dense.y : wi == 2 ? dense.z : dense.w;
                    const u32 half = (e & 1) ? wd >> 16 : wd & 0xffffu;
                    const u32 v = H16 ? sparse_signed_f16(half, t2, tau2) : sparse_signed(half, t2, tau);
                    const u32 keep = (e & 1) ? 0x0000ffffu : 0xffff0000u, put = (e & 1) ? v << 16 : v;
                    if (wi == 0) packed.x = (packed.x & keep) | put;
                    else if (wi == 1) packed.y = (packed.y & keep) | put;
                    else if (wi == 2) packed.z = (packed.z & keep) | put;
                    else packed.w = (packed.w & keep) | put;
                }
            }
            if (!H16 && store_bf16) __stcs(xr + i, packed);   // a predicated store, no branch
            if (FP8) {                                  // the E5M2 copy of the bf16 values just rounded
                u32 unused = 0;
                __stcs(reinterpret_cast<uint2*>(d8) + i,
                       H16 ? e5m2_of_f16_pack(packed)
                           : FOLD ? e5m2_of_bf16_pack(packed) : quantize8<E5M2>(packed, fp8_scale, unused));
            }
            // the slot's value is in `packed` (the stores above used it): refill it with the next row
            if (WALK) cp_async16(smem_u32(s_row + i), next + i, next_bytes);
        }
        if (k == KH - 1) cp_async_commit();
    }
    // FIXUP: the special columns the loop wrote as plain ones, rewritten. The target's logit is read
    // from its shared slot only now: passed by value it would hold a register across the loop, where
    // the kernel sits at its 64-register cap.
    if constexpr (FIXUP) h16_fixup(d8, V, n_packs, t, tpack, *xt_slot, c, tsub, rowkey, tau, tau2);
}

template <typename T, int K, bool FUSED, bool FP8 = false>
__device__ void classifier_backward_v3(float* losses, T* logits, const int* targets,   // (N,) (N, Vp) in/out; (N,)
                                       float grad_scale, int N, int V, int Vp,
                                       u8* dlogits8 = nullptr, float fp8_scale = 1.0f,  // (N, Vp)
                                       int write_bf16 = 1, float sparse_tau = 0.0f,
                                       const u32* sparse_seed = nullptr, int row0 = 0) {
    extern __shared__ uint4 s_row[];
    __shared__ float s_m[CLS3_BLOCK / 32], s_s[CLS3_BLOCK / 32], s_res[3];   // max, sum, the target's logit
    using R = Raw<T>;
    constexpr int P = R::P;
    constexpr int KH = (K + 1) / 2;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n_packs = Vp / P;
    if ((int)blockIdx.x >= N) return;
    v3_copy_row<T, K>(s_row, reinterpret_cast<const uint4*>(logits + (size_t)blockIdx.x * Vp), n_packs, tid);
    // Only the FP8 kernel walks rows (measured, H200, 8192 x 50304, one block a row -> walking: FP8
    // E5M2-only 469 -> 426 us; bf16 dlogits 445 -> 470 and the loss alone 235 -> 245 us, slower).
    // K = 25 walks no rows either: its refills spilled at the 64 registers of two blocks an SM. The
    // launcher starts one block a row where WALK is false (v3_fp8_grid in ops/classifier.py).
    constexpr bool WALK = FP8 && K <= V3_WALK_K;
    // sparse_tau > 0 (bf16 rows; FP8: E5M2 only, power-of-two scale -- the launcher checks): the hash's base,
    // from the step's seed in device memory (a CUDA graph replays this launch's arguments as they were)
    const u32 seed_base = (sparse_tau > 0.0f) ? fmix32(*sparse_seed ^ SPARSE_PHI) : 0u;
    // sparse_tau as a pair in the thinned rows' format: f16 (the FP8 kernel's, see v3_pass2) or bf16
    const u32 tau2 = FP8 ? cvt_rn_f16x2(sparse_tau, sparse_tau) : __byte_perm(__float_as_uint(sparse_tau), 0u, 0x3232);
    int row = blockIdx.x;
    do {   // one pass where !WALK (the condition is then constant false); `continue` goes to it
        // Few registers live across the passes: the target is read here, the next row's address
        // made where it is used.
        const int t = targets[row];
        const bool has_next = WALK && row + (int)gridDim.x < N;
        uint4* xr = reinterpret_cast<uint4*>(logits + (size_t)row * Vp);
        if (t == -1) {                                  // uniform over the block
            if (tid == 0) losses[row] = 0.0f;
            if (FUSED)
                for (int i = tid; i < n_packs; i += CLS3_BLOCK) {
                    if (!FP8 || write_bf16) __stcs(xr + i, make_uint4(0u, 0u, 0u, 0u));
                    if (FP8) __stcs(reinterpret_cast<uint2*>(dlogits8 + (size_t)row * Vp) + i, make_uint2(0u, 0u));
                }
            cp_async_wait<0>();                         // this row's copies land before the slots are refilled
            if (has_next) v3_copy_row<T, K>(s_row, xr + (size_t)gridDim.x * n_packs, n_packs, tid);
            continue;
        }
        const bool valid = t >= 0 && t < V;
        // Each thread reads back only the packs it copied until the barriers below: first their
        // max, then their sum of exp(x - max) (no running rescale: a max sweep of packed bf16
        // maxima costs less than the online form's per-pack test and its two-op exponents).
        float m = neg_inf();
        cp_async_wait<1>();
        #pragma unroll
        for (int k = 0; k < KH; k++) {
            const int i = tid + k * CLS3_BLOCK;
            if (i < n_packs && i * P < V) m = fmaxf(m, pack_max<T>(s_row[i], V - i * P));
        }
        cp_async_wait<0>();
        #pragma unroll
        for (int k = KH; k < K; k++) {
            const int i = tid + k * CLS3_BLOCK;
            if (i < n_packs && i * P < V) m = fmaxf(m, pack_max<T>(s_row[i], V - i * P));
        }
        float s = 0.0f;
        {
            const float sh = (m == neg_inf()) ? 0.0f : m, c = -sh * LOG2E;
            if (sizeof(T) == 2 && exp_fma_ok(sh)) {
                #pragma unroll
                for (int k = 0; k < K; k++) {
                    const int i = tid + k * CLS3_BLOCK;
                    if (i < n_packs && i * P < V) s += pack_expsum<T, true>(s_row[i], V - i * P, sh, c);
                }
            } else {
                #pragma unroll
                for (int k = 0; k < K; k++) {
                    const int i = tid + k * CLS3_BLOCK;
                    if (i < n_packs && i * P < V) s += pack_expsum<T, false>(s_row[i], V - i * P, sh, c);
                }
            }
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            combine_ms(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
        if (lane == 0) { s_m[warp] = m; s_s[warp] = s; }
        __syncthreads();                                // also publishes every thread's cp.async data
        if (warp == 0) {
            m = lane < CLS3_BLOCK / 32 ? s_m[lane] : neg_inf();
            s = lane < CLS3_BLOCK / 32 ? s_s[lane] : 0.0f;
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                combine_ms(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
            if (lane == 0) {
                s_res[0] = m;
                s_res[1] = s;
                const float xt = valid ? to_float(reinterpret_cast<const T*>(s_row)[t]) : 0.0f;
                s_res[2] = xt;                          // for h16_fixup, after pass 2 has refilled the slots
                losses[row] = row_loss(m, s, xt, valid);
            }
        }
        __syncthreads();                                // s_res, and thread 0 is done with the target's slot
        if (!FUSED) {                                   // cross_entropy: the slots are free now
            if (has_next) v3_copy_row<T, K>(s_row, xr + (size_t)gridDim.x * n_packs, n_packs, tid);
            continue;
        }
        const float M = s_res[0], S = s_res[1];
        const float sh = (M == neg_inf()) ? 0.0f : M;
        const float scale = grad_scale / S;
        const bool exact = !(isfinite(scale) && isfinite(grad_scale));   // NaN/inf rows: canonical NaN bits
        const int tpack = valid ? t / P : -1;
        u8* d8 = FP8 ? dlogits8 + (size_t)row * Vp : nullptr;
        // (the last row's refill: 0 bytes from its own row -- the SASS had a null test a pack)
        const uint4* next = has_next ? xr + (size_t)gridDim.x * n_packs : xr;
        const int next_bytes = has_next ? 16 : 0;
        // The row's pass 2 is one straight-line loop (the choices below are made once a row, not
        // once a pack: per-pack branches cost the scheduler its overlap of one pack's exps with
        // the last one's stores). Finite rows of bf16 with exp_fma_ok shifts take the lean loop;
        // the FP8 kernel's E5M2-only rows there also fold fp8_scale into the softmax's scale
        // before the bf16 rounding: fp8_scale is a power of two that keeps |dlogits| * fp8_scale
        // <= 57344 (dlogits_fp8_scale), so bf16(x * fp8_scale) = bf16(x) * fp8_scale exactly and
        // the bytes stay e5m2(bf16(dlogits) * fp8_scale), one multiply a logit fewer. (Any other
        // scale a caller passes takes the multiply after the rounding, as before.)
        const u32 rowkey = (sparse_tau > 0.0f) ? fmix32(seed_base + (u32)(row0 + row)) : 0u;   // the row's draws
        if (sizeof(T) == 2 && !exact && exp_fma_ok(sh)) {
            if (FP8 && !write_bf16 && is_pow2(fp8_scale) && sparse_tau > 0.0f)
                v3_pass2<T, K, FP8, true, true, true>(s_row, xr, d8, next, next_bytes, n_packs, V, t, tpack, sh,
                                                      scale * fp8_scale, grad_scale * fp8_scale, fp8_scale, false,
                                                      rowkey, sparse_tau, tau2, &s_res[2]);
            else if (FP8 && !write_bf16 && is_pow2(fp8_scale))
                v3_pass2<T, K, FP8, true, true>(s_row, xr, d8, next, next_bytes, n_packs, V, t, tpack, sh,
                                                        scale * fp8_scale, grad_scale * fp8_scale, fp8_scale, false);
            else if (!FP8 && sparse_tau > 0.0f)         // the bf16 dlogits thinned (bf16 only: sizeof(T) == 2)
                v3_pass2<T, K, false, true, false, true>(s_row, xr, d8, next, next_bytes, n_packs, V, t, tpack, sh, scale,
                                                         grad_scale, fp8_scale, true, rowkey, sparse_tau, tau2);
            else
                v3_pass2<T, K, FP8, true, false>(s_row, xr, d8, next, next_bytes, n_packs, V, t, tpack, sh, scale,
                                                        grad_scale, fp8_scale, !FP8 || write_bf16);
        } else {
            v3_pass2<T, K, FP8, false, false>(s_row, xr, d8, next, next_bytes, n_packs, V, t, tpack, sh, scale,
                                                     grad_scale, fp8_scale, !FP8 || write_bf16);
        }
        cp_async_commit();
    } while (WALK && (row += gridDim.x) < N);
    cp_async_wait<0>();                                 // nothing left in flight at exit
}

// ------------------------------------------------------ target check -------

// One block: out = (min(targets), max(targets), count(targets != -1)).
// Integer min/max/sum are exact, so any order gives the same answer.
extern "C" __global__ void classifier_check_targets_kernel(int* out, const int* targets, int N) {   // (3,) (N,)
    __shared__ int part[3][32];
    int mn = 0x7fffffff, mx = -0x7fffffff - 1, cnt = 0;
    #pragma unroll 8
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const int t = targets[i];
        mn = min(mn, t);
        mx = max(mx, t);
        cnt += (t != -1);
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        mn = min(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { part[0][warp] = mn; part[1][warp] = mx; part[2][warp] = cnt; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) {
            mn = min(mn, part[0][w]);
            mx = max(mx, part[1][w]);
            cnt += part[2][w];
        }
        out[0] = mn; out[1] = mx; out[2] = cnt;
    }
}

// ------------------------------------------------------ extern "C" ---------

#define CLASSIFIER_KERNELS(T, SUF)                                                                  \
    extern "C" __global__ void classifier_forward_kernel_##SUF(float* losses, const T* logits,      \
                                                               const int* targets, int N, int V, int Vp) { \
        classifier_forward<T>(losses, logits, targets, N, V, Vp);                                   \
    }                                                                                               \
    extern "C" __global__ void classifier_backward_kernel_v1_##SUF(float* losses, T* logits,        \
                                                                   const int* targets, float grad_scale, \
                                                                   int N, int V, int Vp) {          \
        classifier_backward_v1<T>(losses, logits, targets, grad_scale, N, V, Vp);                   \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(CLS_BLOCK, 1)                                      \
    classifier_backward_kernel_v2_##SUF(float* losses, T* logits, const int* targets, float grad_scale, \
                                        int N, int V, int Vp) {                                     \
        classifier_backward_v2<T>(losses, logits, targets, grad_scale, N, V, Vp);                   \
    }

CLASSIFIER_KERNELS(float, f32)
CLASSIFIER_KERNELS(bf16, bf16)

// v3 names carry K (packs per thread): classifier_backward_kernel_v3_k13_bf16, ...; the
// forward (cross_entropy) is the same kernel without its write pass.
#define CLASSIFIER_V3(T, SUF, K)                                                                    \
    extern "C" __global__ void __launch_bounds__(CLS3_BLOCK, 2)                                     \
    classifier_backward_kernel_v3_k##K##_##SUF(float* losses, T* logits, const int* targets,        \
                                               float grad_scale, int N, int V, int Vp,             \
                                               float sparse_tau, const u32* sparse_seed, int row0) { \
        classifier_backward_v3<T, K, true>(losses, logits, targets, grad_scale, N, V, Vp, nullptr, \
                                           1.0f, 1, sizeof(T) == 2 ? sparse_tau : 0.0f, sparse_seed, row0); \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(CLS3_BLOCK, 2)                                     \
    classifier_forward_kernel_v3_k##K##_##SUF(float* losses, const T* logits, const int* targets,   \
                                              int N, int V, int Vp) {                               \
        classifier_backward_v3<T, K, false>(losses, const_cast<T*>(logits), targets, 0.0f, N, V, Vp); \
    }

CLASSIFIER_V3(float, f32, 1)
CLASSIFIER_V3(float, f32, 4)
CLASSIFIER_V3(float, f32, 13)
CLASSIFIER_V3(float, f32, 25)
CLASSIFIER_V3(bf16, bf16, 1)
CLASSIFIER_V3(bf16, bf16, 4)
CLASSIFIER_V3(bf16, bf16, 13)
CLASSIFIER_V3(bf16, bf16, 25)

// The FP8 variant (bf16 only): classifier_backward_fp8_kernel_v3_k13_bf16, ...
#define CLASSIFIER_V3_FP8(K)                                                                        \
    extern "C" __global__ void __launch_bounds__(CLS3_BLOCK, 2)                                     \
    classifier_backward_fp8_kernel_v3_k##K##_bf16(float* losses, bf16* logits, u8* dlogits8,        \
                                                  const int* targets, float grad_scale, float fp8_scale, \
                                                  int N, int V, int Vp, int write_bf16,             \
                                                  float sparse_tau, const u32* sparse_seed, int row0) { \
        classifier_backward_v3<bf16, K, true, true>(losses, logits, targets, grad_scale, N, V, Vp,  \
                                                    dlogits8, fp8_scale, write_bf16, sparse_tau,    \
                                                    sparse_seed, row0);                             \
    }

CLASSIFIER_V3_FP8(1)
CLASSIFIER_V3_FP8(4)
CLASSIFIER_V3_FP8(13)
CLASSIFIER_V3_FP8(25)
