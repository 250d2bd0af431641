/*
 * cast.cu -- dtype conversion float32 <-> bfloat16.
 *
 * Math: f32 -> bf16 rounds to nearest, ties to even; NaN becomes the canonical
 * quiet NaN with its sign (ml_dtypes' rule, so the result matches NumPy bit
 * for bit); bf16 -> f32 is exact (a 16-bit shift).
 * Shapes: any, flattened to n elements.
 * Each thread converts UNROLL groups of 8 elements (32 bytes of float, 16 of
 * bf16), issuing all its 16-byte loads before the first store so that enough
 * bytes are in flight to saturate HBM. One block covers 256*UNROLL*8 elements;
 * no grid-stride loop (the grid is as large as the data).
 */
#include "common.cuh"

#define UNROLL 4

extern "C" __global__ void cast_f32_to_bf16_kernel(bf16* __restrict__ out, const float* __restrict__ in,
                                                   int n) {   // (n,) (n,)
    const int base = blockIdx.x * blockDim.x * UNROLL + threadIdx.x;   // in groups of 8
    if (is_aligned16(out) && is_aligned16(in) && (base + (UNROLL - 1) * (int)blockDim.x + 1) * 8 <= n) {
        Pack16<float> lo[UNROLL], hi[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int g = base + u * blockDim.x;
            lo[u] = load16_cs(in + g * 8);
            hi[u] = load16_cs(in + g * 8 + 4);
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            Pack16<bf16> o;
            #pragma unroll
            for (int k = 0; k < 4; k++) {
                o.v[k] = float_to_bf16(lo[u].v[k]);
                o.v[k + 4] = float_to_bf16(hi[u].v[k]);
            }
            store16(out + (base + u * blockDim.x) * 8, o);
        }
        return;
    }
    // Edge block (or unaligned pointers): element by element.
    for (int u = 0; u < UNROLL; u++)
        for (int k = 0; k < 8; k++) {
            const int i = (base + u * blockDim.x) * 8 + k;
            if (i < n) out[i] = float_to_bf16(in[i]);
        }
}

extern "C" __global__ void cast_bf16_to_f32_kernel(float* __restrict__ out, const bf16* __restrict__ in,
                                                   int n) {   // (n,) (n,)
    const int base = blockIdx.x * blockDim.x * UNROLL + threadIdx.x;
    if (is_aligned16(out) && is_aligned16(in) && (base + (UNROLL - 1) * (int)blockDim.x + 1) * 8 <= n) {
        Pack16<bf16> x[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; u++) x[u] = load16_cs(in + (base + u * blockDim.x) * 8);
        #pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            Pack16<float> lo, hi;
            #pragma unroll
            for (int k = 0; k < 4; k++) {
                lo.v[k] = bf16_to_float(x[u].v[k]);
                hi.v[k] = bf16_to_float(x[u].v[k + 4]);
            }
            float* o = out + (base + u * blockDim.x) * 8;
            store16(o, lo);
            store16(o + 4, hi);
        }
        return;
    }
    for (int u = 0; u < UNROLL; u++)
        for (int k = 0; k < 8; k++) {
            const int i = (base + u * blockDim.x) * 8 + k;
            if (i < n) out[i] = bf16_to_float(in[i]);
        }
}
