/*
 * add.cu -- elementwise vector add: out = a + b (the residual add of GPT-2).
 *
 * Math: out[i] = round_T(float(a[i]) + float(b[i])), T in {float, bf16}.
 * Shapes: any, flattened to n elements; a, b, out all of n.
 * Gradients: d(a) = d(out), d(b) = d(out) -- no kernel needed.
 * Memory-bound: 16-byte loads/stores, a grid-stride loop over packs; a scalar
 * tail (or a fully scalar path when a pointer is not 16-byte aligned).
 */
#include "common.cuh"

template <typename T>
__device__ void add_forward(T* out, const T* a, const T* b, int n) {   // (n,) x3
    const int stride = gridDim.x * blockDim.x;
    const int tid = blockIdx.x * blockDim.x + threadIdx.x;
    constexpr int P = Pack16<T>::size;
    int n_vec = 0;
    if (is_aligned16(out) && is_aligned16(a) && is_aligned16(b)) {
        n_vec = n / P;
        for (int i = tid; i < n_vec; i += stride) {
            Pack16<T> x = load16_cs(a + i * P), y = load16_cs(b + i * P), z;
            #pragma unroll
            for (int k = 0; k < P; k++) z.v[k] = from_float<T>(to_float(x.v[k]) + to_float(y.v[k]));
            store16(out + i * P, z);
        }
        n_vec *= P;
    }
    for (int i = n_vec + tid; i < n; i += stride)
        out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

extern "C" __global__ void add_forward_kernel_f32(float* out, const float* a, const float* b, int n) {
    add_forward(out, a, b, n);
}
extern "C" __global__ void add_forward_kernel_bf16(bf16* out, const bf16* a, const bf16* b, int n) {
    add_forward(out, a, b, n);
}
