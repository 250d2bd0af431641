/*
 * colsum.cu -- deterministic column sums: the bias gradient of a linear layer.
 *
 * Math:   dbias (M,) += sum over rows r of dout[r, :]   (dout (N, M); parameter grad: +=)
 *         float32 accumulation whatever the dtypes; one rounding into dbias.
 * Two stages, no atomics:
 *   colsum_stage1_kernel_<vec|scalar>_<dout>: grid (column strips, row chunks); every block
 *     sums ITS rows of ITS columns in a fixed order into one float partial per column:
 *     partials (chunks, M). The chunk count depends only on N (the Python side picks it),
 *     so the same input gives the same bits.
 *   colsum_stage2_kernel_<dbias>: STAGE2_WARPS warps per 32 columns add the chunks in
 *     common.cuh's stage-2 order (warp w: chunks w, w + 32, ...; then the warps in order)
 *     and do dbias += sum.
 * Stage 2 is shared: the gelu and layernorm backward kernels that write a matmul's dout
 * also write per-chunk partials of its column sums (fused bias gradients), then call it.
 */
#include "common.cuh"

#define BB_ROWS 8        // warps per stage-1 block: each warp walks every 8th row

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
    const float s = stage2_column_sum(partials, chunks, (size_t)M, M);
    const int col = blockIdx.x * 32 + threadIdx.x;
    if (threadIdx.x < 32 && col < M) dbias[col] = from_float<Tout>(to_float(dbias[col]) + s);
}

// _vec: 16-byte packs (needs M % pack == 0 and an aligned dout); _scalar: any layout.
#define BIAS_BWD1(T, SUF)                                                                         \
    extern "C" __global__ void colsum_stage1_kernel_vec_##SUF(                      \
            float* partials, const T* dout, int N, int M, int rows_per_chunk) {                   \
        bias_backward_stage1<T, Pack16<T>::size>(partials, dout, N, M, rows_per_chunk);           \
    }                                                                                             \
    extern "C" __global__ void colsum_stage1_kernel_scalar_##SUF(                   \
            float* partials, const T* dout, int N, int M, int rows_per_chunk) {                   \
        bias_backward_stage1<T, 1>(partials, dout, N, M, rows_per_chunk);                         \
    }
BIAS_BWD1(float, f32)
BIAS_BWD1(bf16, bf16)

#define BIAS_BWD2(Tout, SUF)                                                                      \
    extern "C" __global__ void __launch_bounds__(STAGE2_WARPS * 32) colsum_stage2_kernel_##SUF(   \
            Tout* dbias, const float* partials, int M, int chunks) {                              \
        bias_backward_stage2<Tout>(dbias, partials, M, chunks);                                   \
    }
BIAS_BWD2(float, f32)
BIAS_BWD2(bf16, bf16)
