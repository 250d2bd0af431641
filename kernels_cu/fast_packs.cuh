/*
 * fast_packs.cuh -- lean per-element arithmetic for memory-bound row kernels
 * (softmax v3, classifier v3, encoder dwte v3, layernorm v2) and the GEMM ladder's C stores.
 *
 * Why: without -use_fast_math, __expf compiles to MUFU.EX2 wrapped in a
 * denormal fix-up (FSETP + 2 predicated FMUL), float_to_bf16 is ~8 integer
 * instructions, and a Pack16<bf16> (a struct of eight 16-bit values) is split
 * 16 bits at a time -- in the dwte kernel right after each load, which
 * serialised the loads. Kernels doing a few flops per byte then run out of
 * issue slots before they run out of bandwidth. Here:
 *   - Raw<T>: a 16-byte pack kept as four 32-bit words (uint4); a bf16 pair
 *     unpacks with one shift or one mask per element;
 *   - ex2_ftz, rcp_ftz, sqrt_ftz: the bare MUFU instructions (results under
 *     2^-126 flush to 0);
 *   - cvt_rn_bf16x2: the hardware round-to-nearest-even conversion of two
 *     floats, equal to float_to_bf16 for every non-NaN input; NaN becomes
 *     0x7fff instead of sign|0x7fc0, so callers use pack_exact for rows that
 *     may hold NaN.
 */
#pragma once
#include "common.cuh"

#define LOG2E 1.4426950408889634f

// 2^x as the bare MUFU instruction (2 ulp); results below 2^-126 flush to 0:
// for softmax-like outputs that is an exp(x - max) < 1e-38, invisible next to
// the max's term 1 in the normalising sum.
__device__ __forceinline__ float ex2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 1 / x and sqrt(x) as the bare MUFU instructions (rel. error ~2^-23; inputs and results below
// 2^-126 flush to 0): where no IEEE-exact quotient or root is owed (GELU's sigmoid, AdamW's update).
__device__ __forceinline__ float rcp_ftz(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float sqrt_ftz(float x) {
    float y;
    asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Round-to-nearest-even float pair -> bf16x2 in one instruction (sm_80+); equal to
// float_to_bf16 for every non-NaN input (NaN becomes 0x7fff, hence the exact path).
__device__ __forceinline__ u32 cvt_rn_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Two adjacent outputs (p 8-byte aligned for float, 4-byte for bf16): a float2, or a bf16 pair rounded
// by cvt_rn_bf16x2 (the GEMM ladder's C stores: one instruction where float_to_bf16 twice is ~10).
template <typename T>
__device__ __forceinline__ void store_pair_rn(T* p, float x, float y);
template <>
__device__ __forceinline__ void store_pair_rn<float>(float* p, float x, float y) {
    *reinterpret_cast<float2*>(p) = make_float2(x, y);
}
template <>
__device__ __forceinline__ void store_pair_rn<bf16>(bf16* p, float x, float y) {
    *reinterpret_cast<u32*>(p) = cvt_rn_bf16x2(x, y);
}

// Raw 16-byte packs: bf16 pairs (low half = first element) or fp32 words.
template <typename T> struct Raw;
template <> struct Raw<bf16> {
    static constexpr int P = 8;
    static __device__ __forceinline__ void unpack(const uint4& r, float (&f)[8]) {
        const u32 w[4] = {r.x, r.y, r.z, r.w};
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
    static __device__ __forceinline__ uint4 pack_fast(const float (&f)[8]) {
        return make_uint4(cvt_rn_bf16x2(f[0], f[1]), cvt_rn_bf16x2(f[2], f[3]),
                          cvt_rn_bf16x2(f[4], f[5]), cvt_rn_bf16x2(f[6], f[7]));
    }
    static __device__ __forceinline__ uint4 pack_exact(const float (&f)[8]) {
        return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]),
                          pack_bf16x2(f[4], f[5]), pack_bf16x2(f[6], f[7]));
    }
    // pack_fast's NaN (0x7fff) as pack_exact rounds arithmetic's canonical NaN (0x7fffffff): 0x7fc0.
    static __device__ __forceinline__ uint4 canonical_nan(const uint4& r) {
        u32 w[4] = {r.x, r.y, r.z, r.w};
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            if ((w[i] & 0xffffu) == 0x7fffu) w[i] = (w[i] & 0xffff0000u) | 0x7fc0u;
            if ((w[i] >> 16) == 0x7fffu) w[i] = (w[i] & 0xffffu) | 0x7fc00000u;
        }
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
};
template <> struct Raw<float> {
    static constexpr int P = 4;
    static __device__ __forceinline__ void unpack(const uint4& r, float (&f)[4]) {
        f[0] = __uint_as_float(r.x); f[1] = __uint_as_float(r.y);
        f[2] = __uint_as_float(r.z); f[3] = __uint_as_float(r.w);
    }
    static __device__ __forceinline__ uint4 pack_fast(const float (&f)[4]) {
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
    }
    static __device__ __forceinline__ uint4 pack_exact(const float (&f)[4]) { return pack_fast(f); }
    static __device__ __forceinline__ uint4 canonical_nan(const uint4& r) { return r; }
};

// Accumulate a pack into P fp32 sums.
template <typename T>
__device__ __forceinline__ void add_pack(float (&acc)[Raw<T>::P], const uint4& r) {
    float f[Raw<T>::P];
    Raw<T>::unpack(r, f);
    #pragma unroll
    for (int e = 0; e < Raw<T>::P; e++) acc[e] += f[e];
}
