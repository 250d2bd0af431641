/*
 * common.cuh -- helpers shared by every gpucore kernel file.
 *
 * - bf16: bfloat16 as raw bits in a 2-byte struct, with exact conversions.
 *   We do not include <cuda_bf16.h>: the kernels then compile with NVRTC alone,
 *   on any machine, without CUDA's headers (see runtime.py). Conversion
 *   float -> bf16 rounds to nearest even and maps NaN to the canonical quiet
 *   NaN with its sign, exactly as ml_dtypes (Eigen) does, so GPU casts match
 *   NumPy bit for bit.
 * - Pack16<T>: 16 bytes of T, for 128-bit loads and stores.
 * - warp / block reductions (shuffle tree, then one warp over the per-warp
 *   partials). The order of operations is fixed, so results are deterministic.
 * - from_last: row chunks taken last first, for the passes that read what a GEMM just wrote.
 */
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;

struct __align__(2) bf16 {
    unsigned short bits;
};

__device__ __forceinline__ float bf16_to_float(bf16 h) {
    return __uint_as_float(((u32)h.bits) << 16);
}

__device__ __forceinline__ bf16 float_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    bf16 h;
    if ((u & 0x7fffffffu) > 0x7f800000u) {            // NaN -> canonical quiet NaN
        h.bits = (unsigned short)((u >> 16) & 0x8000u) | 0x7fc0u;
        return h;
    }
    u += 0x7fffu + ((u >> 16) & 1u);                   // round to nearest, ties to even
    h.bits = (unsigned short)(u >> 16);
    return h;
}

// Chunk k of n, counted from the last: the row passes that read a tensor a GEMM (or the attention
// backward) has just written take their row chunks last first. The hardware starts blocks in
// index order, and the producer's last rows are what the L2 still holds; read first, they are hits,
// where a pass in row order first evicts them and then reads all from DRAM. A read right after the
// training path's GEMM, row order -> last first: 52 MB (d48 attproj's output) 0.055 -> 0.016 ms,
// 101 MB 0.048 -> 0.025, 403 MB 0.107 -> 0.089 (NVIDIA H200, tools/probes/l2_after_gemm.py). Each
// chunk's work is the same, and so are the bits; only the order in which the chunks start changes.
// Kept where it measured faster in the graphed d12 step (tools/probes/step_timeline.py, H100, two
// rounds): the layernorm forward (bf16 -3%, FP8 -1.7%), fp8_cast (e5m2 -2.1%, the GELU cast -2.0%),
// fp8_transpose (-0.5%). Removed where it did not: the GELU backward + dbias (+0.4%), the attention's
// D pass and the layernorm backward's rows (no change).
__device__ __forceinline__ int from_last(int k, int n) { return n - 1 - k; }

// Uniform float conversions so templates can be written once for float and bf16.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return bf16_to_float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) { return float_to_bf16(x); }

// Two bf16 in one 32-bit register (low half = first element), as mma.sync wants.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    return (u32)float_to_bf16(lo).bits | ((u32)float_to_bf16(hi).bits << 16);
}

template <typename T>
struct __align__(16) Pack16 {
    static constexpr int size = 16 / sizeof(T);
    T v[size];
};

template <typename T>
__device__ __forceinline__ Pack16<T> load16(const T* p) {   // p must be 16-byte aligned
    int4 raw = *reinterpret_cast<const int4*>(p);
    return *reinterpret_cast<Pack16<T>*>(&raw);
}

// Streaming load: read once, do not keep in L1 (ld.global.cs).
template <typename T>
__device__ __forceinline__ Pack16<T> load16_cs(const T* p) {
    int4 raw = __ldcs(reinterpret_cast<const int4*>(p));
    return *reinterpret_cast<Pack16<T>*>(&raw);
}

template <typename T>
__device__ __forceinline__ void store16(T* p, const Pack16<T>& x) {
    *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(&x);
}

__device__ __forceinline__ bool is_aligned16(const void* p) {
    return (reinterpret_cast<u64>(p) & 15ull) == 0;
}

__host__ __device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---- reductions -------------------------------------------------------------

struct SumOp {
    static __device__ __forceinline__ float identity() { return 0.0f; }
    static __device__ __forceinline__ float combine(float a, float b) { return a + b; }
};

struct MaxOp {   // propagates NaN like numpy.max
    static __device__ __forceinline__ float identity() { return -__int_as_float(0x7f800000); }
    static __device__ __forceinline__ float combine(float a, float b) {
        return (a != a || a > b) ? a : b;
    }
};

template <typename Op>
__device__ __forceinline__ float warp_reduce(float x) {
    #pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        x = Op::combine(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) { return warp_reduce<SumOp>(x); }
__device__ __forceinline__ float warp_max(float x) { return warp_reduce<MaxOp>(x); }

// Reduce over the whole block; every thread gets the result. `scratch` holds
// 32 floats of shared memory. blockDim.x must be a multiple of 32.
template <typename Op>
__device__ float block_reduce(float x, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int num_warps = blockDim.x >> 5;
    x = warp_reduce<Op>(x);
    __syncthreads();                    // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = (lane < num_warps) ? scratch[lane] : Op::identity();
    return warp_reduce<Op>(x);
}

// ---- stage 2 of the two-stage column sums ------------------------------------
// The deterministic column sums (colsum.cu; layernorm.cu's dweight / dbias / dx column sum) write
// float32 partials (np rows, `stride` floats apart) in stage 1; stage 2 adds them in an order fixed
// by np alone. A block of STAGE2_WARPS warps owns 32 columns, lane l column c = 32 * blockIdx.x + l,
// and sums partials[p * stride + c] over p < np: warp w adds p = w, w + W, w + 2W, ... from 0.0f,
// then warp 0 adds the W warp sums in warp order from 0.0f and returns the total (the other warps
// return their own part). Many warps a column because each warp's loads form a chain bounded by the
// L2's latency: one thread a column took 10-14 us a call at the model's shapes, 32 warps 4-5
// (tools/notes/profile.md, twenty-second session). blockDim.x == 32 * STAGE2_WARPS.
#define STAGE2_WARPS 32

__device__ __forceinline__ float stage2_column_sum(const float* __restrict__ partials, int np, size_t stride,
                                                   int C) {
    __shared__ float part[STAGE2_WARPS][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, c = blockIdx.x * 32 + lane;
    float s = 0.0f;
    if (c < C)
        for (int p = warp; p < np; p += STAGE2_WARPS) s += partials[(size_t)p * stride + c];
    part[warp][lane] = s;
    __syncthreads();
    if (warp == 0) {
        s = 0.0f;
        #pragma unroll
        for (int w = 0; w < STAGE2_WARPS; w++) s += part[w][lane];
    }
    return s;
}
