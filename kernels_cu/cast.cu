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

// bf16 -> f32 writes twice the bytes it reads, so the stores set the pace: each
// thread handles UNROLL quads of 4 elements (8-byte loads, 16-byte stores) so
// that every store instruction of a warp covers 512 contiguous bytes. (Two
// 16-byte stores per thread 32 bytes apart measured 59% of copy bandwidth.)
extern "C" __global__ void cast_bf16_to_f32_kernel(float* __restrict__ out, const bf16* __restrict__ in,
                                                   int n) {   // (n,) (n,)
    constexpr int Q = 2 * UNROLL;                                      // quads per thread
    const int base = blockIdx.x * blockDim.x * Q + threadIdx.x;       // in quads of 4
    if (is_aligned16(out) && (reinterpret_cast<u64>(in) & 7ull) == 0 &&
        (base + (Q - 1) * (int)blockDim.x + 1) * 4 <= n) {
        uint2 x[Q];
        #pragma unroll
        for (int u = 0; u < Q; u++) x[u] = __ldcs(reinterpret_cast<const uint2*>(in) + base + u * blockDim.x);
        #pragma unroll
        for (int u = 0; u < Q; u++) {
            float4 o = make_float4(__uint_as_float(x[u].x << 16), __uint_as_float(x[u].x & 0xffff0000u),
                                   __uint_as_float(x[u].y << 16), __uint_as_float(x[u].y & 0xffff0000u));
            reinterpret_cast<float4*>(out)[base + u * blockDim.x] = o;
        }
        return;
    }
    for (int u = 0; u < Q; u++)
        for (int k = 0; k < 4; k++) {
            const int i = (base + u * blockDim.x) * 4 + k;
            if (i < n) out[i] = bf16_to_float(in[i]);
        }
}
