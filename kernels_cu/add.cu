/*
 * add.cu -- elementwise vector add: out = a + b (the residual add of GPT-2).
 *
 * Math: out[i] = round_T(float(a[i]) + float(b[i])), T in {float, bf16}.
 * Shapes: any, flattened to n elements; a, b, out all of n.
 * Gradients: d(a) = d(out), d(b) = d(out) -- no kernel needed.
 * Memory-bound: each thread handles UNROLL 16-byte packs, all loads issued
 * before the first store; the grid covers the data (no grid-stride loop).
 * Edge blocks and unaligned pointers take an element-by-element path.
 */
#include "common.cuh"

#define UNROLL 4

template <typename T>
__device__ void add_forward(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b,
                            int n) {   // (n,) x3
    constexpr int P = Pack16<T>::size;
    const int base = blockIdx.x * blockDim.x * UNROLL + threadIdx.x;   // in packs
    if (is_aligned16(out) && is_aligned16(a) && is_aligned16(b) &&
        (base + (UNROLL - 1) * (int)blockDim.x + 1) * P <= n) {
        Pack16<T> x[UNROLL], y[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            x[u] = load16_cs(a + (base + u * blockDim.x) * P);
            y[u] = load16_cs(b + (base + u * blockDim.x) * P);
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            Pack16<T> z;
            #pragma unroll
            for (int k = 0; k < P; k++) z.v[k] = from_float<T>(to_float(x[u].v[k]) + to_float(y[u].v[k]));
            store16(out + (base + u * blockDim.x) * P, z);
        }
        return;
    }
    for (int u = 0; u < UNROLL; u++)
        for (int k = 0; k < P; k++) {
            const int i = (base + u * blockDim.x) * P + k;
            if (i < n) out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
        }
}

extern "C" __global__ void add_forward_kernel_f32(float* out, const float* a, const float* b, int n) {
    add_forward(out, a, b, n);
}
extern "C" __global__ void add_forward_kernel_bf16(bf16* out, const bf16* a, const bf16* b, int n) {
    add_forward(out, a, b, n);
}
