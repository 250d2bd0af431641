/*
 * gelu_math.cuh -- GPT-2's GELU (tanh approximation) and its derivative on one float: the math
 * gelu.cu's kernels and fp8.cu's fused GELU backward share, so both produce the same bits.
 * The derivation and the clamping argument are in gelu.cu's header.
 */
#pragma once

#define GELU_K 0.7978845608028654f      // sqrt(2 / pi)
#define GELU_A 0.044715f

// s = sigmoid(2u) and e = exp(-2u), with the exponent clamped (gelu.cu's header).
// Accurate (the float32 kernels): expf. __expf computes ex2(x * log2e), whose
// argument rounding adds about |2u| * log2e * 2^-24 of relative error: 3e-6 at
// x = -8, on top of the 5.5e-6 that float32's own evaluation of u costs there
// (a NumPy emulation), too close to float32's 1e-5 budget. bf16 outputs cannot
// see the difference: they keep __expf.
template <bool Accurate>
__device__ __forceinline__ float gelu_sigmoid(float x, float& e) {
    const float u = GELU_K * fmaf(GELU_A * x, x * x, x);
    const float arg = fminf(-2.0f * u, 80.0f);   // fminf(NaN, 80) = 80: a NaN x still gives NaN below
    e = Accurate ? expf(arg) : __expf(arg);
    return __fdividef(1.0f, 1.0f + e);
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
    const float du = GELU_K * fmaf(3.0f * GELU_A * x, x, 1.0f);     // du/dx
    return dout * s * fmaf(2.0f * x * (e * s), du, 1.0f);
}
