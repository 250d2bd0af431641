/*
 * matmul.cu -- the small kernel around the cuBLAS matmuls of the training path.
 *
 * The GEMMs themselves are cuBLAS / cuBLASLt (gpucore/cublas.py, gpucore/ops/matmul.py);
 * the GEMM ladder we write ourselves lives in ladder/gemm/ (v1-v6, lessons, not training).
 *
 * Linear layer:  out (N, M) = x (N, K) @ weight (M, K)^T + bias (M,)
 *   d x      = dout @ weight                      [=]   (cuBLAS)
 *   d weight += dout^T @ x                        [+=]  (cuBLAS, beta = 1)
 *   d bias   += sum over rows of dout             [+=]  (colsum.cu)
 *
 * matmul_bias_fill_kernel_*: out[r, c] = bias[c], so that the GEMM that
 *   follows with beta = 1 adds x @ W^T on top (the bias lands in cuBLAS'
 *   epilogue: one rounding, and only one extra pass -- a pure write -- over
 *   out instead of the read + write of a separate bias-add kernel). Used only
 *   where cuBLASLt's bias epilogue cannot run (no cuBLASLt, a bf16 bias into a
 *   float32 out).
 */
#include "common.cuh"

// out (N, M) = broadcast bias (M,), converted to out's type. blockDim = (32, 8),
// grid = (column strips of 32 * V, row groups): thread (lane, w) keeps its V
// bias values in registers and writes them down rows w, w + 8*gridDim.y, ...
// (no per-element index division). V = 16-byte pack when the types agree, M is
// a multiple of the pack and the pointers are aligned (the GPT-2 shapes), else 1.
template <typename T, typename Tb, int V>
__device__ void bias_fill(T* out, const Tb* bias, int N, int M) {   // (N, M) (M,)
    const int col0 = (blockIdx.x * 32 + threadIdx.x) * V;
    if (col0 >= M) return;
    Pack16<T> b;
    #pragma unroll
    for (int v = 0; v < V; v++) b.v[v] = from_float<T>(to_float(bias[col0 + v]));
    const int row_step = gridDim.y * blockDim.y;
    for (int r = blockIdx.y * blockDim.y + threadIdx.y; r < N; r += row_step) {
        T* p = out + (size_t)r * M + col0;
        if constexpr (V > 1) store16(p, b);
        else p[0] = b.v[0];
    }
}

// matmul_bias_fill_kernel_<vec|scalar>_<out>_<bias>: same-type fills, and a bf16
// bias into a float32 out (scalar only).
#define BIAS_FILL(T, Tb, V, SUF)                                                                  \
    extern "C" __global__ void matmul_bias_fill_kernel_##SUF(T* out, const Tb* bias, int N, int M) { \
        bias_fill<T, Tb, V>(out, bias, N, M);                                                     \
    }
BIAS_FILL(float, float, 4, vec_f32_f32)
BIAS_FILL(bf16, bf16, 8, vec_bf16_bf16)
BIAS_FILL(float, float, 1, scalar_f32_f32)
BIAS_FILL(bf16, bf16, 1, scalar_bf16_bf16)
BIAS_FILL(float, bf16, 1, scalar_f32_bf16)
