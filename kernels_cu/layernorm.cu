/*
 * layernorm.cu -- LayerNorm over the last axis, forward, backward, and the
 * fused residual-add + LayerNorm forward.
 *
 * Math (fp32 accumulation whatever T is; one rounding to T per output):
 *   forward:  mean = sum(x) / C,  rstd = 1 / sqrt(sum((x - mean)^2) / C + eps)
 *             xhat = (x - mean) * rstd,  out = xhat * weight + bias
 *             mean and rstd (fp32, one per row) are saved for the backward.
 *   fused:    residual = round_T(a + b); out = layernorm(residual) -- of the
 *             ROUNDED residual, so the backward (which reads residual) sees
 *             exactly the values the forward normalised.
 *   backward: dnorm = weight * dout
 *             dx      += rstd * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat))
 *             dweight += sum over rows of dout * xhat
 *             dbias   += sum over rows of dout
 *   colsum:   (optional) dx_colsum += sum over rows of dx AFTER the +=, as
 *             stored (rounded to T): the column sums a following
 *             matmul_backward needs as its dbias (GPT-2: the residual
 *             gradient is the dout of the previous projection), without a
 *             second pass over dx.
 * Shapes: x, out, residual, a, b, dout, dx (rows, C) with leading dims
 *   flattened to rows; weight, bias, dweight, dbias, dx_colsum (C,);
 *   mean, rstd (rows,).
 * Gradient rule: dx is the residual stream's gradient (+=); dweight, dbias
 *   are parameter gradients (+=).
 * Determinism: no atomics. dweight/dbias are a two-stage reduction: stage 1
 *   writes per-block fp32 partial sums (a fixed row-to-warp assignment, a
 *   fixed in-block order) to `scratch` (num_partials, 2, C); stage 2
 *   (layernorm_backward_reduce_kernel) adds them up in partial order. With
 *   the column sum (v2 only, the _colsum_ kernels), scratch is
 *   (num_partials, 3, C), slice 2 the dx partials, and the same grid is used,
 *   so dx, dweight and dbias keep the bits they have without it.
 *
 * Versions (the launcher picks v2 whenever it applies):
 *   v2 (C a multiple of the 16-byte pack P, 16-byte aligned arrays, C <= 32*8*P):
 *      one warp per row, the row kept in registers as N packs per lane
 *      (lane l holds packs j*32 + l, so each j is one 512-byte coalesced
 *      access per warp); N in 1..8 is a template parameter, the launcher
 *      picks the smallest that holds the row. Every input element is read
 *      from memory once (llm.c's layernorm kernels are the model). The
 *      backward keeps per-lane dweight/dbias accumulators in registers over a
 *      grid-stride loop of rows and reduces the block's warps at the end. Its
 *      COLSUM variant keeps the dx column sums per warp in shared memory, not
 *      registers (the N = 8 kernels already use ~255 registers; N more packs
 *      of accumulators would spill or cost occupancy), each lane owning its
 *      columns' slots, so no barrier or atomic is needed until the end.
 *      Long rows (one warp's N >= 4, e.g. C >= 1024 bf16) take the _s2
 *      backward: two warps a row, each half of its packs (S = 2 below; 7-8%
 *      faster at C = 1024..1600, where one warp's N = 7 needs 254 registers).
 *      v2 rounds to bf16 with cvt.rn.bf16x2 (fast_packs.cuh's pack_fast, one
 *      instruction a pair; float_to_bf16 took ~8 a value): the same bits for
 *      every non-NaN value. Rows whose statistics (forward) or sums (backward)
 *      are not finite take the exact conversion, so a NaN row keeps
 *      float_to_bf16's NaN bits. The FP8 forward's and the backward's row loops
 *      prefetch their next row into L2 (ptx.cuh's prefetch_l2).
 *   v1 (any C, any alignment): one warp per row, element by element, the row
 *      re-read from L1/L2 by each pass; the backward's dweight/dbias stage 1
 *      is a separate column kernel (one thread per column and row chunk);
 *      its dx column sum is the launcher's job (matmul's column-sum kernels).
 */
#include "common.cuh"
#include "fast_packs.cuh"   // Raw<T>: a row kept as raw 16-byte packs
#include "fp8_cast.cuh"
#include "ptx.cuh"          // prefetch_l2

#define WARPS 4             // rows (forward) / warps (backward) per block: blockDim.x == 128

// ------------------------------------------------------------------ v1 -------

// FUSED: residual = round(a + b), normalise residual; else normalise a (= x).
template <typename T, bool FUSED>
__device__ void layernorm_forward_v1(T* residual, T* out, float* mean, float* rstd,   // (rows,C) (rows,C) (rows,) (rows,)
                                     const T* a, const T* b, const T* weight, const T* bias,   // (rows,C) x2 (C,) (C,)
                                     int rows, int C, float eps) {
    const int row = from_last(blockIdx.x, gridDim.x) * WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const size_t off = (size_t)row * C;
    // Each lane always visits the same columns (c = lane mod 32), so it reads
    // back only what it wrote itself: no barrier needed after writing residual.
    const T* src = FUSED ? residual + off : a + off;
    float s = 0.0f;
    for (int c = lane; c < C; c += 32) {
        float v;
        if (FUSED) {
            const T r = from_float<T>(to_float(a[off + c]) + to_float(b[off + c]));
            residual[off + c] = r;
            v = to_float(r);
        } else {
            v = to_float(src[c]);
        }
        s += v;
    }
    const float m = warp_sum(s) / C;
    float q = 0.0f;
    for (int c = lane; c < C; c += 32) {
        const float d = to_float(src[c]) - m;
        q += d * d;
    }
    const float rs = rsqrtf(warp_sum(q) / C + eps);
    for (int c = lane; c < C; c += 32)
        out[off + c] = from_float<T>((to_float(src[c]) - m) * rs * to_float(weight[c]) + to_float(bias[c]));
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = rs;
    }
}

template <typename T>
__device__ void layernorm_backward_dx_v1(T* dx, const T* dout, const T* x, const T* weight,   // (rows,C) x3 (C,)
                                         const float* mean, const float* rstd, int rows, int C) {   // (rows,) x2
    const int row = blockIdx.x * WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const size_t off = (size_t)row * C;
    const float m = mean[row], rs = rstd[row];
    float s1 = 0.0f, s2 = 0.0f;
    for (int c = lane; c < C; c += 32) {
        const float dn = to_float(weight[c]) * to_float(dout[off + c]);
        s1 += dn;
        s2 += dn * (to_float(x[off + c]) - m) * rs;
    }
    s1 = warp_sum(s1) / C;
    s2 = warp_sum(s2) / C;
    for (int c = lane; c < C; c += 32) {
        const float xh = (to_float(x[off + c]) - m) * rs;
        const float dn = to_float(weight[c]) * to_float(dout[off + c]);
        dx[off + c] = from_float<T>(to_float(dx[off + c]) + (dn - s1 - xh * s2) * rs);
    }
}

// Stage 1 of dweight/dbias for v1: thread = column c, blockIdx.y = a chunk of
// rows summed in row order. Writes scratch[blockIdx.y][0 (dw) / 1 (db)][c].
template <typename T>
__device__ void layernorm_backward_dwdb_v1(float* scratch, const T* dout, const T* x,   // (chunks,2,C) (rows,C) x2
                                           const float* mean, const float* rstd,        // (rows,) x2
                                           int rows, int C, int rows_per_chunk) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int r0 = blockIdx.y * rows_per_chunk, r1 = min(r0 + rows_per_chunk, rows);
    float sw = 0.0f, sb = 0.0f;
    for (int r = r0; r < r1; r++) {
        const float g = to_float(dout[(size_t)r * C + c]);
        sw += g * (to_float(x[(size_t)r * C + c]) - mean[r]) * rstd[r];
        sb += g;
    }
    scratch[((size_t)blockIdx.y * 2) * C + c] = sw;
    scratch[((size_t)blockIdx.y * 2 + 1) * C + c] = sb;
}

// ------------------------------------------------------------------ v2 -------

// v2's row: loads row `off` (a, or with FUSED residual = round(a + b), written back), leaves its
// values in v and returns its mean m and rstd rs. Shared by the bf16/fp32 forward and the FP8 one,
// so both normalise with the same bits. The row stays as the 16-byte packs it was loaded as (T's
// bits in four 32-bit words, fast_packs.cuh's Raw<T>), unpacked to float where used: a bf16 row
// holds half the registers a float copy would (d48's C = 1600, 7 packs per lane: the FP8 kernel
// needed 158 registers, one 256-thread block per SM). The values are the same floats, so the bits
// are those of a float copy.
template <typename T, int N, bool FUSED>
__device__ __forceinline__ void layernorm_row_v2(uint4 (&v)[N], float& m, float& rs,
                                                 T* residual, const T* a, const T* b, size_t off,
                                                 int lane, int C, float eps) {
    constexpr int P = Pack16<T>::size;
    const int nP = C / P;
    // Issue every load of the row before using any of it.
    uint4 pb[N];
    #pragma unroll
    for (int j = 0; j < N; j++) {
        const int i = j * 32 + lane;
        if (i < nP) {
            v[j] = __ldcs(reinterpret_cast<const uint4*>(a + off + i * P));
            if (FUSED) pb[j] = __ldcs(reinterpret_cast<const uint4*>(b + off + i * P));
        }
    }
    float s = 0.0f;
    #pragma unroll
    for (int j = 0; j < N; j++) {
        const int i = j * 32 + lane;
        if (i < nP) {
            float f[P];
            Raw<T>::unpack(v[j], f);
            if (FUSED) {
                float g[P];
                Raw<T>::unpack(pb[j], g);
                #pragma unroll
                for (int k = 0; k < P; k++) f[k] += g[k];
                v[j] = Raw<T>::pack_fast(f);           // residual, rounded to T as stored
                *reinterpret_cast<uint4*>(residual + off + i * P) = v[j];
                Raw<T>::unpack(v[j], f);
            }
            #pragma unroll
            for (int k = 0; k < P; k++) s += f[k];
        }
    }
    m = warp_sum(s) / C;
    if (FUSED && m != m) {                     // warp-uniform, rare: a NaN in the row (or inf - inf)
        // pack_fast rounds a NaN to 0x7fff; float_to_bf16 (the reference) to sign | 0x7fc0, and a
        // NaN that comes out of an add is the canonical positive one. Re-store with those bits.
        #pragma unroll
        for (int j = 0; j < N; j++) {
            const int i = j * 32 + lane;
            if (i < nP) {
                v[j] = Raw<T>::canonical_nan(v[j]);
                *reinterpret_cast<uint4*>(residual + off + i * P) = v[j];
            }
        }
    }
    float q = 0.0f;
    #pragma unroll
    for (int j = 0; j < N; j++)
        if (j * 32 + lane < nP) {
            float f[P];
            Raw<T>::unpack(v[j], f);
            #pragma unroll
            for (int k = 0; k < P; k++) {
                const float d = f[k] - m;
                q += d * d;
            }
        }
    rs = rsqrtf(warp_sum(q) / C + eps);
}

// Pack j of the normalised row, as stored: (v - m) * rs * weight + bias rounded to T, as raw bits,
// from w and bb, the weight's and the bias's pack. Rounded by the one-instruction pack_fast (the
// per-element float_to_bf16 was ~8 integer instructions an element, half of these kernels' issue
// slots); exact (float_to_bf16's NaN bits) is for rows whose statistics are not finite, where every
// output is NaN. A NaN weight or bias in a finite row comes out as 0x7fff (a quiet NaN, as gelu.cu's
// outputs).
template <typename T, int N>
__device__ __forceinline__ uint4 layernorm_out_pack(const uint4 (&v)[N], int j, float m, float rs,
                                                    const uint4& w, const uint4& bb, bool exact) {
    constexpr int P = Pack16<T>::size;
    float f[P], fw[P], fb[P];
    Raw<T>::unpack(v[j], f);
    Raw<T>::unpack(w, fw);
    Raw<T>::unpack(bb, fb);
    #pragma unroll
    for (int k = 0; k < P; k++) f[k] = (f[k] - m) * rs * fw[k] + fb[k];
    return exact ? Raw<T>::pack_exact(f) : Raw<T>::pack_fast(f);
}

// The same reading pack i of weight and bias from memory (shared by every row: L1/L2 hits after the
// first warps).
template <typename T, int N>
__device__ __forceinline__ uint4 layernorm_out_pack(const uint4 (&v)[N], int j, int i, float m, float rs,
                                                    const T* weight, const T* bias, bool exact) {
    constexpr int P = Pack16<T>::size;
    const uint4 w = *reinterpret_cast<const uint4*>(weight + i * P);
    const uint4 bb = *reinterpret_cast<const uint4*>(bias + i * P);
    return layernorm_out_pack<T, N>(v, j, m, rs, w, bb, exact);
}

// The row's outputs need float_to_bf16's NaN bits only when its statistics are not finite.
__device__ __forceinline__ bool layernorm_stats_exact(float m, float rs) {
    return !(isfinite(m) && isfinite(rs));
}

template <typename T, int N, bool FUSED>
__device__ void layernorm_forward_v2(T* residual, T* out, float* mean, float* rstd,   // (rows,C) (rows,C) (rows,) (rows,)
                                     const T* a, const T* b, const T* weight, const T* bias,   // (rows,C) x2 (C,) (C,)
                                     int rows, int C, float eps) {
    constexpr int P = Pack16<T>::size;
    // the last rows first (common.cuh from_last): x is what the projection GEMM before just wrote
    const int row = from_last(blockIdx.x, gridDim.x) * WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int nP = C / P;
    const size_t off = (size_t)row * C;
    uint4 v[N];
    float m, rs;
    layernorm_row_v2<T, N, FUSED>(v, m, rs, residual, a, b, off, lane, C, eps);
    const bool exact = layernorm_stats_exact(m, rs);   // warp-uniform
    #pragma unroll
    for (int j = 0; j < N; j++) {
        const int i = j * 32 + lane;
        if (i < nP)
            *reinterpret_cast<uint4*>(out + off + i * P) = layernorm_out_pack<T, N>(v, j, i, m, rs, weight, bias, exact);
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = rs;
    }
}

// ---------------------------------------------------------- FP8 forward ------
// The v2 forward (bf16) whose output goes straight to E4M3 for an FP8 matmul (--dtype fp8): out8 (rows, C)
// and out8_t (C, rows) hold the bytes fp8_cast would make of the bf16 output -- the same row math
// (layernorm_row_v2, layernorm_out_pack), the same rounding to bf16, the same cast (fp8_cast.cuh) --
// and the bf16 output itself is never written. amax: the output's max |x| (bf16 bit max, atomicMax).
// Block = ROWS rows (8 warps x ROWS/8 rows, one row at a time per warp); the row's bytes also go to
// a shared tile (ROWS rows of C / 4 + 1 words, dynamic: the odd pitch keeps the transposed gathers
// off each other's banks) from which out8_t is written in 4 x 4 blocks (store_block4_t). The weight
// and bias (C bf16 each) are copied into shared memory after the tile once a block and read from there
// for every row: read from global memory, each row's 3 KB (C = 768) of weight and bias packs went
// through L1 beside the streamed rows, and the kernel ran 2-3% (d12) and 14-22% (d48) slower on an
// H200 (tools/notes/fp8.md, 63rd session). Dynamic shared memory: ROWS (C + 4) + 4 C bytes. The launcher
// (ops/layernorm.py fp8_block_rows) takes ROWS = 64 for the plain kernel while two 64-row blocks fit an
// SM (C <= 1690: d12 8%, d48 11% faster than 32 on an H100, eighteenth session) and, for the residual
// kernel, 64 for C <= 1024 and 32 above: on an H100, d12 (C = 768) ran 5.2 ms per step with 64-row
// blocks against 6.1 with 32, d48 (C = 1600, where 64 rows mean 103 KB of tile and 2 blocks per SM)
// 17.2 ms with 32 against 19.4-27.2 with 64 (fifth session, when the model ran the residual kernel).
// gate: the kernel runs only when *gate != 0 (adaptive scaling's re-run; the Python side re-runs
// the plain variant over the residual the first run wrote). rows % 16 == 0 (the FP8 GEMM's rule).
template <int N, int ROWS, bool FUSED>
__device__ void layernorm_forward_fp8(bf16* residual, u8* out8, u8* out8_t, float* amax, float* mean, float* rstd,
                                      const bf16* a, const bf16* b, const bf16* weight, const bf16* bias,
                                      const float* scale, const float* gate, int rows, int C, float eps) {
    extern __shared__ __align__(16) u32 fp8_ln_tile[];
    if (gate && *gate == 0.0f) return;         // block-uniform
    constexpr int P = Pack16<bf16>::size;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r0 = from_last(blockIdx.x, gridDim.x) * ROWS, pw = C / 4 + 1, nP = C / P;   // tile row pitch in words: odd
    const float s = *scale;
    u32 mb = 0;
    uint4* s_wb = reinterpret_cast<uint4*>(fp8_ln_tile + ROWS * pw);   // weight packs, then bias packs
    for (int i = threadIdx.x; i < nP; i += blockDim.x) {                // (16-byte aligned: C % 8 == 0)
        s_wb[i] = *reinterpret_cast<const uint4*>(weight + i * P);
        s_wb[nP + i] = *reinterpret_cast<const uint4*>(bias + i * P);
    }
    __syncthreads();
    for (int rr = 0; rr < ROWS / 8; rr++) {
        const int lr = warp * (ROWS / 8) + rr, row = r0 + lr;
        if (row >= rows) break;                // warp-uniform
        const size_t off = (size_t)row * C;
        if (rr + 1 < ROWS / 8 && row + 1 < rows && lane < (FUSED ? 2 : 1))   // this warp's next row, into L2
            prefetch_l2((lane == 0 ? a : b) + off + C, 2 * C);
        uint4 v[N];
        float m, rs;
        layernorm_row_v2<bf16, N, FUSED>(v, m, rs, residual, a, b, off, lane, C, eps);
        #pragma unroll
        for (int j = 0; j < N; j++) {
            const int i = j * 32 + lane;
            if (i < nP) {
                // pack_fast even for a NaN row: 0x7fff and float_to_bf16's NaN cast to the same E4M3 NaN
                // (only the amax's NaN payload differs).
                const uint4 o = layernorm_out_pack<bf16, N>(v, j, m, rs, s_wb[i], s_wb[nP + i], false);
                const uint2 q = quantize8<E4M3>(o, s, mb);
                fp8_ln_tile[lr * pw + 2 * i] = q.x;
                fp8_ln_tile[lr * pw + 2 * i + 1] = q.y;
                if (out8) *reinterpret_cast<uint2*>(out8 + off + i * P) = q;
            }
        }
        if (lane == 0) {
            mean[row] = m;
            rstd[row] = rs;
        }
    }
    __syncthreads();
    if (out8_t) {                              // 4 x 4 blocks: ROWS / 4 threads per out8_t row piece
        constexpr int RB = ROWS / 4;
        for (int idx = threadIdx.x; idx < RB * (C / 4); idx += blockDim.x) {
            const int r4 = 4 * (idx % RB), cb = idx / RB;
            if (r0 + r4 < rows)                // rows % 16 == 0: the block's 4 rows all in or all out
                store_block4_t(out8_t, fp8_ln_tile + r4 * pw + cb, pw, rows, 4 * cb, r0 + r4);
        }
    }
    if (amax) block_amax(amax, mb);
}

// Stage 1 of the backward, fused: dx += ... for every row, and this block's
// partial dweight/dbias into scratch[blockIdx.x][0 / 1][:]; with COLSUM also
// the partial column sums of the stored dx into scratch[blockIdx.x][2][:].
// S warps per row (1 or 2): with S = 2 the block's warps pair up (pair p = warps
// 2p, 2p + 1), warp 2p + h holding the contiguous half h of the row's packs
// (half 0 the first ceil(nP / 2)), so a lane keeps N packs of half a row and
// its accumulators: at C = 1600 (bf16) N = 4 instead of 7, ~half the
// registers, more warps per SM for this latency-bound loop. The pair adds its
// two warp sums of s1, s2 in half order through shared memory (double-buffered
// by row parity, one pair barrier a row); block partials sum each column over
// the pairs in pair order, as S = 1 sums the warps in warp order.
template <typename T, int N, bool COLSUM, int S = 1>
__device__ void layernorm_backward_v2(float* scratch, T* dx, const T* dout, const T* x,   // (grid,2|3,C) (rows,C) x3
                                      const T* weight, const float* mean, const float* rstd,   // (C,) (rows,) (rows,)
                                      int rows, int C) {
    static_assert(S == 1 || S == 2, "layernorm backward: 1 or 2 warps per row");
    constexpr int P = Pack16<T>::size;
    constexpr int NQ = COLSUM ? 3 : 2;        // partial slices per block in scratch
    constexpr int H = P / 4;                  // float4 slots per pack
    constexpr int RPB = WARPS / S;            // rows in flight per block (pairs when S = 2)
    __shared__ float red[WARPS][32 * P];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int pair = warp / S, half = warp % S;
    const int nP = C / P;
    const int nP0 = S == 1 ? nP : (nP + 1) / 2;   // packs of half 0
    const int cb = half * nP0;                // this warp's first pack
    const int nL = half == 0 ? nP0 : nP - nP0;    // and its number of packs
    float dw[N][P], db[N][P];
    #pragma unroll
    for (int j = 0; j < N; j++)
        #pragma unroll
        for (int k = 0; k < P; k++) dw[j][k] = db[j][k] = 0.0f;
    // COLSUM: this warp's column sums of dx, (N * H * 32) float4 slots; slot
    // (j * H + h) * 32 + lane holds columns (cb + j * 32 + lane) * P + 4h .. +3,
    // so the warp's 32 lanes touch 512 consecutive bytes (no bank conflicts) and
    // every lane only ever touches its own slots.
    float4* csum = nullptr;
    if constexpr (COLSUM) {
        __shared__ float4 csum_all[WARPS * N * H * 32];
        csum = csum_all + warp * N * H * 32;
        #pragma unroll
        for (int s = 0; s < N * H; s++) csum[s * 32 + lane] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    __shared__ float2 xch[2][RPB][S];         // S = 2: the pair's warp sums (s1, s2), by row parity
    int parity = 0;

    // No block barrier inside this loop: pairs may run different numbers of rows.
    for (int row = blockIdx.x * RPB + pair; row < rows; row += gridDim.x * RPB, parity ^= 1) {
        const size_t off = (size_t)row * C + (size_t)cb * P;   // this warp's part of the row
        // This warp's next row into L2 while this one computes: at large C the registers hold one
        // row per warp (N = 7: 254 registers, 8 warps per SM), so nothing else overlaps its loads.
        const int next = row + gridDim.x * RPB;
        if (next < rows && lane < 3)
            prefetch_l2((lane == 0 ? dout : lane == 1 ? x : dx) + (size_t)next * C + (size_t)cb * P,
                        nL * P * sizeof(T));
        uint4 g[N], v[N], d[N];                // raw packs (fast_packs.cuh): unpacked where used
        #pragma unroll
        for (int j = 0; j < N; j++) {
            const int i = j * 32 + lane;
            if (i < nL) {
                g[j] = __ldcs(reinterpret_cast<const uint4*>(dout + off + i * P));
                v[j] = __ldcs(reinterpret_cast<const uint4*>(x + off + i * P));
                d[j] = *reinterpret_cast<const uint4*>(dx + off + i * P);
            }
        }
        const float m = mean[row], rs = rstd[row];
        float s1 = 0.0f, s2 = 0.0f;
        #pragma unroll
        for (int j = 0; j < N; j++) {
            const int i = j * 32 + lane;
            if (i < nL) {
                float fw[P], fg[P], fx[P];
                Raw<T>::unpack(*reinterpret_cast<const uint4*>(weight + (cb + i) * P), fw);
                Raw<T>::unpack(g[j], fg);
                Raw<T>::unpack(v[j], fx);
                #pragma unroll
                for (int k = 0; k < P; k++) {
                    const float dn = fw[k] * fg[k];
                    s1 += dn;
                    s2 += dn * (fx[k] - m) * rs;
                }
            }
        }
        s1 = warp_sum(s1);
        s2 = warp_sum(s2);
        if constexpr (S == 2) {
            if (lane == 0) xch[parity][pair][half] = make_float2(s1, s2);
            // the pair's two warps (named barrier 1 + pair; 0 is __syncthreads')
            if (pair == 0) asm volatile("bar.sync 1, 64;" ::: "memory");
            else asm volatile("bar.sync 2, 64;" ::: "memory");
            const float2 a = xch[parity][pair][0], b = xch[parity][pair][1];
            s1 = a.x + b.x;
            s2 = a.y + b.y;
        }
        s1 /= C;
        s2 /= C;
        // dx rounds with pack_fast; float_to_bf16's NaN bits (pack_exact) where the row's sums are not
        // finite (a NaN in dout, x or weight). A NaN already in dx comes out as 0x7fff (a quiet NaN).
        const bool exact = !(isfinite(s1) && isfinite(s2));   // uniform over the row's warps
        #pragma unroll
        for (int j = 0; j < N; j++) {
            const int i = j * 32 + lane;
            if (i < nL) {
                float fw[P], fg[P], fx[P], fd[P];
                Raw<T>::unpack(*reinterpret_cast<const uint4*>(weight + (cb + i) * P), fw);
                Raw<T>::unpack(g[j], fg);
                Raw<T>::unpack(v[j], fx);
                Raw<T>::unpack(d[j], fd);
                #pragma unroll
                for (int k = 0; k < P; k++) {
                    const float xh = (fx[k] - m) * rs;
                    fd[k] += (fw[k] * fg[k] - s1 - xh * s2) * rs;
                    dw[j][k] += fg[k] * xh;
                    db[j][k] += fg[k];
                }
                d[j] = exact ? Raw<T>::pack_exact(fd) : Raw<T>::pack_fast(fd);
                *reinterpret_cast<uint4*>(dx + off + i * P) = d[j];
                if constexpr (COLSUM) {
                    // The stored (rounded) values: what a later reader of dx sees.
                    Raw<T>::unpack(d[j], fd);
                    #pragma unroll
                    for (int h = 0; h < H; h++) {
                        float4& s = csum[(j * H + h) * 32 + lane];
                        s.x += fd[4 * h];
                        s.y += fd[4 * h + 1];
                        s.z += fd[4 * h + 2];
                        s.w += fd[4 * h + 3];
                    }
                }
            }
        }
    }

    // Reduce the block's warps, pack slot by pack slot, in warp (pair) order. Value t of
    // slot j of half h (t = lane * P + k) is column (cb(h) + j * 32 + lane) * P + k.
    // S = 1 keeps its own loop (the general one gives the same sums, but it changed the one-warp
    // kernels' registers and so broke the plain / colsum occupancy pairing the launcher relies on).
    #pragma unroll
    for (int q = 0; q < 2; q++) {
        #pragma unroll
        for (int j = 0; j < N; j++) {
            __syncthreads();                  // red may still be read by the previous slot
            #pragma unroll
            for (int k = 0; k < P; k++) red[warp][lane * P + k] = q == 0 ? dw[j][k] : db[j][k];
            __syncthreads();
            if constexpr (S == 1) {
                for (int t = threadIdx.x; t < 32 * P; t += blockDim.x) {
                    float s = 0.0f;
                    #pragma unroll
                    for (int w = 0; w < WARPS; w++) s += red[w][t];
                    const int c = j * 32 * P + t;
                    if (c < C) scratch[((size_t)blockIdx.x * NQ + q) * C + c] = s;
                }
            } else {
                for (int u = threadIdx.x; u < S * 32 * P; u += blockDim.x) {
                    const int h = u / (32 * P), t = u % (32 * P);
                    const int i = j * 32 + t / P;  // pack within half h
                    if (i >= (h == 0 ? nP0 : nP - nP0)) continue;
                    float s = 0.0f;
                    #pragma unroll
                    for (int p = 0; p < RPB; p++) s += red[p * S + h][t];
                    scratch[((size_t)blockIdx.x * NQ + q) * C + (h * nP0 + i) * P + t % P] = s;
                }
            }
        }
    }
    if constexpr (COLSUM) {
        // Sum the warps' column sums in warp (pair) order, one thread per column.
        __syncthreads();                      // every warp's last row is in csum_all
        const float* cs = reinterpret_cast<const float*>(csum - warp * N * H * 32);   // (WARPS, N*H*32*4)
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            const int pk = c / P, k = c % P;
            const int h = pk >= nP0 ? 1 : 0;
            const int i = pk - h * nP0;       // pack i = j * 32 + l of half h, element k = 4h' + e
            const int f = (((i / 32) * H + k / 4) * 32 + i % 32) * 4 + k % 4;
            float s = 0.0f;
            #pragma unroll
            for (int p = 0; p < RPB; p++) s += cs[(p * S + h) * N * H * 32 * 4 + f];
            scratch[((size_t)blockIdx.x * NQ + 2) * C + c] = s;
        }
    }
}

// ------------------------------------------------------------- stage 2 -------

// dweight[c] += sum_p scratch[p][0][c], dbias[c] += sum_p scratch[p][1][c] over the np partials, in
// common.cuh's stage-2 order (STAGE2_WARPS warps a column); grid (C / 32, 2 | 3): blockIdx.y picks
// the slice, so the three sums run on three times the SMs. COLSUM: scratch is (np, 3, C) and
// dx_colsum[c] += sum_p scratch[p][2][c] the same way (its type TC may differ from the parameter
// gradients' TW).
template <typename TW, typename TC, bool COLSUM>
__device__ void layernorm_backward_reduce(TW* dweight, TW* dbias, TC* dx_colsum,   // (C,) (C,) (C,)
                                          const float* scratch, int num_partials, int C) {   // (np,2|3,C)
    constexpr int NQ = COLSUM ? 3 : 2;
    const int q = blockIdx.y;
    const float s = stage2_column_sum(scratch + (size_t)q * C, num_partials, (size_t)NQ * C, C);
    const int c = blockIdx.x * 32 + threadIdx.x % 32;
    if (threadIdx.x < 32 && c < C) {
        if (q == 0) dweight[c] = from_float<TW>(to_float(dweight[c]) + s);
        else if (q == 1) dbias[c] = from_float<TW>(to_float(dbias[c]) + s);
        else if constexpr (COLSUM) dx_colsum[c] = from_float<TC>(to_float(dx_colsum[c]) + s);
    }
}

// ------------------------------------------------------------ entry points ---

// Blocks per SM the COLSUM kernels must keep: the launcher sizes their grid from
// the plain kernel's occupancy (the same grid gives dx/dweight/dbias the same
// bits), so a COLSUM kernel needing more registers would run a second, mostly
// empty wave. ptxas keeps the occupancy by itself everywhere except bf16 N = 2
// (94 registers against 80: 5 blocks instead of 6). 0 = no constraint.
__host__ __device__ constexpr int colsum_min_blocks(int N, int P) { return N == 2 && P == 8 ? 6 : 0; }

#define LN_V1(T, SUF)                                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) layernorm_forward_kernel_v1_##SUF(            \
        T* out, float* mean, float* rstd, const T* x, const T* weight, const T* bias, int rows, int C,     \
        float eps) {                                                                                        \
        layernorm_forward_v1<T, false>(nullptr, out, mean, rstd, x, nullptr, weight, bias, rows, C, eps);  \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) layernorm_residual_forward_kernel_v1_##SUF(   \
        T* residual, T* out, float* mean, float* rstd, const T* a, const T* b, const T* weight,            \
        const T* bias, int rows, int C, float eps) {                                                        \
        layernorm_forward_v1<T, true>(residual, out, mean, rstd, a, b, weight, bias, rows, C, eps);        \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) layernorm_backward_dx_kernel_v1_##SUF(        \
        T* dx, const T* dout, const T* x, const T* weight, const float* mean, const float* rstd, int rows, \
        int C) {                                                                                            \
        layernorm_backward_dx_v1<T>(dx, dout, x, weight, mean, rstd, rows, C);                             \
    }                                                                                                       \
    extern "C" __global__ void layernorm_backward_dwdb_kernel_v1_##SUF(                                    \
        float* scratch, const T* dout, const T* x, const float* mean, const float* rstd, int rows, int C,  \
        int rows_per_chunk) {                                                                               \
        layernorm_backward_dwdb_v1<T>(scratch, dout, x, mean, rstd, rows, C, rows_per_chunk);              \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(STAGE2_WARPS * 32) layernorm_backward_reduce_kernel_##SUF( \
        T* dweight, T* dbias, const float* scratch, int num_partials, int C) {                              \
        layernorm_backward_reduce<T, float, false>(dweight, dbias, nullptr, scratch, num_partials, C);     \
    }

#define LN_V2(N, T, SUF)                                                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) layernorm_forward_kernel_v2_n##N##_##SUF(      \
        T* out, float* mean, float* rstd, const T* x, const T* weight, const T* bias, int rows, int C,     \
        float eps) {                                                                                        \
        layernorm_forward_v2<T, N, false>(nullptr, out, mean, rstd, x, nullptr, weight, bias, rows, C, eps); \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) layernorm_residual_forward_kernel_v2_n##N##_##SUF( \
        T* residual, T* out, float* mean, float* rstd, const T* a, const T* b, const T* weight,            \
        const T* bias, int rows, int C, float eps) {                                                        \
        layernorm_forward_v2<T, N, true>(residual, out, mean, rstd, a, b, weight, bias, rows, C, eps);     \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) layernorm_backward_kernel_v2_n##N##_##SUF(     \
        float* scratch, T* dx, const T* dout, const T* x, const T* weight, const float* mean,              \
        const float* rstd, int rows, int C) {                                                               \
        layernorm_backward_v2<T, N, false>(scratch, dx, dout, x, weight, mean, rstd, rows, C);             \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, colsum_min_blocks(N, Pack16<T>::size))          \
        layernorm_backward_colsum_kernel_v2_n##N##_##SUF(                                                   \
        float* scratch, T* dx, const T* dout, const T* x, const T* weight, const float* mean,              \
        const float* rstd, int rows, int C) {                                                               \
        layernorm_backward_v2<T, N, true>(scratch, dx, dout, x, weight, mean, rstd, rows, C);              \
    }

#define LN_V2_ALL(T, SUF) \
    LN_V2(1, T, SUF) LN_V2(2, T, SUF) LN_V2(3, T, SUF) LN_V2(4, T, SUF) \
    LN_V2(5, T, SUF) LN_V2(6, T, SUF) LN_V2(7, T, SUF) LN_V2(8, T, SUF)

// Stage 2 with the dx column sum: layernorm_backward_reduce_colsum_kernel_<dweight>_<dx_colsum>.
#define LN_REDUCE_COLSUM(TW, TC, SUF)                                                                       \
    extern "C" __global__ void __launch_bounds__(STAGE2_WARPS * 32) layernorm_backward_reduce_colsum_kernel_##SUF( \
        TW* dweight, TW* dbias, TC* dx_colsum, const float* scratch, int num_partials, int C) {             \
        layernorm_backward_reduce<TW, TC, true>(dweight, dbias, dx_colsum, scratch, num_partials, C);      \
    }

LN_V1(float, f32)
LN_V1(bf16, bf16)
LN_V2_ALL(float, f32)
LN_V2_ALL(bf16, bf16)

// The backward with 2 warps per row (layernorm_backward_v2's S = 2), for rows whose one-warp N
// would be large (gpucore/ops/layernorm.py: SPLIT_MIN_N): _s2 kernels, N the packs per lane of
// half a row. Launched with the grid the plain _s2 kernel's occupancy gives, as the S = 1 ones.
#define LN_V2_S2(N, T, SUF)                                                                     \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) layernorm_backward_kernel_v2_n##N##_s2_##SUF(     \
        float* scratch, T* dx, const T* dout, const T* x, const T* weight, const float* mean,              \
        const float* rstd, int rows, int C) {                                                               \
        layernorm_backward_v2<T, N, false, 2>(scratch, dx, dout, x, weight, mean, rstd, rows, C);          \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                \
        layernorm_backward_colsum_kernel_v2_n##N##_s2_##SUF(                                                \
        float* scratch, T* dx, const T* dout, const T* x, const T* weight, const float* mean,              \
        const float* rstd, int rows, int C) {                                                               \
        layernorm_backward_v2<T, N, true, 2>(scratch, dx, dout, x, weight, mean, rstd, rows, C);           \
    }
LN_V2_S2(1, float, f32) LN_V2_S2(2, float, f32) LN_V2_S2(3, float, f32) LN_V2_S2(4, float, f32)
LN_V2_S2(1, bf16, bf16) LN_V2_S2(2, bf16, bf16) LN_V2_S2(3, bf16, bf16) LN_V2_S2(4, bf16, bf16)
// (4 blocks per SM at N = 4 -- __launch_bounds__(128, 4): 128 registers, 116-132 bytes of spills --
// measured slower at 16384 x 1600: 83.0 against 70.7 us.)
LN_REDUCE_COLSUM(float, float, f32_f32)
LN_REDUCE_COLSUM(float, bf16, f32_bf16)
LN_REDUCE_COLSUM(bf16, float, bf16_f32)
LN_REDUCE_COLSUM(bf16, bf16, bf16_bf16)

// The FP8 forward (bf16 in, E4M3 out): layernorm_[residual_]forward_fp8_kernel_n<N>_r<ROWS>.
#define LN_FP8(N, R)                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) layernorm_forward_fp8_kernel_n##N##_r##R(                   \
        u8* out8, u8* out8_t, float* amax, float* mean, float* rstd, const bf16* x, const bf16* weight,     \
        const bf16* bias, const float* scale, const float* gate, int rows, int C, float eps) {              \
        layernorm_forward_fp8<N, R, false>(nullptr, out8, out8_t, amax, mean, rstd, x, nullptr, weight, bias,  \
                                        scale, gate, rows, C, eps);                                        \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256) layernorm_residual_forward_fp8_kernel_n##N##_r##R(          \
        bf16* residual, u8* out8, u8* out8_t, float* amax, float* mean, float* rstd, const bf16* a,         \
        const bf16* b, const bf16* weight, const bf16* bias, const float* scale, const float* gate,         \
        int rows, int C, float eps) {                                                                       \
        layernorm_forward_fp8<N, R, true>(residual, out8, out8_t, amax, mean, rstd, a, b, weight, bias,        \
                                       scale, gate, rows, C, eps);                                         \
    }
LN_FP8(1, 64) LN_FP8(2, 64) LN_FP8(3, 64) LN_FP8(4, 64) LN_FP8(5, 64) LN_FP8(6, 64) LN_FP8(7, 64) LN_FP8(8, 64)
LN_FP8(1, 32) LN_FP8(2, 32) LN_FP8(3, 32) LN_FP8(4, 32) LN_FP8(5, 32) LN_FP8(6, 32) LN_FP8(7, 32) LN_FP8(8, 32)
