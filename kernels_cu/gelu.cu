/*
 * gelu.cu -- GELU, tanh approximation (as GPT-2), forward and backward.
 *
 * Math (fp32 whatever T is, one rounding to T at the end):
 *   u        = sqrt(2/pi) * (x + 0.044715 x^3)
 *   gelu(x)  = 0.5 x (1 + tanh(u))              = x * s,  s = sigmoid(2u) = 1 / (1 + e), e = exp(-2u)
 *   gelu'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u'
 *            = s * (1 + 2 x (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 x^2)),   1 - s = e * s
 *   The sigmoid form is used because it is well conditioned everywhere: no
 *   1 + tanh(u) cancellation for negative x, one exp and one reciprocal.
 *   The exponent is clamped to 80 (exp(80) ~ 5.5e34): e stays finite, so
 *   e * s is never inf * 0, and __fdividef is accurate to 2 ulp (its divisor stays
 *   below 2^126). There (x < -9) gelu and gelu' are below 1e-33 anyway.
 * Shapes: any, flattened to n elements.
 * Gradient rule: dx = gelu'(x) * dout is an activation gradient (=). dx may
 *   alias dout (or x): every element is read by the thread that writes it,
 *   before the write (so no __restrict__ anywhere; gelu(x, out=x) works too).
 * Memory-bound: each thread handles UNROLL 16-byte packs, all loads issued
 * before the first store; the grid covers the data (no grid-stride loop), as
 * in add.cu. Edge blocks and unaligned pointers go element by element.
 *
 * gelu_backward_dbias_kernel_*: the same dx, plus the column sums of dx that
 *   the NEXT layer's bias gradient needs (GPT-2: dfc_bias += sum over rows of
 *   dfch = gelu_backward(...)), so matmul_backward need not read dx again.
 * *_gout_kernel_* (both backward kernels): also gout = gelu(x), the
 *   bits gelu_forward writes -- the GELU output a model that does not keep it
 *   needs again in the backward (fcproj's weight gradient), made from the x
 *   this pass reads anyway instead of by a gelu_forward pass of its own.
 *   dx is viewed as (N, C), C = last dimension. The sums are of dx AS STORED
 *   (rounded to T: what a later column-sum kernel would read), in float32,
 *   deterministic, no atomics: stage 1 of matmul.cu's two-stage column sum,
 *   done here. Grid = (column strips of 32 packs, row chunks of
 *   rows_per_chunk); thread (lane, w) owns one 16-byte pack of columns and the
 *   rows row0 + w, row0 + w + DB_WARPS, ... of its chunk, each summed in row
 *   order; the DB_WARPS per-warp sums are then added in warp order (shared
 *   memory) into partials (chunks, C). The Python side picks rows_per_chunk
 *   from N alone and calls colsum.cu's stage 2 (ops.colsum.reduce_partials: chunks in
 *   order), so the same input gives the same bits. Needs C % pack == 0 and
 *   16-byte aligned pointers (the Python side falls back otherwise). Each
 *   element is still read and written by one thread, loads before the store:
 *   dx may alias dout.
 */
#include "common.cuh"
#include "gelu_math.cuh"

#define UNROLL 4

// One pack of results rounded to T: bf16 pairs by the hardware conversion (cvt.rn.bf16x2, as
// float_to_bf16 for every non-NaN value; a NaN becomes 0x7fff, a quiet NaN like the canonical one),
// one instruction per pair where float_to_bf16 takes ~8 per value; float as is.
template <typename T>
__device__ __forceinline__ Pack16<T> round_pack(const float (&f)[Pack16<T>::size]) {
    Pack16<T> r;
    if constexpr (sizeof(T) == 2) {
        u32* w = reinterpret_cast<u32*>(&r);
        #pragma unroll
        for (int i = 0; i < 4; i++) w[i] = cvt_rn_bf16x2(f[2 * i], f[2 * i + 1]);
    } else {
        #pragma unroll
        for (int k = 0; k < Pack16<T>::size; k++) r.v[k] = f[k];
    }
    return r;
}

template <typename T>
__device__ void gelu_forward(T* out, const T* x, int n) {   // (n,) (n,); out may alias x
    constexpr int P = Pack16<T>::size;
    const int base = blockIdx.x * blockDim.x * UNROLL + threadIdx.x;   // in packs
    if (is_aligned16(out) && is_aligned16(x) && (base + (UNROLL - 1) * (int)blockDim.x + 1) * P <= n) {
        Pack16<T> v[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; u++) v[u] = load16_cs(x + (base + u * blockDim.x) * P);
        #pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            float f[P];
            #pragma unroll
            for (int k = 0; k < P; k++) f[k] = gelu_f<sizeof(T) == 4>(to_float(v[u].v[k]));
            store16(out + (base + u * blockDim.x) * P, round_pack<T>(f));
        }
        return;
    }
    for (int u = 0; u < UNROLL; u++)
        for (int k = 0; k < P; k++) {
            const int i = (base + u * blockDim.x) * P + k;
            if (i < n) out[i] = from_float<T>(gelu_f<sizeof(T) == 4>(to_float(x[i])));
        }
}

// GELU of one pack of x, rounded as gelu_forward rounds it, stored to gout.
template <typename T>
__device__ __forceinline__ void store_gelu_pack(T* gout, const Pack16<T>& v) {
    constexpr int P = Pack16<T>::size;
    float f[P];
    #pragma unroll
    for (int k = 0; k < P; k++) f[k] = gelu_f<sizeof(T) == 4>(to_float(v.v[k]));
    store16(gout, round_pack<T>(f));
}

template <typename T, bool GOUT>
__device__ void gelu_backward(T* dx, T* gout, const T* dout, const T* x, int n) {   // (n,) x4 (gout: GOUT only)
    constexpr int P = Pack16<T>::size;
    const int base = blockIdx.x * blockDim.x * UNROLL + threadIdx.x;   // in packs
    if (is_aligned16(dx) && is_aligned16(dout) && is_aligned16(x) && (!GOUT || is_aligned16(gout)) &&
        (base + (UNROLL - 1) * (int)blockDim.x + 1) * P <= n) {
        Pack16<T> g[UNROLL], v[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            g[u] = load16_cs(dout + (base + u * blockDim.x) * P);
            v[u] = load16_cs(x + (base + u * blockDim.x) * P);
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            float f[P];
            #pragma unroll
            for (int k = 0; k < P; k++) f[k] = gelu_grad_f<sizeof(T) == 4>(to_float(v[u].v[k]), to_float(g[u].v[k]));
            store16(dx + (base + u * blockDim.x) * P, round_pack<T>(f));
            if constexpr (GOUT) store_gelu_pack(gout + (base + u * blockDim.x) * P, v[u]);
        }
        return;
    }
    for (int u = 0; u < UNROLL; u++)
        for (int k = 0; k < P; k++) {
            const int i = (base + u * blockDim.x) * P + k;
            if (i < n) {
                const float xi = to_float(x[i]);
                dx[i] = from_float<T>(gelu_grad_f<sizeof(T) == 4>(xi, to_float(dout[i])));
                if constexpr (GOUT) gout[i] = from_float<T>(gelu_f<sizeof(T) == 4>(xi));
            }
        }
}

// Column sums fused (see the header). blockDim = (32, DB_WARPS); DB_UNROLL rows
// per thread have their loads in flight at once (the loads cannot move above
// the previous rows' stores: dx may alias dout). dx's bits are gelu_backward's:
// the same gelu_grad_f and rounding. __fadd_rn: the compiler must not contract
// the float32 sum with the product that makes dx (an fma would add the
// unrounded value, not the stored one).
#define DB_WARPS 8
#define DB_UNROLL 4

template <typename T, bool GOUT>
__device__ void gelu_backward_dbias(T* dx, T* gout, float* partials,   // (N, C) (N, C): GOUT only (chunks, C)
                                    const T* dout, const T* x,         // (N, C) (N, C)
                                    int N, int C, int rows_per_chunk) {
    constexpr int P = Pack16<T>::size;
    __shared__ float smem[DB_WARPS][32 * P];
    const int lane = threadIdx.x, w = threadIdx.y;
    const int col0 = (blockIdx.x * 32 + lane) * P;
    const int row0 = blockIdx.y * rows_per_chunk;
    const int row1 = min(N, row0 + rows_per_chunk);
    float acc[P];
    #pragma unroll
    for (int k = 0; k < P; k++) acc[k] = 0.0f;
    if (col0 < C) {
        for (int r0 = row0 + w; r0 < row1; r0 += DB_UNROLL * DB_WARPS) {
            Pack16<T> g[DB_UNROLL], v[DB_UNROLL];
            #pragma unroll
            for (int u = 0; u < DB_UNROLL; u++) {
                const int r = r0 + u * DB_WARPS;
                if (r < row1) {
                    const size_t off = (size_t)r * C + col0;
                    g[u] = load16_cs(dout + off);
                    v[u] = load16_cs(x + off);
                }
            }
            #pragma unroll
            for (int u = 0; u < DB_UNROLL; u++) {
                const int r = r0 + u * DB_WARPS;
                if (r < row1) {
                    float f[P];
                    #pragma unroll
                    for (int k = 0; k < P; k++) f[k] = gelu_grad_f<sizeof(T) == 4>(to_float(v[u].v[k]), to_float(g[u].v[k]));
                    const Pack16<T> d = round_pack<T>(f);
                    #pragma unroll
                    for (int k = 0; k < P; k++) acc[k] = __fadd_rn(acc[k], to_float(d.v[k]));
                    store16(dx + (size_t)r * C + col0, d);
                    if constexpr (GOUT) store_gelu_pack(gout + (size_t)r * C + col0, v[u]);
                }
            }
        }
    }
    // Every thread reaches the barrier (no early return above).
    #pragma unroll
    for (int k = 0; k < P; k++) smem[w][lane * P + k] = acc[k];
    __syncthreads();
    for (int c = w * 32 + lane; c < 32 * P; c += 32 * DB_WARPS) {
        const int col = blockIdx.x * 32 * P + c;
        if (col >= C) continue;
        float s = 0.0f;
        #pragma unroll
        for (int j = 0; j < DB_WARPS; j++) s = __fadd_rn(s, smem[j][c]);
        partials[(size_t)blockIdx.y * C + col] = s;
    }
}

extern "C" __global__ void gelu_forward_kernel_f32(float* out, const float* x, int n) {
    gelu_forward(out, x, n);
}
extern "C" __global__ void gelu_forward_kernel_bf16(bf16* out, const bf16* x, int n) {
    gelu_forward(out, x, n);
}
// The plain kernels and the _gout ones (gelu(x) written too): a template flag, so the plain ones
// keep their registers (a runtime null test took gelu_backward_dbias_kernel_bf16 from 64 to 77).
extern "C" __global__ void gelu_backward_kernel_f32(float* dx, const float* dout, const float* x, int n) {
    gelu_backward<float, false>(dx, nullptr, dout, x, n);
}
extern "C" __global__ void gelu_backward_kernel_bf16(bf16* dx, const bf16* dout, const bf16* x, int n) {
    gelu_backward<bf16, false>(dx, nullptr, dout, x, n);
}
extern "C" __global__ void gelu_backward_gout_kernel_f32(float* dx, float* gout, const float* dout, const float* x, int n) {
    gelu_backward<float, true>(dx, gout, dout, x, n);
}
extern "C" __global__ void gelu_backward_gout_kernel_bf16(bf16* dx, bf16* gout, const bf16* dout, const bf16* x, int n) {
    gelu_backward<bf16, true>(dx, gout, dout, x, n);
}
extern "C" __global__ void __launch_bounds__(32 * DB_WARPS) gelu_backward_dbias_kernel_f32(
        float* dx, float* partials, const float* dout, const float* x, int N, int C, int rows_per_chunk) {
    gelu_backward_dbias<float, false>(dx, nullptr, partials, dout, x, N, C, rows_per_chunk);
}
extern "C" __global__ void __launch_bounds__(32 * DB_WARPS) gelu_backward_dbias_kernel_bf16(
        bf16* dx, float* partials, const bf16* dout, const bf16* x, int N, int C, int rows_per_chunk) {
    gelu_backward_dbias<bf16, false>(dx, nullptr, partials, dout, x, N, C, rows_per_chunk);
}
extern "C" __global__ void __launch_bounds__(32 * DB_WARPS) gelu_backward_dbias_gout_kernel_f32(
        float* dx, float* gout, float* partials, const float* dout, const float* x, int N, int C, int rows_per_chunk) {
    gelu_backward_dbias<float, true>(dx, gout, partials, dout, x, N, C, rows_per_chunk);
}
extern "C" __global__ void __launch_bounds__(32 * DB_WARPS) gelu_backward_dbias_gout_kernel_bf16(
        bf16* dx, bf16* gout, float* partials, const bf16* dout, const bf16* x, int N, int C, int rows_per_chunk) {
    gelu_backward_dbias<bf16, true>(dx, gout, partials, dout, x, N, C, rows_per_chunk);
}
