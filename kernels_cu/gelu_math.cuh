/*
 * gelu_math.cuh -- GPT-2's GELU (tanh approximation) and its derivative on one float: the math
 * gelu.cu's kernels and fp8.cu's fused GELU backward share, so both produce the same bits.
 * The derivation and the clamping argument are in gelu.cu's header.
 */
#pragma once

#include "fast_packs.cuh"   // ex2_ftz, rcp_ftz, cvt_rn_bf16x2, LOG2E

#define GELU_K 0.7978845608028654f      // sqrt(2 / pi)
#define GELU_A 0.044715f
// The lean (bf16-output) path's constants: -2 u log2(e) = x (C0 + C1 x^2), and 2 u' = D0 + D1 x^2.
#define GELU_C0 (-2.0f * GELU_K * LOG2E)
#define GELU_C1 (-2.0f * GELU_K * GELU_A * LOG2E)
#define GELU_D0 (2.0f * GELU_K)
#define GELU_D1 (6.0f * GELU_K * GELU_A)
#define GELU_CLAMP2 115.41560327111707f  // 80 log2(e): the same clamp (exp(80)) in log2 units

// s = sigmoid(2u) and e = exp(-2u), with the exponent clamped (gelu.cu's header).
// Accurate (the float32 kernels): expf. __expf computes ex2(x * log2e), whose
// argument rounding adds about |2u| * log2e * 2^-24 of relative error: 3e-6 at
// x = -8, on top of the 5.5e-6 that float32's own evaluation of u costs there
// (a NumPy emulation), too close to float32's 1e-5 budget.
// Lean (bf16 outputs, which cannot see those errors): the exponent straight in
// log2 units with the constants folded (3 flops), the bare MUFU.EX2 and MUFU.RCP
// (no denormal fix-ups: e under 2^-126 flushes to 0 where s = 1 anyway, and
// 1 + e stays below 2^116). The bf16 GELU kernels were issue-bound, not
// memory-bound (ncu: 77-79% of the SM's issue, 56-78% of DRAM), and this is
// about half of their arithmetic.
template <bool Accurate>
__device__ __forceinline__ float gelu_sigmoid(float x, float& e) {
    if (Accurate) {
        const float u = GELU_K * fmaf(GELU_A * x, x * x, x);
        const float arg = fminf(-2.0f * u, 80.0f);   // fminf(NaN, 80) = 80: a NaN x still gives NaN below
        e = expf(arg);
        return __fdividef(1.0f, 1.0f + e);
    }
    const float arg2 = fminf(x * fmaf(GELU_C1, x * x, GELU_C0), GELU_CLAMP2);   // NaN x: as above
    e = ex2_ftz(arg2);
    return rcp_ftz(1.0f + e);
}

template <bool Accurate>
__device__ __forceinline__ float gelu_f(float x) {
    float e;
    return x * gelu_sigmoid<Accurate>(x, e);
}

template <bool Accurate>
__device__ __forceinline__ float gelu_grad_f(float x, float dout) {
    float e;
    const float s = gelu_sigmoid<Accurate>(x, e);
    if (Accurate) {
        const float du = GELU_K * fmaf(3.0f * GELU_A * x, x, 1.0f);     // du/dx
        return dout * s * fmaf(2.0f * x * (e * s), du, 1.0f);
    }
    return dout * s * fmaf(x * (e * s), fmaf(GELU_D1, x * x, GELU_D0), 1.0f);   // 2 du/dx folded
}
