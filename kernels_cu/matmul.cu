/*
 * matmul.cu -- the small kernels around the cuBLAS matmuls of the training path.
 *
 * The GEMMs themselves are cuBLAS (gpucore/ops/matmul.py); the GEMM ladder we
 * write ourselves lives in gemm_simt.cu (v1-v3), gemm_tc.cu (v4) and
 * gemm_tc2.cu (v4b, v4c).
 *
 * Linear layer:  out (N, M) = x (N, K) @ weight (M, K)^T + bias (M,)
 *   d x      = dout @ weight                      [=]   (cuBLAS)
 *   d weight += dout^T @ x                        [+=]  (cuBLAS, beta = 1)
 *   d bias   += sum over rows of dout             [+=]  (cuBLASLt epilogue + here)
 *
 * matmul_bias_fill_kernel_*: out[r, c] = bias[c], so that the GEMM that
 *   follows with beta = 1 adds x @ W^T on top (the bias lands in cuBLAS'
 *   epilogue: one rounding, and only one extra pass -- a pure write -- over
 *   out instead of the read + write of a separate bias-add kernel).
 *
 * matmul_bias_backward_stage{1,2}_kernel_*: column sums of dout,
 *   deterministic, no atomics. Stage 1: the grid is (column strips, row
 *   chunks); every block sums ITS rows of ITS columns in a fixed order into
 *   one float partial per column: partials (chunks, M). Stage 2: one thread
 *   per column adds the chunks in order 0..chunks-1 and does dbias += sum.
 *   The chunk count depends only on N (the Python side picks it), so the
 *   same input gives the same bits. Accumulation is float32 throughout.
 *   Used when cuBLASLt cannot fuse the bias gradient (see below).
 *
 * matmul_bias_accumulate_kernel_<dbias>_<scratch>: dbias += scratch. The
 *   training path's usual dbias: cuBLASLt's BGRADB epilogue computes the
 *   column sums of dout inside the dW GEMM (which reads dout anyway) but
 *   writes them, and the gradient rule is +=, so they land in a scratch
 *   vector that this one-pass kernel adds.
 */
#include "common.cuh"

#define BB_ROWS 8        // warps per stage-1 block: each warp walks every 8th row

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

// Stage 1. blockDim = (32, BB_ROWS). Thread (lane, w) owns V adjacent columns
// (V = 16-byte pack when the layout allows it, else 1) and the rows
// row0 + w, row0 + w + BB_ROWS, ... of this block's chunk.
template <typename T, int V>
__device__ void bias_backward_stage1(float* partials, const T* dout,   // (chunks, M) (N, M)
                                     int N, int M, int rows_per_chunk) {
    __shared__ float smem[BB_ROWS][32 * V + 1];
    const int lane = threadIdx.x, w = threadIdx.y;
    const int col0 = (blockIdx.x * 32 + lane) * V;
    const int row0 = blockIdx.y * rows_per_chunk;
    const int row1 = min(N, row0 + rows_per_chunk);
    float acc[V];
    #pragma unroll
    for (int v = 0; v < V; v++) acc[v] = 0.0f;
    if (col0 < M) {
        for (int r = row0 + w; r < row1; r += BB_ROWS) {
            const T* p = dout + (size_t)r * M + col0;
            if constexpr (V > 1) {
                Pack16<T> x = load16_cs(p);
                #pragma unroll
                for (int v = 0; v < V; v++) acc[v] += to_float(x.v[v]);
            } else {
                acc[0] += to_float(p[0]);
            }
        }
    }
    #pragma unroll
    for (int v = 0; v < V; v++) smem[w][lane * V + v] = acc[v];
    __syncthreads();
    // Fixed order: warp rows 0..BB_ROWS-1 for each column of the strip.
    for (int c = w * 32 + lane; c < 32 * V; c += 32 * BB_ROWS) {
        const int col = blockIdx.x * 32 * V + c;
        if (col >= M) continue;
        float s = 0.0f;
        #pragma unroll
        for (int k = 0; k < BB_ROWS; k++) s += smem[k][c];
        partials[(size_t)blockIdx.y * M + col] = s;
    }
}

template <typename Tout>
__device__ void bias_backward_stage2(Tout* dbias, const float* partials, int M, int chunks) {   // (M,) (chunks, M)
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= M) return;
    float s = 0.0f;
    for (int k = 0; k < chunks; k++) s += partials[(size_t)k * M + col];
    dbias[col] = from_float<Tout>(to_float(dbias[col]) + s);
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

// _vec: 16-byte packs (needs M % pack == 0 and an aligned dout); _scalar: any layout.
#define BIAS_BWD1(T, SUF)                                                                         \
    extern "C" __global__ void matmul_bias_backward_stage1_kernel_vec_##SUF(                      \
            float* partials, const T* dout, int N, int M, int rows_per_chunk) {                   \
        bias_backward_stage1<T, Pack16<T>::size>(partials, dout, N, M, rows_per_chunk);           \
    }                                                                                             \
    extern "C" __global__ void matmul_bias_backward_stage1_kernel_scalar_##SUF(                   \
            float* partials, const T* dout, int N, int M, int rows_per_chunk) {                   \
        bias_backward_stage1<T, 1>(partials, dout, N, M, rows_per_chunk);                         \
    }
BIAS_BWD1(float, f32)
BIAS_BWD1(bf16, bf16)

#define BIAS_BWD2(Tout, SUF)                                                                      \
    extern "C" __global__ void matmul_bias_backward_stage2_kernel_##SUF(                          \
            Tout* dbias, const float* partials, int M, int chunks) {                              \
        bias_backward_stage2<Tout>(dbias, partials, M, chunks);                                   \
    }
BIAS_BWD2(float, f32)
BIAS_BWD2(bf16, bf16)

// dbias (M,) += scratch (M,), one thread per element.
template <typename Tout, typename Ts>
__device__ void bias_accumulate(Tout* dbias, const Ts* scratch, int M) {   // (M,) (M,)
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < M) dbias[i] = from_float<Tout>(to_float(dbias[i]) + to_float(scratch[i]));
}

#define BIAS_ACC(Tout, Ts, SUF)                                                                   \
    extern "C" __global__ void matmul_bias_accumulate_kernel_##SUF(Tout* dbias, const Ts* scratch, int M) { \
        bias_accumulate<Tout, Ts>(dbias, scratch, M);                                             \
    }
BIAS_ACC(float, float, f32_f32)
BIAS_ACC(bf16, float, bf16_f32)
BIAS_ACC(bf16, bf16, bf16_bf16)
