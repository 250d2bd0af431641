/*
 * softmax.cu -- row-wise softmax over the last axis, forward and backward.
 *
 * Math (fp32 accumulation whatever T is, one rounding to T at the end):
 *   forward:  y[r, j]  = exp(x[r, j] - max_r) / sum_k exp(x[r, k] - max_r)
 *   backward: dx[r, j] = y[r, j] * (dout[r, j] - sum_k dout[r, k] * y[r, k])
 * Shapes: x, y, dout, dx are (rows, C), leading dims flattened to rows.
 * Gradient rule: dx is an activation gradient, overwritten (=). dx may alias
 * dout or y, and y may alias x: every element is read (by the thread that
 * writes it) before it is written, and writes follow the row's reductions.
 *
 * Two versions:
 *   v1 (any C, any alignment): one block per row. Pass 1 runs an online
 *      max/sum (rescale the running sum when the max grows, once per 16-byte
 *      pack), pass 2 reads the row again -- from L1/L2, the row was just
 *      read -- and writes. Used for long rows (C > 32*8 packs) and for rows
 *      that are not a whole number of 16-byte packs or not 16-byte aligned.
 *   v2 (C a multiple of the pack, 16-byte aligned, C/P <= 32*K): one warp per
 *      row; the whole row sits in the warp's registers (K packs per lane), so
 *      the input is read from memory exactly once and only shuffles reduce.
 *      K in {1, 2, 4, 8}; the launcher picks the smallest that fits.
 *   v3 (forward only; same layout and conditions as v2): v2's forward was
 *      issue-bound, not memory-bound -- about 37 instructions per element
 *      (__expf without -use_fast_math carries a denormal fix-up around its
 *      MUFU.EX2, float_to_bf16 is ~8 integer ops, the Pack16<bf16> struct is
 *      unpacked 16 bits at a time, exp computed twice). v3 keeps the row as
 *      raw 32-bit words, computes exp once (kept in fp32 registers), uses
 *      ex2.approx.ftz directly and the hardware RNE bf16x2 conversion: about
 *      7 instructions + 1 MUFU per element. A row containing NaN/inf (its sum
 *      is NaN) takes the exact conversion so its NaN bits match float_to_bf16.
 *      The backward's v3 is v2 (memory-bound at 89% of copy already).
 * Determinism: fixed element-to-thread mapping and fixed reduction trees.
 */
#include "common.cuh"
#include "fast_packs.cuh"

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// Online max/sum, one (m, s) pair per thread: s = sum exp(v - m) over the
// values seen so far, m their max. `pm` is the max of the next values; the
// running sum is rescaled only when the max grows (once per pack, not per
// element). A NaN poisons both, as it poisons numpy's result.
__device__ __forceinline__ void online_rescale(float& m, float& s, float pm) {
    if (pm > m) {
        s *= __expf(m - pm);                         // m = -inf: s is 0 and exp(-inf) = 0
        m = pm;
    } else if (pm != pm) {
        m = pm;
        s = pm;
    }
}

// Add exp(v - m) for values already merged into m. While m is -inf every
// value seen is -inf (a fully masked stretch) and adds 0, not exp(-inf + inf).
__device__ __forceinline__ float online_term(float v, float m) {
    return (m == neg_inf()) ? 0.0f : __expf(v - m);
}

// Combine per-thread (m, s) into the row's (max, sum) over the block.
__device__ __forceinline__ void block_online_reduce(float& m, float& s, float* scratch) {
    const float row_max = block_reduce<MaxOp>(m, scratch);
    s = (m == neg_inf()) ? 0.0f : s * __expf(m - row_max);
    s = block_reduce<SumOp>(s, scratch);
    m = row_max;
}

// ---------------------------------------------------------------- v1 ---------

template <typename T>
__device__ void softmax_forward_v1(T* out, const T* x, int rows, int C) {   // (rows, C) (rows, C)
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const T* xr = x + (size_t)row * C;
    T* yr = out + (size_t)row * C;
    constexpr int P = Pack16<T>::size;
    const bool vec = (C % P == 0) && is_aligned16(x) && is_aligned16(out);
    float m = neg_inf(), s = 0.0f;
    if (vec) {
        for (int i = threadIdx.x; i < C / P; i += blockDim.x) {
            Pack16<T> p = load16(xr + i * P);          // default caching: pass 2 re-reads it
            float pm = neg_inf();
            #pragma unroll
            for (int k = 0; k < P; k++) pm = MaxOp::combine(pm, to_float(p.v[k]));
            online_rescale(m, s, pm);
            #pragma unroll
            for (int k = 0; k < P; k++) s += online_term(to_float(p.v[k]), m);
        }
    } else {
        for (int i = threadIdx.x; i < C; i += blockDim.x) {
            const float v = to_float(xr[i]);
            online_rescale(m, s, v);
            s += online_term(v, m);
        }
    }
    block_online_reduce(m, s, scratch);
    const float inv = 1.0f / s;
    if (vec) {
        for (int i = threadIdx.x; i < C / P; i += blockDim.x) {
            Pack16<T> p = load16_cs(xr + i * P), q;   // last use
            #pragma unroll
            for (int k = 0; k < P; k++) q.v[k] = from_float<T>(__expf(to_float(p.v[k]) - m) * inv);
            store16(yr + i * P, q);
        }
    } else {
        for (int i = threadIdx.x; i < C; i += blockDim.x)
            yr[i] = from_float<T>(__expf(to_float(xr[i]) - m) * inv);
    }
}

template <typename T>
__device__ void softmax_backward_v1(T* dx, const T* dout, const T* y, int rows, int C) {   // (rows, C) x3
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const size_t off = (size_t)row * C;
    constexpr int P = Pack16<T>::size;
    const bool vec = (C % P == 0) && is_aligned16(dx) && is_aligned16(dout) && is_aligned16(y);
    float dot = 0.0f;
    if (vec) {
        for (int i = threadIdx.x; i < C / P; i += blockDim.x) {
            Pack16<T> d = load16(dout + off + i * P), p = load16(y + off + i * P);
            #pragma unroll
            for (int k = 0; k < P; k++) dot += to_float(d.v[k]) * to_float(p.v[k]);
        }
    } else {
        for (int i = threadIdx.x; i < C; i += blockDim.x) dot += to_float(dout[off + i]) * to_float(y[off + i]);
    }
    dot = block_reduce<SumOp>(dot, scratch);   // its barriers also order pass 1's reads before pass 2's writes
    if (vec) {
        for (int i = threadIdx.x; i < C / P; i += blockDim.x) {
            Pack16<T> d = load16_cs(dout + off + i * P), p = load16_cs(y + off + i * P), q;
            #pragma unroll
            for (int k = 0; k < P; k++)
                q.v[k] = from_float<T>(to_float(p.v[k]) * (to_float(d.v[k]) - dot));
            store16(dx + off + i * P, q);
        }
    } else {
        for (int i = threadIdx.x; i < C; i += blockDim.x)
            dx[off + i] = from_float<T>(to_float(y[off + i]) * (to_float(dout[off + i]) - dot));
    }
}

// ---------------------------------------------------------------- v2 ---------
// One warp per row, lane l holds packs l, l+32, ..., l+32*(K-1) (coalesced).

template <typename T, int K>
__device__ void softmax_forward_v2(T* out, const T* x, int rows, int C) {   // (rows, C) (rows, C)
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;                        // whole warps exit: no block barrier below
    constexpr int P = Pack16<T>::size;
    const int n_packs = C / P;
    const T* xr = x + (size_t)row * C;
    Pack16<T> buf[K];
    #pragma unroll
    for (int k = 0; k < K; k++) {                   // all loads in flight before any use
        const int i = lane + 32 * k;
        if (i < n_packs) buf[k] = load16_cs(xr + i * P);
    }
    float m = neg_inf();
    #pragma unroll
    for (int k = 0; k < K; k++)
        if (lane + 32 * k < n_packs)
            #pragma unroll
            for (int e = 0; e < P; e++) m = MaxOp::combine(m, to_float(buf[k].v[e]));
    m = warp_max(m);
    float s = 0.0f;
    #pragma unroll
    for (int k = 0; k < K; k++)
        if (lane + 32 * k < n_packs)
            #pragma unroll
            for (int e = 0; e < P; e++) s += __expf(to_float(buf[k].v[e]) - m);
    const float inv = 1.0f / warp_sum(s);
    T* yr = out + (size_t)row * C;
    #pragma unroll
    for (int k = 0; k < K; k++) {
        const int i = lane + 32 * k;
        if (i < n_packs) {
            Pack16<T> q;
            #pragma unroll
            for (int e = 0; e < P; e++) q.v[e] = from_float<T>(__expf(to_float(buf[k].v[e]) - m) * inv);
            store16(yr + i * P, q);
        }
    }
}

template <typename T, int K>
__device__ void softmax_backward_v2(T* dx, const T* dout, const T* y, int rows, int C) {   // (rows, C) x3
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    constexpr int P = Pack16<T>::size;
    const int n_packs = C / P;
    const size_t off = (size_t)row * C;
    Pack16<T> d[K], p[K];
    #pragma unroll
    for (int k = 0; k < K; k++) {
        const int i = lane + 32 * k;
        if (i < n_packs) {
            d[k] = load16_cs(dout + off + i * P);
            p[k] = load16_cs(y + off + i * P);
        }
    }
    float dot = 0.0f;
    #pragma unroll
    for (int k = 0; k < K; k++)
        if (lane + 32 * k < n_packs)
            #pragma unroll
            for (int e = 0; e < P; e++) dot += to_float(d[k].v[e]) * to_float(p[k].v[e]);
    dot = warp_sum(dot);
    #pragma unroll
    for (int k = 0; k < K; k++) {
        const int i = lane + 32 * k;
        if (i < n_packs) {
            Pack16<T> q;
            #pragma unroll
            for (int e = 0; e < P; e++) q.v[e] = from_float<T>(to_float(p[k].v[e]) * (to_float(d[k].v[e]) - dot));
            store16(dx + off + i * P, q);
        }
    }
}

// ---------------------------------------------------------------- v3 ---------
// Raw packs, ex2_ftz and the bf16x2 conversion come from fast_packs.cuh.

template <typename T, int K>
__device__ void softmax_forward_v3(T* out, const T* x, int rows, int C) {   // (rows, C) (rows, C)
    using R = Raw<T>;
    constexpr int P = R::P;
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;                        // whole warps exit: no block barrier below
    const int n_packs = C / P;
    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)row * C);
    uint4 raw[K];
    #pragma unroll
    for (int k = 0; k < K; k++) {                   // all loads in flight before any use
        const int i = lane + 32 * k;
        if (i < n_packs) raw[k] = __ldcs(xr + i);
    }
    // fmaxf ignores NaN; a NaN (or +inf, or an all -inf row) still reaches
    // every output through the sum below, as it does in numpy.
    float v[K][P];
    float m = neg_inf();
    #pragma unroll
    for (int k = 0; k < K; k++)
        if (lane + 32 * k < n_packs) {
            R::unpack(raw[k], v[k]);
            #pragma unroll
            for (int e = 0; e < P; e++) m = fmaxf(m, v[k][e]);
        }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float s = 0.0f;
    #pragma unroll
    for (int k = 0; k < K; k++)
        if (lane + 32 * k < n_packs)
            #pragma unroll
            for (int e = 0; e < P; e++) {
                v[k][e] = ex2_ftz((v[k][e] - m) * LOG2E);   // subtract first: exact near the max
                s += v[k][e];
            }
    s = warp_sum(s);
    const float inv = 1.0f / s;
    const bool exact = s != s;                      // warp-uniform
    uint4* yr = reinterpret_cast<uint4*>(out + (size_t)row * C);
    #pragma unroll
    for (int k = 0; k < K; k++) {
        const int i = lane + 32 * k;
        if (i < n_packs) {
            #pragma unroll
            for (int e = 0; e < P; e++) v[k][e] *= inv;
            yr[i] = exact ? R::pack_exact(v[k]) : R::pack_fast(v[k]);
        }
    }
}

// ------------------------------------------------------------ extern "C" -----

#define SOFTMAX_V1(T, SUF)                                                                          \
    extern "C" __global__ void softmax_forward_kernel_v1_##SUF(T* out, const T* x, int rows, int C) { \
        softmax_forward_v1<T>(out, x, rows, C);                                                     \
    }                                                                                               \
    extern "C" __global__ void softmax_backward_kernel_v1_##SUF(T* dx, const T* dout, const T* y,   \
                                                                int rows, int C) {                  \
        softmax_backward_v1<T>(dx, dout, y, rows, C);                                               \
    }

// v2 names carry K (packs per lane): softmax_forward_kernel_v2_k4_bf16, ...
#define SOFTMAX_V2(T, SUF, K)                                                                       \
    extern "C" __global__ void softmax_forward_kernel_v2_k##K##_##SUF(T* out, const T* x, int rows, int C) { \
        softmax_forward_v2<T, K>(out, x, rows, C);                                                  \
    }                                                                                               \
    extern "C" __global__ void softmax_backward_kernel_v2_k##K##_##SUF(T* dx, const T* dout, const T* y, \
                                                                       int rows, int C) {           \
        softmax_backward_v2<T, K>(dx, dout, y, rows, C);                                            \
    }

SOFTMAX_V1(float, f32)
SOFTMAX_V1(bf16, bf16)
SOFTMAX_V2(float, f32, 1)
SOFTMAX_V2(float, f32, 2)
SOFTMAX_V2(float, f32, 4)
SOFTMAX_V2(float, f32, 8)
SOFTMAX_V2(bf16, bf16, 1)
SOFTMAX_V2(bf16, bf16, 2)
SOFTMAX_V2(bf16, bf16, 4)
SOFTMAX_V2(bf16, bf16, 8)

// v3: the forward only (the backward's v3 is v2's kernel).
#define SOFTMAX_V3(T, SUF, K)                                                                       \
    extern "C" __global__ void softmax_forward_kernel_v3_k##K##_##SUF(T* out, const T* x, int rows, int C) { \
        softmax_forward_v3<T, K>(out, x, rows, C);                                                  \
    }

SOFTMAX_V3(float, f32, 1)
SOFTMAX_V3(float, f32, 2)
SOFTMAX_V3(float, f32, 4)
SOFTMAX_V3(float, f32, 8)
SOFTMAX_V3(bf16, bf16, 1)
SOFTMAX_V3(bf16, bf16, 2)
SOFTMAX_V3(bf16, bf16, 4)
SOFTMAX_V3(bf16, bf16, 8)
