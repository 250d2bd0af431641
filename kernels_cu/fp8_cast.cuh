/*
 * fp8_cast.cuh -- the FP8 cast's building blocks (see fp8.cu's header for the math): two floats to two
 * E4M3/E5M2 bytes (saturating, round to nearest even), 8 bf16 of a 16-byte pack to 8 bytes with the
 * |x| bit max on the way, the block's amax folded into a global one with atomicMax, and a 4 x 4
 * block of a shared byte tile stored transposed. Shared by fp8.cu's casts and the producers that
 * write FP8 themselves (layernorm.cu's FP8 forward).
 */
#pragma once
#include "common.cuh"
#include "fast_packs.cuh"

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

// Two floats -> an f16 pair (lo = first element), round to nearest even (f16 subnormals kept).
__device__ __forceinline__ u32 cvt_rn_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 8 floats -> 8 f16 (one 16-byte pack, memory order).
__device__ __forceinline__ uint4 pack_f16(const float (&f)[8]) {
    return make_uint4(cvt_rn_f16x2(f[0], f[1]), cvt_rn_f16x2(f[2], f[3]), cvt_rn_f16x2(f[4], f[5]),
                      cvt_rn_f16x2(f[6], f[7]));
}

// 8 f16 (one pack) -> 8 E5M2 bytes, unscaled, RNE, saturating: one cvt a pair. E5M2 is f16's top byte
// (same exponent range), so this is the one rounding from the f16 value. sm_89+ (a trap below).
__device__ __forceinline__ uint2 e5m2_of_f16_pack(const uint4& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    const u32 w[4] = {p.x, p.y, p.z, p.w};
    unsigned short o[4];
    #pragma unroll
    for (int i = 0; i < 4; i++) asm("cvt.rn.satfinite.e5m2x2.f16x2 %0, %1;" : "=h"(o[i]) : "r"(w[i]));
    return make_uint2((u32)o[0] | ((u32)o[1] << 16), (u32)o[2] | ((u32)o[3] << 16));
#else
    __trap();
    return make_uint2(0u, 0u);
#endif
}

// 8 E4M3 bytes (one uint2, memory order) times scale_inv -> 8 bf16 (one 16-byte pack as raw uint4):
// each byte exactly to f16 and f32 (cvt.rn.f16x2.e4m3x2: 0x7f / 0xff stay NaN), one fp32 product,
// rounded to nearest even -- bf16(f32(q) * f32(scale_inv)), ops/fp8.py's fp8_dequantize_bf16. The
// readers of an E4M3-kept tensor (fch: the GELU cast and the GELU backward) turn it back into the
// bf16 pack their bf16 path reads, and go on unchanged. sm_89+ (a trap below, as cvt_fp8x2).
__device__ __forceinline__ uint4 dequant8_e4m3(uint2 q, float scale_inv) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    const u32 w[2] = {q.x, q.y};
    u32 o[4];
    #pragma unroll
    for (int i = 0; i < 2; i++) {
        #pragma unroll
        for (int j = 0; j < 2; j++) {
            u32 h2;
            float lo, hi;
            asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)(w[i] >> (16 * j))));
            asm("{ .reg .f16 l, h;\n\t mov.b32 {l, h}, %2;\n\t cvt.f32.f16 %0, l;\n\t cvt.f32.f16 %1, h; }"
                : "=f"(lo), "=f"(hi) : "r"(h2));
            o[2 * i + j] = cvt_rn_bf16x2(lo * scale_inv, hi * scale_inv);
        }
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
#else
    __trap();
    return make_uint4(0u, 0u, 0u, 0u);
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

// Thread t's 4 x 4 block of FP8 bytes in a shared word tile -- rows w, w + sw, w + 2 sw, w + 3 sw
// (one word = 4 columns each) -- written transposed: 4 bytes (the 4 rows) to each of out_t's rows
// oc..oc + 3 at column orr (out_t (C, R) row-major; R % 4 == 0, orr % 4 == 0). Byte permutes turn
// the block in registers: 4 shared loads where a byte-wise gather takes 16. Callers map consecutive
// threads to consecutive row blocks, so each out_t row gets its tile's bytes contiguously.
__device__ __forceinline__ void store_block4_t(u8* __restrict__ out_t, const u32* w, int sw, long long R,
                                               long long oc, long long orr) {
    const u32 w0 = w[0], w1 = w[sw], w2 = w[2 * sw], w3 = w[3 * sw];
    const u32 lo01 = __byte_perm(w0, w1, 0x5140), lo23 = __byte_perm(w2, w3, 0x5140);  // bytes 0, 1
    const u32 hi01 = __byte_perm(w0, w1, 0x7362), hi23 = __byte_perm(w2, w3, 0x7362);  // bytes 2, 3
    u32* o = reinterpret_cast<u32*>(out_t + oc * R + orr);
    const long long step = R / 4;      // one out_t row, in words
    __stcs(o, __byte_perm(lo01, lo23, 0x5410));            // column 0 of the block: byte 0 of w0..w3
    __stcs(o + step, __byte_perm(lo01, lo23, 0x7632));     // column 1
    __stcs(o + 2 * step, __byte_perm(hi01, hi23, 0x5410)); // column 2
    __stcs(o + 3 * step, __byte_perm(hi01, hi23, 0x7632)); // column 3
}
