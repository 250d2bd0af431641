/*
 * reduce.cu -- sum and max, over the whole array or over the last axis.
 *
 * Math: accumulate in float32 whatever the input dtype; the result is rounded
 * to the output dtype once at the end. max propagates NaN (as numpy.max).
 * Shapes: whole array: x (n,) -> partials (num_blocks,) -> out (1,)
 *         last axis:   x (rows, C) -> out (rows,)
 * Determinism: every thread visits a fixed set of elements in a fixed order,
 * and the shuffle/block trees are fixed, so the same input on the same GPU
 * with the same grid gives bitwise-identical results. No atomics.
 *
 * Whole array is two launches: stage 1 (a fixed grid, each block writes one
 * float partial), stage 2 (one block reduces the partials). Each stage-1 thread
 * keeps UNROLL independent 16-byte loads in flight to saturate HBM.
 */
#include "common.cuh"

#define UNROLL 4

template <typename Op, typename T>
__device__ void reduce_all_stage1(float* partials, const T* x, int n) {   // (gridDim.x,) (n,)
    __shared__ float scratch[32];
    constexpr int P = Pack16<T>::size;
    const int nthreads = gridDim.x * blockDim.x;
    const int tid = blockIdx.x * blockDim.x + threadIdx.x;
    float acc = Op::identity();
    int done = 0;
    if (is_aligned16(x)) {
        const int n_packs = n / P;
        // Main loop: UNROLL packs per thread per step, all loads issued before use.
        const int step = nthreads * UNROLL;
        int i = tid;
        for (; i + (UNROLL - 1) * nthreads < n_packs; i += step) {
            Pack16<T> p[UNROLL];
            #pragma unroll
            for (int u = 0; u < UNROLL; u++) p[u] = load16_cs(x + (i + u * nthreads) * P);
            #pragma unroll
            for (int u = 0; u < UNROLL; u++)
                #pragma unroll
                for (int k = 0; k < P; k++) acc = Op::combine(acc, to_float(p[u].v[k]));
        }
        for (; i < n_packs; i += nthreads) {
            Pack16<T> p = load16_cs(x + i * P);
            #pragma unroll
            for (int k = 0; k < P; k++) acc = Op::combine(acc, to_float(p.v[k]));
        }
        done = n_packs * P;
    }
    for (int i = done + tid; i < n; i += nthreads) acc = Op::combine(acc, to_float(x[i]));
    acc = block_reduce<Op>(acc, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

template <typename Op, typename T>
__device__ void reduce_all_stage2(T* out, const float* partials, int num_partials) {   // (1,) (num_partials,)
    __shared__ float scratch[32];
    float acc = Op::identity();
    for (int i = threadIdx.x; i < num_partials; i += blockDim.x) acc = Op::combine(acc, partials[i]);
    acc = block_reduce<Op>(acc, scratch);
    if (threadIdx.x == 0) out[0] = from_float<T>(acc);
}

// One warp per row: lanes stride over the row's 16-byte packs.
template <typename Op, typename T>
__device__ void reduce_lastdim(T* out, const T* x, int rows, int C) {   // (rows,) (rows, C)
    const int warps_per_block = blockDim.x / 32;
    const int row = blockIdx.x * warps_per_block + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const T* xr = x + (size_t)row * C;
    constexpr int P = Pack16<T>::size;
    float acc = Op::identity();
    int done = 0;
    if (C % P == 0 && is_aligned16(x)) {
        for (int i = lane; i < C / P; i += 32) {
            Pack16<T> p = load16_cs(xr + i * P);
            #pragma unroll
            for (int k = 0; k < P; k++) acc = Op::combine(acc, to_float(p.v[k]));
        }
        done = C;
    }
    for (int i = done + lane; i < C; i += 32) acc = Op::combine(acc, to_float(xr[i]));
    acc = warp_reduce<Op>(acc);
    if (lane == 0) out[row] = from_float<T>(acc);
}

#define REDUCE_KERNELS(OPNAME, OP, T, SUF)                                                         \
    extern "C" __global__ void reduce_##OPNAME##_all_stage1_kernel_##SUF(float* partials, const T* x, int n) { \
        reduce_all_stage1<OP, T>(partials, x, n);                                                  \
    }                                                                                              \
    extern "C" __global__ void reduce_##OPNAME##_all_stage2_kernel_##SUF(T* out, const float* partials, int m) { \
        reduce_all_stage2<OP, T>(out, partials, m);                                                \
    }                                                                                              \
    extern "C" __global__ void reduce_##OPNAME##_lastdim_kernel_##SUF(T* out, const T* x, int rows, int C) { \
        reduce_lastdim<OP, T>(out, x, rows, C);                                                    \
    }

REDUCE_KERNELS(sum, SumOp, float, f32)
REDUCE_KERNELS(sum, SumOp, bf16, bf16)
REDUCE_KERNELS(max, MaxOp, float, f32)
REDUCE_KERNELS(max, MaxOp, bf16, bf16)
