/*
 * attention/classic.cu -- the classic (v1) attention helpers: permute / unpermute and the
 * softmax over the stored (B, NH, T, T) score matrix, forward and backward.
 *
 * v1 is llm.c's attention_forward/backward: the matmuls run on cuBLAS
 * (gpucore.ops.matmul.batched_matmul); these kernels do the rest.
 *   permute    out (S, B, NH, T, HD) <- in (B, T, stride):
 *              out[s,b,h,t,d] = in[b, t, offset + s*C + h*HD + d]
 *              (qkv (B, T, 3C) -> q, k, v with S = 3; dout (B, T, C) -> (B, NH, T, HD) with S = 1)
 *   unpermute  out (B, T, stride) <- in (S, B, NH, T, HD): the inverse write
 *              (y -> out (B, T, C); dq, dk, dv -> dqkv (B, T, 3C), written [=];
 *              offset packs separate q, k, v into one qkv for gpucore.attention)
 *   softmax forward, one row (b, h, i) of preatt (already scaled by 1/sqrt(HD)):
 *     att_ij = exp(preatt_ij - max) / sum   for j <= i (causal) or all j, else 0
 *     lse_i  = max + log(sum)
 *   softmax backward (activation gradient, [=]):
 *     dpreatt_ij = att_ij * (datt_ij - sum_k att_ik datt_ik)   (0 where att is masked)
 * Shapes: preatt, datt (B*NH, T, T) float32; att, dpreatt (B*NH, T, T) of the input
 * dtype (float32 or bf16: it feeds the next cuBLAS matmul), lse (B, NH, T) float32.
 * In place is allowed (att may alias preatt in fp32; dpreatt may alias att or datt):
 * each element is read and then written by the same thread, after the row's
 * reductions, so no pointer here is __restrict__.
 * One warp per row; the order of every sum is fixed (deterministic).
 */
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void permute(T* out,          // (S, B, NH, T, HD)
                                        const T* in,     // (B, T, stride), head columns at offset + s*C + h*HD
                                        int S, int B, int Tn, int NH, int HD, int stride, int offset) {
    const int C = NH * HD;
    const int n = S * B * NH * Tn * HD;
    for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += gridDim.x * blockDim.x) {
        int r = idx;
        const int d = r % HD; r /= HD;
        const int t = r % Tn; r /= Tn;
        const int h = r % NH; r /= NH;
        const int b = r % B;
        const int s = r / B;
        out[idx] = in[((size_t)b * Tn + t) * stride + offset + s * C + h * HD + d];
    }
}

template <typename T>
__device__ __forceinline__ void unpermute(T* out,        // (B, T, stride), head columns at offset + s*C + h*HD
                                          const T* in,   // (S, B, NH, T, HD)
                                          int S, int B, int Tn, int NH, int HD, int stride, int offset) {
    const int C = NH * HD;
    const int n = S * B * NH * Tn * HD;
    for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += gridDim.x * blockDim.x) {
        // Walk the output's order so the stores are coalesced: idx = ((b*T + t)*S + s)*C + h*HD + d.
        int r = idx;
        const int d = r % HD; r /= HD;
        const int h = r % NH; r /= NH;
        const int s = r % S; r /= S;
        const int t = r % Tn;
        const int b = r / Tn;
        out[((size_t)b * Tn + t) * stride + offset + s * C + h * HD + d] =
            in[((((size_t)s * B + b) * NH + h) * Tn + t) * HD + d];
    }
}

template <typename Tatt>
__device__ __forceinline__ void softmax_forward(Tatt* att,            // (B*NH, T, T)
                                                float* lse,           // (B*NH, T)
                                                const float* preatt,  // (B*NH, T, T)
                                                int rows, int Tn, int causal) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int i = row % Tn;
    const int n = causal ? i + 1 : Tn;           // columns that take part
    const float* x = preatt + (size_t)row * Tn;
    Tatt* y = att + (size_t)row * Tn;
    float mx = -__int_as_float(0x7f800000);
    for (int j = lane; j < n; j += 32) mx = fmaxf(mx, x[j]);
    mx = warp_max(mx);
    float sum = 0.f;
    for (int j = lane; j < n; j += 32) sum += expf(x[j] - mx);
    sum = warp_sum(sum);
    const float inv = 1.f / sum;
    for (int j = lane; j < Tn; j += 32) y[j] = from_float<Tatt>(j < n ? expf(x[j] - mx) * inv : 0.f);
    if (lane == 0) lse[row] = mx + logf(sum);
}

template <typename Tatt>
__device__ __forceinline__ void softmax_backward(Tatt* dpreatt,       // (B*NH, T, T)
                                                 const Tatt* att,     // (B*NH, T, T)
                                                 const float* datt,   // (B*NH, T, T)
                                                 int rows, int Tn, int causal) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int i = row % Tn;
    const int n = causal ? i + 1 : Tn;
    const Tatt* a = att + (size_t)row * Tn;
    const float* da = datt + (size_t)row * Tn;
    Tatt* dp = dpreatt + (size_t)row * Tn;
    float dot = 0.f;
    for (int j = lane; j < n; j += 32) dot += to_float(a[j]) * da[j];
    dot = warp_sum(dot);
    for (int j = lane; j < Tn; j += 32)
        dp[j] = from_float<Tatt>(j < n ? to_float(a[j]) * (da[j] - dot) : 0.f);
}

#define ATTENTION_V1_KERNELS(T, SUF)                                                               \
    extern "C" __global__ void attention_permute_kernel_v1_##SUF(                                  \
            T* out, const T* in, int S, int B, int Tn, int NH, int HD, int stride, int offset) {   \
        permute<T>(out, in, S, B, Tn, NH, HD, stride, offset);                                     \
    }                                                                                              \
    extern "C" __global__ void attention_unpermute_kernel_v1_##SUF(                                \
            T* out, const T* in, int S, int B, int Tn, int NH, int HD, int stride, int offset) {   \
        unpermute<T>(out, in, S, B, Tn, NH, HD, stride, offset);                                   \
    }                                                                                              \
    extern "C" __global__ void attention_softmax_forward_kernel_v1_##SUF(                          \
            T* att, float* lse, const float* preatt, int rows, int Tn, int causal) {               \
        softmax_forward<T>(att, lse, preatt, rows, Tn, causal);                                    \
    }                                                                                              \
    extern "C" __global__ void attention_softmax_backward_kernel_v1_##SUF(                         \
            T* dpreatt, const T* att, const float* datt, int rows, int Tn, int causal) {           \
        softmax_backward<T>(dpreatt, att, datt, rows, Tn, causal);                                 \
    }

ATTENTION_V1_KERNELS(float, f32)
ATTENTION_V1_KERNELS(bf16, bf16)
