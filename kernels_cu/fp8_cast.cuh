/*
 * fp8_cast.cuh -- the FP8 cast's building blocks (see fp8.cu's header for the math): two floats to two
 * E4M3/E5M2 bytes (saturating, round to nearest even), 8 bf16 of a 16-byte pack to 8 bytes with the
 * |x| bit max on the way, and the block's amax folded into a global one with atomicMax. Shared by
 * fp8.cu's casts and the producers that write FP8 themselves (layernorm.cu's FP8 forward).
 */
#pragma once
#include "common.cuh"

typedef unsigned char u8;

#define E4M3 0
#define E5M2 1

// Two floats -> two fp8 bytes (lo = first element, as memory order wants), round to nearest even,
// saturating to the largest finite value. sm_89+: older targets compile to a trap (the Python side
// refuses those GPUs with one clear line first).
template <int FMT>
__device__ __forceinline__ unsigned short cvt_fp8x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;
    if (FMT == E4M3)
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    __trap();
    return 0;
#endif
}

// 8 bf16 (one 16-byte pack as raw uint4) -> 8 fp8 bytes (uint2), scaled; |x| bits folded into the
// two 16-bit halves of mbits (unsigned max per half).
template <int FMT>
__device__ __forceinline__ uint2 quantize8(uint4 p, float scale, u32& mbits) {
    const u32 w[4] = {p.x, p.y, p.z, p.w};
    u32 o[2];
    #pragma unroll
    for (int i = 0; i < 4; i += 2) {
        mbits = __vmaxu2(__vmaxu2(mbits, w[i] & 0x7fff7fffu), w[i + 1] & 0x7fff7fffu);
        const float a = __uint_as_float(w[i] << 16), b = __uint_as_float(w[i] & 0xffff0000u);
        const float c = __uint_as_float(w[i + 1] << 16), d = __uint_as_float(w[i + 1] & 0xffff0000u);
        o[i / 2] = (u32)cvt_fp8x2<FMT>(a * scale, b * scale) | ((u32)cvt_fp8x2<FMT>(c * scale, d * scale) << 16);
    }
    return make_uint2(o[0], o[1]);
}

// The block's max |x| (as float bits) into *amax. All threads of the block call it.
__device__ __forceinline__ void block_amax(float* amax, u32 mbits) {
    __shared__ u32 warp_max[32];
    u32 m = max(mbits >> 16, mbits & 0xffffu) << 16;       // the larger half, as fp32 bits
    m = __reduce_max_sync(0xffffffffu, m);
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) m = max(m, warp_max[w]);
        atomicMax(reinterpret_cast<u32*>(amax), m);
    }
}
