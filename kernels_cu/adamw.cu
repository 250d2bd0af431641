/*
 * adamw.cu -- the AdamW update over the flat parameter buffer, and the
 * gradient's global L2 norm (for clipping).
 *
 * Update, per element i (all fp32; g from fp32 or bf16 grads):
 *   clip  = min(1, max_norm / (norm + 1e-6))   if max_norm > 0 (norm read from device memory), else 1
 *   g     = grads[i] * grad_scale * clip
 *   m[i]  = beta1 * m[i] + (1 - beta1) * g
 *   v[i]  = beta2 * v[i] + (1 - beta2) * g * g
 *   p[i] -= lr * ((m[i] / bc1) / (sqrt(v[i] / bc2) + eps) + wd_i * p[i])
 *   params_lowp[i] = bf16(p[i])                   (optional bf16 working copy, same pass)
 * bc1 = 1 - beta1^step, bc2 = 1 - beta2^step (the host computes them in
 * float64). wd_i = weight_decay inside a decay span, 0 elsewhere. A NaN norm
 * makes the clip NaN (never silently 1), so a blown-up step is visible.
 * Decay spans: a sorted table of boundaries [s0, e0, s1, e1, ...] of merged,
 * non-empty spans, copied to shared memory; element i is decayed iff an odd
 * number of boundaries are <= i. Each thread walks its indices upwards
 * (grid-stride), so it keeps a cursor into the table instead of searching.
 * Shapes: params, m, v (n,) fp32; grads (n,) fp32 or bf16; params_lowp (n,)
 * bf16; bounds (num_bounds,) int32; norm (1,) fp32.
 * The update is elementwise: deterministic, no atomics. One launch, fixed grid.
 *
 * Grad norm: two stages with a fixed grid (as reduce.cu): stage 1 writes one
 * fp32 partial sum of squares per block, stage 2 (one block) sums them and
 * takes the square root. Fixed order -> bitwise reproducible, no atomics.
 */
#include "common.cuh"

// 4 consecutive grads as floats (16-byte fp32 load, or 8-byte bf16 load).
__device__ __forceinline__ float4 load_grad4(const float* g) {
    return __ldcs(reinterpret_cast<const float4*>(g));
}
__device__ __forceinline__ float4 load_grad4(const bf16* g) {
    const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(g));
    return make_float4(__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u),
                       __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xffff0000u));
}

struct AdamW {
    float lr, beta1, beta2, bc1, bc2, eps, weight_decay;
};

__device__ __forceinline__ void adamw_step(float& p, float& m, float& v, float g, float wd, const AdamW& a) {
    m = a.beta1 * m + (1.0f - a.beta1) * g;
    v = a.beta2 * v + (1.0f - a.beta2) * g * g;
    const float mhat = m / a.bc1;
    const float vhat = v / a.bc2;
    p -= a.lr * (mhat / (sqrtf(vhat) + a.eps) + wd * p);
}

// Weight decay of element i; `c` is the thread's cursor into the boundary table.
__device__ __forceinline__ float decay_at(int i, int& c, const int* bounds, int num_bounds, float wd) {
    while (c < num_bounds && bounds[c] <= i) c++;
    return (c & 1) ? wd : 0.0f;
}

template <typename TG>
__device__ void adamw_update(float* params, float* m, float* v, bf16* params_lowp,   // (n,) x3, (n,) or unused
                             const TG* grads, const int* bounds, const float* norm,  // (n,) (num_bounds,) (1,)
                             int n, int num_bounds, int write_lowp, AdamW a, float grad_scale, float max_norm) {
    extern __shared__ int s_bounds[];                // (num_bounds,)
    for (int i = threadIdx.x; i < num_bounds; i += blockDim.x) s_bounds[i] = bounds[i];
    __syncthreads();
    float scale = grad_scale;
    if (max_norm > 0.0f) {
        float clip = max_norm / (norm[0] + 1e-6f);
        clip = (clip > 1.0f) ? 1.0f : clip;          // NaN stays NaN
        scale *= clip;
    }
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
            adamw_step(p4.x, m4.x, v4.x, g4.x * scale, decay_at(i, cur, s_bounds, num_bounds, a.weight_decay), a);
            adamw_step(p4.y, m4.y, v4.y, g4.y * scale, decay_at(i + 1, cur, s_bounds, num_bounds, a.weight_decay), a);
            adamw_step(p4.z, m4.z, v4.z, g4.z * scale, decay_at(i + 2, cur, s_bounds, num_bounds, a.weight_decay), a);
            adamw_step(p4.w, m4.w, v4.w, g4.w * scale, decay_at(i + 3, cur, s_bounds, num_bounds, a.weight_decay), a);
            *reinterpret_cast<float4*>(params + i) = p4;
            *reinterpret_cast<float4*>(m + i) = m4;
            *reinterpret_cast<float4*>(v + i) = v4;
            if (write_lowp)
                *reinterpret_cast<uint2*>(params_lowp + i) = make_uint2(pack_bf16x2(p4.x, p4.y), pack_bf16x2(p4.z, p4.w));
        }
        done = n4 * 4;
    }
    // Scalar tail (or everything, when a pointer is misaligned). Indices stay
    // above the vector ones, so the cursor still only moves forward.
    for (int i = done + tid; i < n; i += stride) {
        float p = params[i], mi = m[i], vi = v[i];
        adamw_step(p, mi, vi, to_float(grads[i]) * scale, decay_at(i, cur, s_bounds, num_bounds, a.weight_decay), a);
        params[i] = p;
        m[i] = mi;
        v[i] = vi;
        if (write_lowp) params_lowp[i] = float_to_bf16(p);
    }
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
            float bc1, float bc2, float eps, float weight_decay, float grad_scale, float max_norm) { \
        const AdamW a = {lr, beta1, beta2, bc1, bc2, eps, weight_decay};                            \
        adamw_update<TG>(params, m, v, params_lowp, grads, bounds, norm, n, num_bounds, write_lowp, a, \
                         grad_scale, max_norm);                                                     \
    }                                                                                               \
    extern "C" __global__ void adamw_grad_norm_stage1_kernel_##SUF(float* partials, const TG* g, int n) { \
        grad_norm_stage1<TG>(partials, g, n);                                                       \
    }

// The dtype suffix is the grads' dtype; params, m, v are always fp32.
ADAMW_KERNELS(float, f32)
ADAMW_KERNELS(bf16, bf16)
