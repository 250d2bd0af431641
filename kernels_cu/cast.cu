/*
 * cast.cu -- dtype conversion float32 <-> bfloat16.
 *
 * Math: f32 -> bf16 rounds to nearest, ties to even; NaN becomes the canonical
 * quiet NaN with its sign (ml_dtypes' rule, so the result matches NumPy bit
 * for bit); bf16 -> f32 is exact (a 16-bit shift).
 * Shapes: any, flattened to n elements.
 * Each thread moves 8 elements per step: 32 bytes of float and 16 of bf16,
 * so both sides use 16-byte accesses.
 */
#include "common.cuh"

extern "C" __global__ void cast_f32_to_bf16_kernel(bf16* out, const float* in, int n) {   // (n,) (n,)
    const int stride = gridDim.x * blockDim.x;
    const int tid = blockIdx.x * blockDim.x + threadIdx.x;
    int n_vec = 0;
    if (is_aligned16(out) && is_aligned16(in)) {
        n_vec = n / 8;
        for (int i = tid; i < n_vec; i += stride) {
            Pack16<float> lo = load16_cs(in + i * 8), hi = load16_cs(in + i * 8 + 4);
            Pack16<bf16> o;
            #pragma unroll
            for (int k = 0; k < 4; k++) {
                o.v[k] = float_to_bf16(lo.v[k]);
                o.v[k + 4] = float_to_bf16(hi.v[k]);
            }
            store16(out + i * 8, o);
        }
        n_vec *= 8;
    }
    for (int i = n_vec + tid; i < n; i += stride) out[i] = float_to_bf16(in[i]);
}

extern "C" __global__ void cast_bf16_to_f32_kernel(float* out, const bf16* in, int n) {   // (n,) (n,)
    const int stride = gridDim.x * blockDim.x;
    const int tid = blockIdx.x * blockDim.x + threadIdx.x;
    int n_vec = 0;
    if (is_aligned16(out) && is_aligned16(in)) {
        n_vec = n / 8;
        for (int i = tid; i < n_vec; i += stride) {
            Pack16<bf16> x = load16_cs(in + i * 8);
            Pack16<float> lo, hi;
            #pragma unroll
            for (int k = 0; k < 4; k++) {
                lo.v[k] = bf16_to_float(x.v[k]);
                hi.v[k] = bf16_to_float(x.v[k + 4]);
            }
            store16(out + i * 8, lo);
            store16(out + i * 8 + 4, hi);
        }
        n_vec *= 8;
    }
    for (int i = n_vec + tid; i < n; i += stride) out[i] = bf16_to_float(in[i]);
}
