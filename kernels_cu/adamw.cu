/*
 * adamw.cu -- the AdamW update over the flat parameter buffer, and the
 * gradient's global L2 norm (for clipping).
 *
 * Update, per element i (all fp32; g from fp32 or bf16 grads):
 *   clip  = min(1, max_norm / (norm + 1e-6))   if max_norm > 0 (norm read from device memory), else 1
 *   g     = grads[i] * grad_scale * clip
 *   m[i]  = beta1 * m[i] + omb1 * g              (omb1 = 1 - beta1, omb2 = 1 - beta2)
 *   v[i]  = beta2 * v[i] + omb2 * g * g
 *   p[i] -= lr * ((m[i] / bc1) / (sqrt(v[i] / bc2) + eps) + wd_i * p[i])
 *   params_lowp[i] = bf16(p[i])                   (optional bf16 working copy, same pass)
 * With fp32 master weights the last line runs on the SFU's approximations, as llm.c's
 * --use_fast_math build does: m[i] * (1 / bc1) and v[i] * (1 / bc2) (the reciprocals once
 * a thread), sqrt.approx and rcp.approx (each within ~2 ulp). IEEE division and square root
 * are ~10-instruction sequences each, three divisions and a root an element: the kernel is
 * memory-bound in time but not in energy (alone at d48, 732 W at the top clock against a
 * copy's ~390 W), and the step runs at the board's power cap, where joules are time
 * (tools/notes/profile.md, twenty-seventh session). The update term moves by a few ulp of
 * itself, an error far below p's own ulp. The bf16-parameter kernels below keep the IEEE
 * operations: their update rounds straight to bf16, where the tests compare bits.
 * bc1 = 1 - beta1^step, bc2 = 1 - beta2^step and the coefficients
 * omb1 = 1 - beta1, omb2 = 1 - beta2 are computed by the host in float64 and
 * passed as fp32: 1.0f - float(beta2) would carry beta2's fp32 representation
 * error, amplified by the cancellation (beta2 = 0.999: 1 - fp32(0.999) is
 * 1.3e-5 off 0.001, a systematic bias of v's new term far above fp32 rounding). wd_i = weight_decay inside a decay span, 0 elsewhere. A NaN norm
 * makes the clip NaN (never silently 1), so a blown-up step is visible.
 * Decay spans: a sorted table of boundaries [s0, e0, s1, e1, ...] of merged,
 * non-empty spans, copied to shared memory; element i is decayed iff an odd
 * number of boundaries are <= i. Each thread walks its indices upwards
 * (grid-stride), so it keeps a cursor into the table instead of searching.
 * Shapes: params, m, v (n,) fp32; grads (n,) fp32 or bf16; params_lowp (n,)
 * bf16; bounds (num_bounds,) int32; norm (1,) fp32.
 * The update is elementwise: deterministic, no atomics. One launch, fixed grid.
 *
 * Without fp32 master weights (adamw_update_lowp_kernel_*): params are the
 * bf16 weights themselves, p = float(params[i]), and the fp32 update
 * d = -lr * ((m/bc1) / (sqrt(v/bc2) + eps) + wd_i * p) is rounded back by `mode`:
 *   0 "bf16":  params[i] = bf16_rne(p + d)      (an update under half an ulp is lost)
 *   1 "sr":    params[i] = bf16_sr(p + d, r_i)  (stochastic rounding: unbiased, E = p + d)
 *   2 "kahan": u = d + float(comp[i]); s = bf16_rne(p + u); comp[i] = bf16_rne(u - (float(s) - p));
 *              params[i] = s                    (the rounding error is carried to the next step)
 * bf16_sr(x, r) adds 16 random bits r to the 16 bits that bf16 drops and
 * truncates: x rounds up in magnitude with probability (dropped part) / ulp.
 * r_i = hi16(mix(mix((i + offset) ^ k1) + k2)) with mix = lowbias32 (a
 * counter-based hash, no generator state): (k1, k2) come from (seed, step) on
 * the host, so one step's rounding is reproducible and the next step's is
 * independent. gpucore/ops/adamw.py computes the same bits with NumPy uint32.
 * Shapes: params, comp (n,) bf16; m, v (n,) fp32; grads (n,) fp32 or bf16.
 *
 * Grad norm: two stages with a fixed grid (as reduce.cu): stage 1 writes one
 * fp32 partial sum of squares per block, stage 2 (one block) sums them and
 * takes the square root. Fixed order -> bitwise reproducible, no atomics.
 */
#include "optim.cuh"
#include "fast_packs.cuh"   // rcp_ftz, sqrt_ftz, cvt_rn_bf16x2

struct AdamW {
    float lr, beta1, beta2, omb1, omb2, bc1, bc2, eps, weight_decay;   // omb1 = 1 - beta1, omb2 = 1 - beta2
};

// The fp32-master update on the SFU (header): inv_bc1 = 1 / bc1, inv_bc2 = 1 / bc2. ftz costs
// nothing here: a vhat under 2^-126 has a root far below eps, and rcp's input is >= eps.
__device__ __forceinline__ void adamw_step(float& p, float& m, float& v, float g, float wd, const AdamW& a,
                                           float inv_bc1, float inv_bc2) {
    m = a.beta1 * m + a.omb1 * g;
    v = a.beta2 * v + a.omb2 * g * g;
    const float mhat = m * inv_bc1;
    const float vhat = v * inv_bc2;
    p -= a.lr * (mhat * rcp_ftz(sqrt_ftz(vhat) + a.eps) + wd * p);
}

template <typename TG>
__device__ void adamw_update(float* params, float* m, float* v, bf16* params_lowp,   // (n,) x3, (n,) or unused
                             const TG* grads, const int* bounds, const float* norm,  // (n,) (num_bounds,) (1,)
                             int n, int num_bounds, int write_lowp, AdamW a, float grad_scale, float max_norm) {
    extern __shared__ int s_bounds[];                // (num_bounds,)
    load_decay_bounds(s_bounds, bounds, num_bounds);
    const float scale = clip_scale(grad_scale, norm, max_norm);
    const float inv_bc1 = 1.0f / a.bc1, inv_bc2 = 1.0f / a.bc2;   // once a thread, IEEE
    const int stride = gridDim.x * blockDim.x;
    const int tid = blockIdx.x * blockDim.x + threadIdx.x;
    int cur = 0;
    int done = 0;
    const bool vec = is_aligned16(params) && is_aligned16(m) && is_aligned16(v) &&
                     (reinterpret_cast<u64>(grads) % (4 * sizeof(TG)) == 0) &&
                     (!write_lowp || reinterpret_cast<u64>(params_lowp) % 8 == 0);
    if (vec) {
        const int n4 = n / 4;
        for (int q = tid; q < n4; q += stride) {
            const int i = q * 4;
            float4 p4 = *reinterpret_cast<const float4*>(params + i);
            float4 m4 = *reinterpret_cast<const float4*>(m + i);
            float4 v4 = *reinterpret_cast<const float4*>(v + i);
            const float4 g4 = load_grad4(grads + i);
            // The decay of i; i + 1 .. i + 3 share it unless a span boundary falls among them (the
            // boundaries are the tensors' edges: nearly every group sits inside one tensor).
            const float wd0 = decay_at(i, cur, s_bounds, num_bounds, a.weight_decay);
            float wd1 = wd0, wd2 = wd0, wd3 = wd0;
            if (cur < num_bounds && s_bounds[cur] <= i + 3) {
                wd1 = decay_at(i + 1, cur, s_bounds, num_bounds, a.weight_decay);
                wd2 = decay_at(i + 2, cur, s_bounds, num_bounds, a.weight_decay);
                wd3 = decay_at(i + 3, cur, s_bounds, num_bounds, a.weight_decay);
            }
            adamw_step(p4.x, m4.x, v4.x, g4.x * scale, wd0, a, inv_bc1, inv_bc2);
            adamw_step(p4.y, m4.y, v4.y, g4.y * scale, wd1, a, inv_bc1, inv_bc2);
            adamw_step(p4.z, m4.z, v4.z, g4.z * scale, wd2, a, inv_bc1, inv_bc2);
            adamw_step(p4.w, m4.w, v4.w, g4.w * scale, wd3, a, inv_bc1, inv_bc2);
            *reinterpret_cast<float4*>(params + i) = p4;
            *reinterpret_cast<float4*>(m + i) = m4;
            *reinterpret_cast<float4*>(v + i) = v4;
            if (write_lowp) {   // the one-instruction conversion, but NaN keeps float_to_bf16's bits
                const bool nan = isnan(p4.x) || isnan(p4.y) || isnan(p4.z) || isnan(p4.w);
                *reinterpret_cast<uint2*>(params_lowp + i) =
                    nan ? make_uint2(pack_bf16x2(p4.x, p4.y), pack_bf16x2(p4.z, p4.w))
                        : make_uint2(cvt_rn_bf16x2(p4.x, p4.y), cvt_rn_bf16x2(p4.z, p4.w));
            }
        }
        done = n4 * 4;
    }
    // Scalar tail (or everything, when a pointer is misaligned). Indices stay
    // above the vector ones, so the cursor still only moves forward.
    for (int i = done + tid; i < n; i += stride) {
        float p = params[i], mi = m[i], vi = v[i];
        adamw_step(p, mi, vi, to_float(grads[i]) * scale, decay_at(i, cur, s_bounds, num_bounds, a.weight_decay), a,
                   inv_bc1, inv_bc2);
        params[i] = p;
        m[i] = mi;
        v[i] = vi;
        if (write_lowp) params_lowp[i] = float_to_bf16(p);
    }
}

// ------------------------------------------------------ bf16 params, no master ---

enum { LOWP_RNE = 0, LOWP_SR = 1, LOWP_KAHAN = 2 };

// One element: AdamW moments, then the new bf16 weight by `mode` (see the header).
__device__ __forceinline__ bf16 adamw_step_lowp(bf16 pb, bf16& comp, float& m, float& v, float g, float wd,
                                                 const AdamW& a, int mode, u32 idx, u32 k1, u32 k2) {
    const float p = bf16_to_float(pb);
    m = a.beta1 * m + a.omb1 * g;
    v = a.beta2 * v + a.omb2 * g * g;
    const float d = -a.lr * ((m / a.bc1) / (sqrtf(v / a.bc2) + a.eps) + wd * p);
    if (mode == LOWP_SR) return float_to_bf16_sr(p + d, sr_bits(idx, k1, k2));
    if (mode == LOWP_KAHAN) {
        const float u = d + bf16_to_float(comp);
        const bf16 s = float_to_bf16(p + u);
        comp = float_to_bf16(u - (bf16_to_float(s) - p));   // what the rounding to s dropped
        return s;
    }
    return float_to_bf16(p + d);
}

template <typename TG>
__device__ void adamw_update_lowp(bf16* params, float* m, float* v, bf16* comp,       // (n,) x4 (comp: kahan only)
                                  const TG* grads, const int* bounds, const float* norm, // (n,) (num_bounds,) (1,)
                                  int n, int num_bounds, int mode, AdamW a, float grad_scale, float max_norm,
                                  u32 k1, u32 k2, u32 offset) {
    extern __shared__ int s_bounds[];                // (num_bounds,)
    load_decay_bounds(s_bounds, bounds, num_bounds);
    const float scale = clip_scale(grad_scale, norm, max_norm);
    const int stride = gridDim.x * blockDim.x;
    const int tid = blockIdx.x * blockDim.x + threadIdx.x;
    const bool kahan = (mode == LOWP_KAHAN);
    bf16 unused = {0};
    int cur = 0;
    for (int i = tid; i < n; i += stride) {          // elementwise: the 2-byte params keep loads narrow anyway
        float mi = m[i], vi = v[i];
        bf16 ci = kahan ? comp[i] : unused;
        const float wd = decay_at(i, cur, s_bounds, num_bounds, a.weight_decay);
        params[i] = adamw_step_lowp(params[i], ci, mi, vi, to_float(grads[i]) * scale, wd, a, mode,
                                    (u32)i + offset, k1, k2);
        m[i] = mi;
        v[i] = vi;
        if (kahan) comp[i] = ci;
    }
}

// out[i] = bf16_sr(x[i], r_{i + offset}): the rounding the "sr" update uses, on its own (tests, casts).
extern "C" __global__ void adamw_stochastic_round_kernel(bf16* out, const float* x, int n,   // (n,) (n,)
                                                         u32 k1, u32 k2, u32 offset) {
    const int stride = gridDim.x * blockDim.x;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = float_to_bf16_sr(x[i], sr_bits((u32)i + offset, k1, k2));
}

// ------------------------------------------------------ grad norm ----------

#define NORM_UNROLL 4

template <typename T>
__device__ void grad_norm_stage1(float* partials, const T* g, int n) {   // (gridDim.x,) (n,)
    __shared__ float scratch[32];
    constexpr int P = Pack16<T>::size;
    const int nthreads = gridDim.x * blockDim.x;
    const int tid = blockIdx.x * blockDim.x + threadIdx.x;
    float acc = 0.0f;
    int done = 0;
    if (is_aligned16(g)) {
        const int n_packs = n / P;
        int i = tid;
        for (; i + (NORM_UNROLL - 1) * nthreads < n_packs; i += nthreads * NORM_UNROLL) {
            Pack16<T> p[NORM_UNROLL];
            #pragma unroll
            for (int u = 0; u < NORM_UNROLL; u++) p[u] = load16_cs(g + (i + u * nthreads) * P);
            #pragma unroll
            for (int u = 0; u < NORM_UNROLL; u++)
                #pragma unroll
                for (int k = 0; k < P; k++) {
                    const float x = to_float(p[u].v[k]);
                    acc += x * x;
                }
        }
        for (; i < n_packs; i += nthreads) {
            Pack16<T> p = load16_cs(g + i * P);
            #pragma unroll
            for (int k = 0; k < P; k++) {
                const float x = to_float(p.v[k]);
                acc += x * x;
            }
        }
        done = n_packs * P;
    }
    for (int i = done + tid; i < n; i += nthreads) {
        const float x = to_float(g[i]);
        acc += x * x;
    }
    acc = block_reduce<SumOp>(acc, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

extern "C" __global__ void adamw_grad_norm_stage2_kernel(float* out, const float* partials, int num_partials) {   // (1,) (num_partials,)
    __shared__ float scratch[32];
    float acc = 0.0f;
    for (int i = threadIdx.x; i < num_partials; i += blockDim.x) acc += partials[i];
    acc = block_reduce<SumOp>(acc, scratch);
    if (threadIdx.x == 0) out[0] = sqrtf(acc);
}

// ------------------------------------------------------ extern "C" ---------

#define ADAMW_KERNELS(TG, SUF)                                                                      \
    extern "C" __global__ void adamw_update_kernel_##SUF(                                           \
            float* params, float* m, float* v, bf16* params_lowp, const TG* grads, const int* bounds, \
            const float* norm, int n, int num_bounds, int write_lowp, float lr, float beta1, float beta2, \
            float omb1, float omb2, float bc1, float bc2, float eps, float weight_decay, float grad_scale,\
            float max_norm) {                                                                       \
        const AdamW a = {lr, beta1, beta2, omb1, omb2, bc1, bc2, eps, weight_decay};                \
        adamw_update<TG>(params, m, v, params_lowp, grads, bounds, norm, n, num_bounds, write_lowp, a, \
                         grad_scale, max_norm);                                                     \
    }                                                                                               \
    extern "C" __global__ void adamw_update_lowp_kernel_##SUF(                                      \
            bf16* params, float* m, float* v, bf16* comp, const TG* grads, const int* bounds,      \
            const float* norm, int n, int num_bounds, int mode, float lr, float beta1, float beta2, \
            float omb1, float omb2, float bc1, float bc2, float eps, float weight_decay,            \
            float grad_scale, float max_norm,                                                       \
            u32 k1, u32 k2, u32 offset) {                                                           \
        const AdamW a = {lr, beta1, beta2, omb1, omb2, bc1, bc2, eps, weight_decay};                \
        adamw_update_lowp<TG>(params, m, v, comp, grads, bounds, norm, n, num_bounds, mode, a,     \
                              grad_scale, max_norm, k1, k2, offset);                                \
    }                                                                                               \
    extern "C" __global__ void adamw_grad_norm_stage1_kernel_##SUF(float* partials, const TG* g, int n) { \
        grad_norm_stage1<TG>(partials, g, n);                                                       \
    }

// The dtype suffix is the grads' dtype; m, v are always fp32 (params fp32, or bf16 in the _lowp kernel).
ADAMW_KERNELS(float, f32)
ADAMW_KERNELS(bf16, bf16)
