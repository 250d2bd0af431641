/*
 * fp8.cu -- FP8 quantization for the FP8 GEMMs (Ada/Hopper, sm_89+): scaled, saturating casts of
 * a bf16 matrix to E4M3 (weights, activations) or E5M2 (gradients), row-major and/or transposed,
 * with the input's amax on the way; and the per-tensor scale update.
 *
 * Math: q = satfinite(round_to_nearest_even(float(x) * scale)) in the target format: |x * scale|
 *   beyond the largest finite value becomes +-max (E4M3 448, E5M2 57344), NaN stays NaN. The
 *   GEMM multiplies by scale_inv = 1 / scale to undo it. One fp32 product, one hardware rounding
 *   (cvt.rn.satfinite.{e4m3,e5m2}x2.f32): bit-exact with
 *   clip(f32(x) * f32(scale), -max, max).astype(ml_dtypes.float8_*) (ops/fp8.py's reference).
 * amax: max |x| of the input (before scaling), taken as the unsigned max of the bf16 bits with
 *   the sign cleared (non-negative floats order as their bits; NaN's bits are above +inf's, so a
 *   NaN wins and stays visible), folded into *amax with atomicMax: the same result in any
 *   order, so runs stay deterministic. A NaN amax makes the scale update keep the old scale;
 *   the caller's finite checks report the NaN.
 * Shapes: in (R, C) bf16 row-major, R and C multiples of 16 (the FP8 GEMM needs that anyway);
 *   out (R, C) fp8 and/or out_t (C, R) fp8 (either may be null). Grid: (C/64, R/CAST_ROWS) tiles of
 *   CAST_ROWS (128) x 64 (a smaller grid walks the tiles in a grid-stride loop: the gated re-cast's),
 *   256 threads; each thread loads CAST_ROWS/32 16-byte packs (8 columns of rows r, r + 32, ...),
 *   writes 8 fp8 bytes of `out` per pack, and (transposed) CAST_ROWS/64 blocks of 4 x 4 bytes of the
 *   tile in shared memory (store_block4_t).
 * fp8_cast_colsum_kernel_e5m2: the gradient cast that also writes each tile's column sums of its
 *   input (float32 partials, TileColsum's fixed tree; colsum.py's stage 2 adds them): a linear's
 *   bias gradient from the pass that casts its output gradient (dqkv's), not from a pass of its own.
 * fp8_transpose_kernel: FP8 bytes (R, C) -> (C, R), for operands that must be K-contiguous and
 *   were written the other way (the LM head's weight gradient: dlogits8 and lnf8, K = tokens).
 * fp8_gelu_cast_kernel_e4m3: the same cast of gelu(in) (gelu.cu's bf16 GELU, rounded to bf16 first):
 *   the fcproj input of FP8 training, made from fch without the bf16 GELU output ever existing.
 * _x8 kernels: the same, reading GELU's input kept as E4M3 bytes (settings.fp8_fch_e4m3), each value
 *   bf16(e4m3 * scale_inv) (fp8_cast.cuh dequant8_e4m3) before the bf16 path's arithmetic.
 * gate (optional): the cast runs only when *gate != 0 (adaptive scaling's re-cast, decided on the
 *   device by fp8_guard_kernel at the end of this file: no host sync).
 * Scale update (fp8_update_scale_kernel, one thread per tensor; tensor k's scale, scale_inv and amax
 *   at k * stride, one 16-byte slot each: cuBLASLt wants aligned scale pointers): history[h][k] = amax[k] for the
 *   step slot h, amax[k] = 0; m = max over the history of tensor k; when m is finite and > 0,
 *   scale[k] = fmax / m * 2^-margin and scale_inv[k] = 1 / scale[k]; otherwise both stay.
 *   "Delayed scaling" (Transformer Engine's recipe): this step's casts use the scale made from
 *   the last steps' amax.
 */
#include "common.cuh"
#include "fp8_cast.cuh"
#include "gelu_math.cuh"

#define TILE 64

// GELU of 8 bf16 (one pack), rounded back to bf16 exactly as gelu.cu's gelu_forward_kernel_bf16 writes it.
__device__ __forceinline__ uint4 gelu_pack8(uint4 p) {
    const u32 w[4] = {p.x, p.y, p.z, p.w};
    u32 o[4];
    #pragma unroll
    for (int i = 0; i < 4; i++)
        o[i] = cvt_rn_bf16x2(gelu_f<false>(__uint_as_float(w[i] << 16)), gelu_f<false>(__uint_as_float(w[i] & 0xffff0000u)));
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// The casts' tiles: CAST_ROWS rows x 64 columns. Shared memory holds a tile's FP8 bytes as rows of
// 16 words, word w of row r at r * 16 + (w ^ ((r / 4) % 16)): the XOR swizzle keeps both the row-wise
// stores and the transposed 4 x 4 gathers within two accesses per bank.
#ifndef CAST_ROWS
#define CAST_ROWS 128   // 128: 80-85% of the copy bandwidth on an H200, 64: 76-77% (tools/probes/fp8_cast_rows.py)
#endif
__device__ __forceinline__ int swz(int r, int w) { return r * 16 + (w ^ ((r >> 2) & 15)); }

// After a barrier: a TR-row tile's bytes (the swizzled words above) to out_t (C, R) in 4 x 4 blocks,
// by 256 threads: TR / 4 threads cover TR contiguous bytes of an out_t row, TR / 64 blocks each.
// R, C % 16 == 0: a block is all in or all out.
template <int TR>
__device__ __forceinline__ void tile_store_t(u8* __restrict__ out_t, const u32* tile, int t, int r0, int c0,
                                             int R, int C) {
    constexpr int RB = TR / 4;
    const int r4 = 4 * (t % RB);               // this thread's row block; its column blocks below
    #pragma unroll
    for (int j = 0; j < TR / 64; j++) {
        const int cb = t / RB + (256 / RB) * j, c4 = 4 * cb;
        if (c0 + c4 < C && r0 + r4 < R)
            store_block4_t(out_t, tile + swz(r4, cb), 16, R, c0 + c4, r0 + r4);   // rows r4.. share the swizzle
    }
}

// A TR-row tile's column sums (a bias gradient's stage 1, colsum.py's stage 2 adds the tiles in order)
// in a fixed tree, all 256 threads adding: each thread's 8 columns over its H rows in order
// (colsum_add), then 8 threads' sums in order, then the 4 eights in order. Deterministic.
struct TileColsum {
    float col32[32][TILE + 1];                 // per column, the sums of each thread's H rows; +1: no conflicts
    float col8[4][TILE];                       // ... of 8 consecutive such sums
};

// Row h of this thread's 8 columns (bf16 pairs d, as stored) into its sums.
__device__ __forceinline__ void colsum_add(float (&sum)[8], const u32 (&d)[4], int h) {
    #pragma unroll
    for (int k = 0; k < 4; k++) {
        const float lo = __uint_as_float(d[k] << 16), hi = __uint_as_float(d[k] & 0xffff0000u);
        sum[2 * k] = h ? __fadd_rn(sum[2 * k], lo) : lo;
        sum[2 * k + 1] = h ? __fadd_rn(sum[2 * k + 1], hi) : hi;
    }
}

// Before a barrier: this thread's sums into shared memory.
__device__ __forceinline__ void colsum_share(TileColsum& cs, const float (&sum)[8], int t, int col) {
    #pragma unroll
    for (int e = 0; e < 8; e++) cs.col32[t >> 3][col + e] = sum[e];
}

// After it: column t % 64, the sums of row groups 8 (t / 64) .. 8 (t / 64) + 7 in order.
__device__ __forceinline__ void colsum_eights(TileColsum& cs, int t) {
    const int c = t & (TILE - 1), q = t / TILE;
    float acc = cs.col32[8 * q][c];
    #pragma unroll
    for (int k = 1; k < 8; k++) acc = __fadd_rn(acc, cs.col32[8 * q + k][c]);
    cs.col8[q][c] = acc;
}

// After another barrier: the tile's 64 column sums into partials row ty.
__device__ __forceinline__ void colsum_write(float* partials, const TileColsum& cs, int t, int ty, int c0, int C) {
    if (t < TILE && c0 + t < C)
        partials[(long long)ty * C + c0 + t] =
            __fadd_rn(__fadd_rn(__fadd_rn(cs.col8[0][t], cs.col8[1][t]), cs.col8[2][t]), cs.col8[3][t]);
}

// GELU = true: the cast of gelu(in) (the fcproj input in FP8 training: gelu_forward followed by the cast,
// bit for bit, without writing or reading the bf16 GELU output). TR rows per tile: each thread casts
// TR / 32 packs (rows t/8 + 32 h), then stores TR / 64 transposed 4 x 4 blocks; TR / 4 threads cover
// TR contiguous bytes of an out_t row.
// COLSUM: also partials (ceil(R / TR), C) float32, each tile's column sums of in (the bf16 values
// read) by TileColsum's tree -- the qkv bias gradient from the dqkv cast, without a colsum pass
// reading dqkv again. A template flag: the sums cost the plain casts 12 registers (48 -> 60).
// X8: `in` holds E4M3 bytes (in8, (R, C) uint8) read as bf16(e4m3 * *in_si) (dequant8_e4m3): fch kept
// in E4M3 (settings.fp8_fch_e4m3); 8 bytes a pack instead of 16.
template <int FMT, bool GELU = false, bool COLSUM = false, int TR = CAST_ROWS, bool X8 = false>
__device__ void fp8_cast(u8* __restrict__ out, u8* __restrict__ out_t, float* __restrict__ amax,
                         float* __restrict__ partials, const bf16* __restrict__ in, const float* __restrict__ scale,
                         const float* __restrict__ gate, int R, int C,
                         const u8* __restrict__ in8 = nullptr, const float* __restrict__ in_si = nullptr) {
    static_assert(!(GELU && COLSUM), "the GELU cast sums nothing");
    static_assert(!(X8 && COLSUM), "E4M3 input: the GELU cast only");
    constexpr int H = TR / 32;                 // packs per thread
    __shared__ u32 tile[TR * 16];              // the cast bytes, for the transposed store
    __shared__ TileColsum cs;
    if (gate && *gate == 0.0f) return;         // the adaptive re-cast, not needed this time (block-uniform)
    const int t = threadIdx.x;
    const float s = *scale;
    const float si = X8 ? *in_si : 0.0f;
    const int col = (t & 7) * 8;               // 8 columns per pack
    u32 m = 0;
    // Tiles in a grid-stride loop: a full grid runs each block once; the gated re-cast is launched
    // on a capped grid, so that when the gate says no, few blocks start only to return. Tile rows
    // from the last (common.cuh from_last): `in` is what a GEMM or the attention backward just wrote.
    for (int ty = from_last(blockIdx.y, (R + TR - 1) / TR); ty >= 0; ty -= gridDim.y)
    for (int tx = blockIdx.x; tx * TILE < C; tx += gridDim.x) {
    const int r0 = ty * TR, c0 = tx * TILE;
    if (out_t || COLSUM) __syncthreads();      // the last tile's shared reads are done
    uint4 p[H];
    uint2 p8[H];                               // X8: the raw bytes, turned into bf16 packs after all loads
    #pragma unroll
    for (int h = 0; h < H; h++) {              // all loads first: H packs in flight
        const long long r = r0 + (t >> 3) + 32 * h;
        if (COLSUM) p[h] = make_uint4(0u, 0u, 0u, 0u);   // zero past the edges: the sums ignore them
        if (r < R && c0 + col < C) {
            if constexpr (X8) p8[h] = __ldcs(reinterpret_cast<const uint2*>(in8 + r * C + c0 + col));
            else p[h] = __ldcs(reinterpret_cast<const uint4*>(in + r * C + c0 + col));
        }
    }
    float sum[8];                              // partials: this thread's 8 columns over its H rows
    #pragma unroll
    for (int h = 0; h < H; h++) {
        const int row = (t >> 3) + 32 * h;
        const long long r = r0 + row;
        if (r < R && c0 + col < C) {           // C % 16 == 0: a pack is all in or all out
            if constexpr (X8) p[h] = dequant8_e4m3(p8[h], si);
            const uint2 q = quantize8<FMT>(GELU ? gelu_pack8(p[h]) : p[h], s, m);
            tile[swz(row, col / 4)] = q.x;
            tile[swz(row, col / 4 + 1)] = q.y;
            if (out) *reinterpret_cast<uint2*>(out + r * C + c0 + col) = q;
        }
        if constexpr (COLSUM) {
            const u32 d[4] = {p[h].x, p[h].y, p[h].z, p[h].w};
            colsum_add(sum, d, h);
        }
    }
    if constexpr (COLSUM) colsum_share(cs, sum, t, col);
    if (out_t || COLSUM) __syncthreads();
    if constexpr (COLSUM) colsum_eights(cs, t);
    if (out_t) tile_store_t<TR>(out_t, tile, t, r0, c0, R, C);
    if constexpr (COLSUM) {
        __syncthreads();
        colsum_write(partials, cs, t, ty, c0, C);
    }
    }                                          // the tile loop
    if (amax) block_amax(amax, m);
}

extern "C" __global__ void __launch_bounds__(256) fp8_cast_kernel_e4m3(
        u8* out, u8* out_t, float* amax,      // (R, C) | null, (C, R) | null, (1,) | null
        const bf16* in, const float* scale,   // (R, C), (1,)
        const float* gate,                    // (1,) | null: cast only when *gate != 0
        int R, int C) {
    fp8_cast<E4M3>(out, out_t, amax, nullptr, in, scale, gate, R, C);
}

extern "C" __global__ void __launch_bounds__(256) fp8_cast_kernel_e5m2(
        u8* out, u8* out_t, float* amax,      // (R, C) | null, (C, R) | null, (1,) | null
        const bf16* in, const float* scale,   // (R, C), (1,)
        const float* gate,                    // (1,) | null: cast only when *gate != 0
        int R, int C) {
    fp8_cast<E5M2>(out, out_t, amax, nullptr, in, scale, gate, R, C);
}

// The gradient cast that also sums the columns (a bias gradient's stage 1): the dqkv cast.
extern "C" __global__ void __launch_bounds__(256) fp8_cast_colsum_kernel_e5m2(
        u8* out, u8* out_t, float* amax,      // (R, C) | null, (C, R) | null, (1,) | null
        float* partials,                      // (ceil(R / CAST_ROWS), C): the tiles' column sums of in
        const bf16* in, const float* scale,   // (R, C), (1,)
        int R, int C) {
    fp8_cast<E5M2, false, true>(out, out_t, amax, partials, in, scale, nullptr, R, C);
}

extern "C" __global__ void __launch_bounds__(256) fp8_gelu_cast_kernel_e4m3(
        u8* out, u8* out_t, float* amax,      // (R, C) | null, (C, R) | null, (1,) | null: of gelu(in)
        const bf16* in, const float* scale,   // (R, C): GELU's input (fch), (1,)
        const float* gate,                    // (1,) | null: cast only when *gate != 0
        int R, int C) {
    fp8_cast<E4M3, true>(out, out_t, amax, nullptr, in, scale, gate, R, C);
}

extern "C" __global__ void __launch_bounds__(256) fp8_gelu_cast_kernel_e4m3_x8(
        u8* out, u8* out_t, float* amax,      // as fp8_gelu_cast_kernel_e4m3
        const u8* in8, const float* in_si,    // (R, C) E4M3 bytes of GELU's input (fch), (1,) their scale_inv
        const float* scale, const float* gate, int R, int C) {
    fp8_cast<E4M3, true, false, CAST_ROWS, true>(out, out_t, amax, nullptr, nullptr, scale, gate, R, C, in8, in_si);
}

// FP8 bytes transposed: out (C, R) = in (R, C)^T, uint8 row-major, R and C multiples of 16. The
// FP8 GEMM takes both operands K-contiguous; the LM head's dwte = dlogits^T @ lnf sums over tokens,
// and dlogits8 / lnf8 are written token-major, so each chunk's bytes are turned around here (1 byte
// read and 1 written per value: half a bf16 cast's traffic). Tiles of 64 rows x 64 CT columns
// (grid-stride, as fp8_cast), 256 threads: thread t loads CT 16-byte packs of row t/4 (all in flight
// at once) into shared memory as words (row stride 16 CT + 1 words: the gathers below meet each bank
// at most twice), then stores CT blocks of 4 x 4 bytes at rows 4 (t % 16).., columns 4 (t / 16) + 64 h
// transposed (store_block4_t).
#define TRANSPOSE_CT 2                         // 64-column tiles per block (ops/fp8.py TRANSPOSE_TILES)

template <int CT>
__device__ void fp8_transpose(u8* __restrict__ out, const u8* __restrict__ in, int R, int C) {
    constexpr int TC = TILE * CT, SW = TC / 4 + 1;   // tile columns (bytes), row stride (words)
    __shared__ u32 tile[TILE * SW];
    const int t = threadIdx.x;
    for (int ty = from_last(blockIdx.y, (R + TILE - 1) / TILE); ty >= 0; ty -= gridDim.y)   // from the last
    for (int tx = blockIdx.x; tx * TC < C; tx += gridDim.x) {
        const int r0 = ty * TILE, c0 = tx * TC;
        __syncthreads();                       // the last tile's gathers are done
        const int row = t >> 2;
        uint4 p[CT];
        #pragma unroll
        for (int h = 0; h < CT; h++) {         // C % 16 == 0: a pack is all in or all out
            const int c = c0 + (t & 3) * 16 + TILE * h;
            if (r0 + row < R && c < C) p[h] = __ldcs(reinterpret_cast<const uint4*>(in + (long long)(r0 + row) * C + c));
        }
        #pragma unroll
        for (int h = 0; h < CT; h++) {
            u32* w = tile + row * SW + (t & 3) * 4 + 16 * h;
            w[0] = p[h].x; w[1] = p[h].y; w[2] = p[h].z; w[3] = p[h].w;   // unloaded packs: never gathered
        }
        __syncthreads();
        const int r4 = (t & 15) * 4;
        #pragma unroll
        for (int h = 0; h < CT; h++) {
            const int c4 = (t >> 4) * 4 + TILE * h;
            if (r0 + r4 < R && c0 + c4 < C)    // R, C % 16 == 0: all four rows / columns were loaded
                store_block4_t(out, tile + r4 * SW + c4 / 4, SW, R, c0 + c4, r0 + r4);
        }
    }
}

// CT = 2: 77.6% of the copy bandwidth on an H200 at the LM head's chunk (8192 x 50304), against
// 71.3% for CT = 1 and 76.3% for CT = 4 (tools/probes/fp8_transpose.py, tools/notes/fp8.md).
extern "C" __global__ void __launch_bounds__(256) fp8_transpose_kernel(
        u8* out, const u8* in, int R, int C) {   // (C, R), (R, C)
    fp8_transpose<TRANSPOSE_CT>(out, in, R, C);
}

// GELU's backward, fused with the cast of its result (the MLP's fc output gradient in FP8 training):
// dx = gelu'(x) * dout rounded to bf16 exactly as gelu.cu's gelu_backward_kernel_bf16 writes it, then
// cast as fp8_cast casts a bf16 matrix -- so out / out_t / amax are the bits of gelu_backward followed
// by fp8_cast, without writing dx or reading it back. partials (ceil(R / TR), C) float32, optional: each
// TR-row tile's column sums of dx (the bf16 values) in a fixed tree -- a thread's H rows in order, 8
// threads' sums in order, the 4 eights in order -- so deterministic, with all 256 threads adding
// (64 threads each adding a column's rows one after another had left the block mostly idle); the
// Python side adds them over tiles in order (colsum's stage 2) into the fc bias gradient. Same tiles
// (TR = GELU_BWD_ROWS rows), threads and gate as fp8_cast.
// gelu_t (C, R) E4M3, optional (with gelu_scale): also gelu(x)'s bytes transposed, scaled by
// *gelu_scale -- the bits fp8_gelu_cast_kernel_e4m3 writes to out_t -- from the x this pass reads
// anyway: fcproj's transposed input, when the model did not keep it (its weight gradient runs after
// this kernel). No amax: the forward's scale is reused, as the standalone recompute did.
// Its own shared tile (8 KB more), stored after the gradient's.
#ifndef GELU_BWD_ROWS
#define GELU_BWD_ROWS 128   // 128: 82.8% of the copy bandwidth on an H200, 64: 75.6% (tools/probes/fp8_cast_rows.py)
#endif
// X8: x holds E4M3 bytes (x8, (R, C) uint8) read as bf16(e4m3 * *x_si), as fp8_cast's X8.
template <int FMT, int TR = GELU_BWD_ROWS, bool X8 = false>
__device__ void fp8_gelu_backward(u8* __restrict__ out, u8* __restrict__ out_t, float* __restrict__ amax,
                                  float* __restrict__ partials, const bf16* __restrict__ dout,
                                  const bf16* __restrict__ x, const float* __restrict__ scale,
                                  const float* __restrict__ gate, u8* __restrict__ gelu_t,
                                  const float* __restrict__ gelu_scale, int R, int C,
                                  const u8* __restrict__ x8 = nullptr, const float* __restrict__ x_si = nullptr) {
    constexpr int H = TR / 32;                 // as fp8_cast
    __shared__ u32 tile[TR * 16];              // swizzled as fp8_cast's
    __shared__ u32 gtile[TR * 16];             // gelu(x)'s bytes, the same way (gelu_t only)
    __shared__ TileColsum cs;
    if (gate && *gate == 0.0f) return;         // block-uniform
    const int t = threadIdx.x;
    const float s = *scale;
    const float gs = gelu_t ? *gelu_scale : 0.0f;
    const float xsi = X8 ? *x_si : 0.0f;
    const int col = (t & 7) * 8;
    u32 m = 0;
    // fp8_cast's tile loop, in row order: tile rows from the last (as fp8_cast) spilled at this
    // kernel's register cap (80, 16 B of stack on sm_90)
    for (int ty = blockIdx.y; ty * TR < R; ty += gridDim.y)
    for (int tx = blockIdx.x; tx * TILE < C; tx += gridDim.x) {
    const int r0 = ty * TR, c0 = tx * TILE;
    if (out_t || partials || gelu_t) __syncthreads();   // the last tile's shared reads are done
    uint4 gp[H], vp[H];
    uint2 vp8[H];                              // X8: x's raw bytes, turned into bf16 packs after all loads
    #pragma unroll
    for (int h = 0; h < H; h++) {              // all loads first
        const long long r = r0 + (t >> 3) + 32 * h;
        if (r < R && c0 + col < C) {
            gp[h] = __ldcs(reinterpret_cast<const uint4*>(dout + r * C + c0 + col));
            if constexpr (X8) vp8[h] = __ldcs(reinterpret_cast<const uint2*>(x8 + r * C + c0 + col));
            else vp[h] = __ldcs(reinterpret_cast<const uint4*>(x + r * C + c0 + col));
        }
    }
    float sum[8];                              // this thread's 8 columns summed over its H rows, as stored
    #pragma unroll
    for (int h = 0; h < H; h++) {
        const int row = (t >> 3) + 32 * h;
        const long long r = r0 + row;
        u32 d[4] = {0u, 0u, 0u, 0u};           // dx as bf16 pairs; zero past the edges (sums ignore them)
        if (r < R && c0 + col < C) {
            if constexpr (X8) vp[h] = dequant8_e4m3(vp8[h], xsi);
            const u32 gw[4] = {gp[h].x, gp[h].y, gp[h].z, gp[h].w}, vw[4] = {vp[h].x, vp[h].y, vp[h].z, vp[h].w};
            #pragma unroll
            for (int k = 0; k < 4; k++)
                d[k] = cvt_rn_bf16x2(gelu_grad_f<false>(__uint_as_float(vw[k] << 16), __uint_as_float(gw[k] << 16)),
                                     gelu_grad_f<false>(__uint_as_float(vw[k] & 0xffff0000u),
                                                        __uint_as_float(gw[k] & 0xffff0000u)));
            const uint2 q = quantize8<FMT>(make_uint4(d[0], d[1], d[2], d[3]), s, m);
            tile[swz(row, col / 4)] = q.x;
            tile[swz(row, col / 4 + 1)] = q.y;
            if (out) *reinterpret_cast<uint2*>(out + r * C + c0 + col) = q;
            if (gelu_t) {
                u32 unused = 0;                // no amax of gelu(x): its scale is the forward's
                const uint2 gq = quantize8<E4M3>(gelu_pack8(vp[h]), gs, unused);
                gtile[swz(row, col / 4)] = gq.x;
                gtile[swz(row, col / 4 + 1)] = gq.y;
            }
        }
        colsum_add(sum, d, h);
    }
    if (partials) colsum_share(cs, sum, t, col);
    if (out_t || partials || gelu_t) __syncthreads();
    if (partials) colsum_eights(cs, t);
    if (out_t) tile_store_t<TR>(out_t, tile, t, r0, c0, R, C);
    if (gelu_t) tile_store_t<TR>(gelu_t, gtile, t, r0, c0, R, C);
    if (partials) {
        __syncthreads();
        colsum_write(partials, cs, t, ty, c0, C);
    }
    }                                          // the tile loop
    if (amax) block_amax(amax, m);
}

extern "C" __global__ void __launch_bounds__(256, GELU_BWD_ROWS == 64 ? 4 : 3) fp8_gelu_backward_kernel_e5m2(
        u8* out, u8* out_t, float* amax, float* partials,   // (R, C) | null, (C, R) | null, (1,) | null, (R/64, C) | null
        const bf16* dout, const bf16* x,                    // (R, C) x 2: GELU's output gradient and input
        const float* scale, const float* gate,              // (1,), (1,) | null
        u8* gelu_t, const float* gelu_scale,                // (C, R) | null, (1,) | null: E4M3 gelu(x)^T
        int R, int C) {
    fp8_gelu_backward<E5M2>(out, out_t, amax, partials, dout, x, scale, gate, gelu_t, gelu_scale, R, C);
}

extern "C" __global__ void __launch_bounds__(256, GELU_BWD_ROWS == 64 ? 4 : 3) fp8_gelu_backward_kernel_e5m2_x8(
        u8* out, u8* out_t, float* amax, float* partials,   // as fp8_gelu_backward_kernel_e5m2
        const bf16* dout, const u8* x8, const float* x_si,  // (R, C) bf16, (R, C) E4M3 bytes of GELU's input, (1,)
        const float* scale, const float* gate, u8* gelu_t, const float* gelu_scale, int R, int C) {
    fp8_gelu_backward<E5M2, GELU_BWD_ROWS, true>(out, out_t, amax, partials, dout, nullptr, scale, gate, gelu_t,
                                                 gelu_scale, R, C, x8, x_si);
}

// amax only (current scaling: the scale of this very tensor before its cast). Grid-stride over
// 16-byte packs; n % 8 == 0.
extern "C" __global__ void __launch_bounds__(256) fp8_amax_kernel(
        float* amax, const bf16* in, long long n) {   // (1,), (n,)
    u32 m = 0;
    for (long long i = (long long)(blockIdx.x * blockDim.x + threadIdx.x) * 8; i < n;
         i += (long long)gridDim.x * blockDim.x * 8) {
        const uint4 p = __ldcs(reinterpret_cast<const uint4*>(in + i));
        m = __vmaxu2(__vmaxu2(m, p.x & 0x7fff7fffu), p.y & 0x7fff7fffu);
        m = __vmaxu2(__vmaxu2(m, p.z & 0x7fff7fffu), p.w & 0x7fff7fffu);
    }
    block_amax(amax, m);
}

extern "C" __global__ void fp8_update_scale_kernel(
        float* scale, float* scale_inv, float* amax, float* history,   // (K, stride) x 3, (H, K)
        const float* fmax, int K, int H, int slot, float margin_scale,  // (K,): each tensor's format max
        int stride) {                                                    // floats between two tensors' values
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= K) return;
    scale += (long long)k * stride;
    scale_inv += (long long)k * stride;
    amax += (long long)k * stride;
    history[(long long)slot * K + k] = *amax;
    *amax = 0.0f;
    float m = 0.0f;
    bool bad = false;
    for (int h = 0; h < H; h++) {
        const float a = history[(long long)h * K + k];
        bad |= !(a <= 3.0e38f);              // NaN or inf
        m = fmaxf(m, a);
    }
    if (!bad && m > 0.0f) {
        const float s = fmax[k] / m * margin_scale;
        *scale = s;
        *scale_inv = 1.0f / s;
    }
}

// Adaptive scaling's check, one thread, after a cast made with the delayed scale (this step's
// scale from the last step's amax) that took its own amax into *cast_amax: fold it into the
// step's *amax (bit max: a NaN stays visible) and clear it; when that amax left the scale's window
// -- some value saturated (a * scale > fmax) or the data sits more than `window` binades below the
// target headroom (a * scale < fmax * low) -- set the scale from it (as current scaling would) and
// *gate = 1, so the gated re-cast that follows runs; else *gate = 0 and the re-cast returns at once.
// A non-finite or zero amax keeps the scale (the caller's finite checks report a NaN).
// Prediction (p0, p1 >= 0; Fp8Scaling.cast(predict=)): tensors p0 and p1, cast later in this step,
// move with this one (tensor i: a backward gradient, and the gradients cast next in the same
// residual stream), so their scales are set as if their amax changed since the last step by this
// cast's factor, a / hist[i]: scale = fmax / (hist[p] * (a / hist[i])) * margin_scale. Their own
// guards still check them; on spiky data most of their re-casts no longer happen (68th session).
// Skipped when a, hist[i] or the product is zero or not finite (the first step has no history).
// slots: Fp8Scaling's (5, n, SLOT) floats, planes `plane` floats apart -- 0 scale, 1 scale_inv,
// 2 the step's amax, 3 the cast's amax (column 0) and the gate (column 1) -- tensor p's slot at
// p * stride in each; hist: last step's amax of every tensor (the one-row history of adaptive mode).
extern "C" __global__ void fp8_guard_kernel(
        float* slots, const float* hist, float fmax, float margin_scale, float low,
        int plane, int stride, int i, int p0, int p1) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    float* const slot = slots + (long long)i * stride;
    float* const scale = slot;
    float* const scale_inv = slot + plane;
    float* const amax = slot + 2 * (long long)plane;
    float* const cast_amax = slot + 3 * (long long)plane;
    float* const gate = cast_amax + 1;
    const float a = *cast_amax;
    *cast_amax = 0.0f;
    u32* am = reinterpret_cast<u32*>(amax);
    *am = max(*am, __float_as_uint(a));
    const float s = *scale;
    const bool recast = a <= 3.0e38f && a > 0.0f && (a * s > fmax || a * s < fmax * low);
    if (recast) {
        const float ns = fmax / a * margin_scale;
        *scale = ns;
        *scale_inv = 1.0f / ns;
    }
    *gate = recast ? 1.0f : 0.0f;
    if (p0 < 0) return;
    const float hi = hist[i];
    if (!(a <= 3.0e38f && a > 0.0f && hi <= 3.0e38f && hi > 0.0f)) return;
    const float ratio = a / hi;
    const int targets[2] = {p0, p1};
    #pragma unroll
    for (int t = 0; t < 2; t++) {
        const int p = targets[t];
        if (p < 0) continue;
        const float m = hist[p] * ratio;
        if (m <= 3.0e38f && m > 0.0f) {
            const float ps = fmax / m * margin_scale;
            slots[(long long)p * stride] = ps;
            slots[plane + (long long)p * stride] = 1.0f / ps;
        }
    }
}
