/*
 * encoder.cu -- GPT-2 input embedding: token embedding + position embedding.
 *
 * Math:  forward   out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]
 *        backward  dwpe[t, :] += sum_b dout[b, t, :]
 *                  dwte[v, :] += sum over (b, t) with tokens[b, t] == v of dout[b, t, :]
 * Shapes: tokens (B, T) int32 in [0, V) (checked by the launcher), wte/dwte
 *   (V, C), wpe/dwpe (maxT, C) with T <= maxT, out/dout (B, T, C); N = B*T.
 * Gradient rule: dwte, dwpe are parameter gradients (+=), fp32 sums rounded
 *   once into T.
 *
 * Determinism (no float atomics): every sum runs in a fixed order.
 *   dwpe: a thread owns (t, a W-column slice) and loops over b in order.
 *   dwte: the launcher sorts the unique keys tokens[n] * N + n on the device
 *     (preprocessing only), giving `order` (row of each sorted position) and
 *     `sorted_tokens`; each token's rows are then one segment of the sorted
 *     positions, in position order. The sorted positions are cut into fixed
 *     chunks of CHUNK; one block per (chunk, column slice) walks its CHUNK
 *     rows in order (load-balanced whatever the token frequencies are):
 *       - a segment that starts and ends inside the chunk is summed and added
 *         straight into dwte (no other block touches that token);
 *       - the run at the chunk's start that continues a segment from an
 *         earlier chunk is stored as the chunk's "head" partial (slot 0);
 *       - a run that starts in the chunk and continues past its end is stored
 *         as the "tail" partial (slot 1).
 *     dwte_merge then lets the chunk where each long segment starts add its
 *     tail partial and the head partials of the following chunks, in chunk
 *     order, into dwte. scratch is (num_chunks, 2, C) fp32; only slots that
 *     are written are read.
 *
 * Versions: v2 moves W = 16/sizeof(T) elements per access (C a multiple of W,
 * 16-byte aligned arrays); v1 (W = 1) takes any C and alignment. One thread
 * owns W consecutive columns of a row.
 * v3 (v2's conditions; dwte only -- forward and dwpe are v2's kernels): the
 *   same chunked scheme and summation order as v2 (bit-identical results), but
 *   - v2's Vec<bf16, 8> was split into 16-bit registers right after each load
 *     (PRMTs waiting on the load), so the UNROLL loads of a thread ran one
 *     after another: 23% of copy. v3 keeps 16-byte packs as raw uint4 words
 *     (fast_packs.cuh) until they are summed: all UNROLL loads in flight;
 *   - the sort keys are (token << bits) | position, 32-bit whenever they fit,
 *     made by one kernel and sorted in place (encoder.py), and the kernels
 *     decode them: no int64 keys and no 8 elementwise passes around the sort;
 *   - the merge knows each chain's last chunk before summing (the chunks a
 *     run reaches are consecutive: a warp ballot finds them 32 at a time), so
 *     its loads do not wait on the previous ones; a thread owns 4 fp32
 *     columns and keeps MERGE_UNROLL partials in flight.
 */
#include "common.cuh"
#include "fast_packs.cuh"

#define UNROLL 8        // rows in flight per thread (dwpe, dwte)
#define CHUNK 64        // sorted positions per dwte block (encoder.py: DWTE_CHUNK)

// W consecutive elements; a 16-byte Vec is loaded/stored with one 128-bit access.
template <typename T, int W>
struct __align__(W * sizeof(T)) Vec {
    T v[W];
};

// 16-byte Vecs move through an int4, as common.cuh's load16: ptxas then keeps
// 8 bf16 in 4 registers instead of one register per element.
template <typename T, int W>
__device__ __forceinline__ Vec<T, W> load_vec(const T* p) {
    if constexpr (sizeof(Vec<T, W>) == 16) {
        const int4 raw = *reinterpret_cast<const int4*>(p);
        return *reinterpret_cast<const Vec<T, W>*>(&raw);
    } else {
        return *reinterpret_cast<const Vec<T, W>*>(p);
    }
}

template <typename T, int W>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, W>& x) {
    if constexpr (sizeof(Vec<T, W>) == 16) {
        *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(&x);
    } else {
        *reinterpret_cast<Vec<T, W>*>(p) = x;
    }
}

// dst[0:W] = round(float(dst) + acc), a read-modify-write of W elements.
template <typename T, int W>
__device__ __forceinline__ void add_into(T* dst, const Vec<T, W>& old, const float (&acc)[W]) {
    Vec<T, W> r;
    #pragma unroll
    for (int k = 0; k < W; k++) r.v[k] = from_float<T>(to_float(old.v[k]) + acc[k]);
    store_vec<T, W>(dst, r);
}

// ------------------------------------------------------------- forward -------

// One thread per W columns of one (b, t) row.
template <typename T, int W>
__device__ void encoder_forward(T* out, const int* tokens, const T* wte, const T* wpe,   // (B,T,C) (B,T) (V,C) (maxT,C)
                                int N, int T_, int C) {
    const int CW = C / W;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= N * CW) return;
    const int bt = idx / CW, col = (idx - bt * CW) * W;
    const int t = bt % T_;
    const Vec<T, W> a = load_vec<T, W>(wte + (size_t)tokens[bt] * C + col);
    const Vec<T, W> p = load_vec<T, W>(wpe + (size_t)t * C + col);
    Vec<T, W> r;
    #pragma unroll
    for (int k = 0; k < W; k++) r.v[k] = from_float<T>(to_float(a.v[k]) + to_float(p.v[k]));
    store_vec<T, W>(out + (size_t)bt * C + col, r);
}

// ------------------------------------------------------------ backward -------

// One thread per (t, W columns); sums b = 0, 1, ..., B-1 in order, UNROLL rows in flight.
template <typename T, int W>
__device__ void encoder_backward_dwpe(T* dwpe, const T* dout, int B, int T_, int C) {   // (maxT,C) (B,T,C)
    const int CW = C / W;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= T_ * CW) return;
    const int t = idx / CW, col = (idx - t * CW) * W;
    const size_t stride = (size_t)T_ * C;      // from (b, t) to (b + 1, t)
    const T* src = dout + (size_t)t * C + col;
    float acc[W];
    #pragma unroll
    for (int k = 0; k < W; k++) acc[k] = 0.0f;
    for (int b0 = 0; b0 < B; b0 += UNROLL) {
        Vec<T, W> g[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; u++)
            if (b0 + u < B) g[u] = load_vec<T, W>(src + (b0 + u) * stride);
        #pragma unroll
        for (int u = 0; u < UNROLL; u++)
            if (b0 + u < B) {
                #pragma unroll
                for (int k = 0; k < W; k++) acc[k] += to_float(g[u].v[k]);
            }
    }
    T* dst = dwpe + (size_t)t * C + col;
    add_into<T, W>(dst, load_vec<T, W>(dst), acc);
}

// Stage 1 of dwte: block (chunk = blockIdx.x, column slice = blockIdx.y), one
// thread per W columns, walking sorted positions [chunk*CHUNK, +CHUNK) in order.
template <typename T, int W>
__device__ void encoder_backward_dwte(T* dwte, float* scratch, const T* dout,         // (V,C) (chunks,2,C) (N,C)
                                      const int* order, const int* sorted_tokens,     // (N,) (N,)
                                      int N, int C) {
    // The chunk's rows, and its tokens with one neighbour on each side (-1 past
    // either end of the array; real tokens are >= 0), staged once per block.
    __shared__ int s_row[CHUNK], s_tok[CHUNK + 2];
    const int chunk = blockIdx.x;
    const int start = chunk * CHUNK, len = min(CHUNK, N - start);
    for (int i = threadIdx.x; i < CHUNK + 2; i += blockDim.x) {
        const int p = start - 1 + i;
        s_tok[i] = (p >= 0 && p < N) ? sorted_tokens[p] : -1;
    }
    for (int i = threadIdx.x; i < len; i += blockDim.x) s_row[i] = order[start + i];
    __syncthreads();
    const int cw = blockIdx.y * blockDim.x + threadIdx.x;
    if (cw >= C / W) return;                  // no barriers below
    const int col = cw * W;
    // s_tok[li + 1] is the token of sorted position start + li.
    const bool head_cont = s_tok[0] == s_tok[1];  // the first segment began in an earlier chunk
    float acc[W];
    #pragma unroll
    for (int k = 0; k < W; k++) acc[k] = 0.0f;

    for (int l0 = 0; l0 < len; l0 += UNROLL) {
        // Load phase: UNROLL dout rows, and the dwte row of every segment that
        // ends here complete, so that no load waits behind a flush.
        Vec<T, W> g[UNROLL], d[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int li = l0 + u;
            if (li < len) {
                g[u] = load_vec<T, W>(dout + (size_t)s_row[li] * C + col);
                const int tok = s_tok[li + 1];
                if (s_tok[li + 2] != tok && !(head_cont && tok == s_tok[1]))
                    d[u] = load_vec<T, W>(dwte + (size_t)tok * C + col);
            }
        }
        // Sum phase, in sorted-position order; flush where a run ends.
        #pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int li = l0 + u;
            if (li >= len) continue;
            #pragma unroll
            for (int k = 0; k < W; k++) acc[k] += to_float(g[u].v[k]);
            const int tok = s_tok[li + 1];
            const bool last = li + 1 == len;
            const bool cont_after = s_tok[li + 2] == tok;              // only possible when last
            if (!last && cont_after) continue;                         // the run goes on
            const bool cont_before = head_cont && tok == s_tok[1];     // the chunk's first run
            if (!cont_before && !cont_after) {                         // a whole segment: ours alone
                add_into<T, W>(dwte + (size_t)tok * C + col, d[u], acc);
            } else {                                                   // slot 0 head, slot 1 tail
                Vec<float, W> s;
                #pragma unroll
                for (int k = 0; k < W; k++) s.v[k] = acc[k];
                store_vec<float, W>(scratch + ((size_t)chunk * 2 + (cont_before ? 0 : 1)) * C + col, s);
            }
            #pragma unroll
            for (int k = 0; k < W; k++) acc[k] = 0.0f;
        }
    }
}

// Stage 2 of dwte: the chunk in which a segment that crosses a chunk boundary
// starts adds its tail partial plus the head partials of the chunks the
// segment reaches, in chunk order (UNROLL chunks' partials in flight).
template <typename T, int W>
__device__ void encoder_backward_dwte_merge(T* dwte, const float* scratch,            // (V,C) (chunks,2,C)
                                            const int* sorted_tokens,                 // (N,)
                                            int N, int C, int num_chunks) {
    const int cw = blockIdx.y * blockDim.x + threadIdx.x;
    if (cw >= C / W) return;
    const int col = cw * W;
    const int chunk = blockIdx.x;
    const int start = chunk * CHUNK, end = min(start + CHUNK, N);
    if (end >= N) return;                                   // nothing goes past the last chunk
    const int tok = sorted_tokens[end - 1];
    if (sorted_tokens[end] != tok) return;                  // the last run ends in this chunk
    if (start > 0 && sorted_tokens[start] == tok && sorted_tokens[start - 1] == tok)
        return;                                             // began in an earlier chunk: not ours
    float acc[W];
    {
        const Vec<float, W> s = load_vec<float, W>(scratch + ((size_t)chunk * 2 + 1) * C + col);
        #pragma unroll
        for (int k = 0; k < W; k++) acc[k] = s.v[k];
    }
    bool done = false;
    for (int j0 = chunk + 1; !done; j0 += UNROLL) {
        // The chain always ends by the last chunk, whose end is N.
        Vec<float, W> p[UNROLL];
        bool more[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int j = j0 + u;
            more[u] = false;
            if (j < num_chunks) {
                p[u] = load_vec<float, W>(scratch + (size_t)j * 2 * C + col);
                const int jend = min((j + 1) * CHUNK, N);
                more[u] = jend < N && sorted_tokens[jend] == tok;
            }
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (done) break;
            #pragma unroll
            for (int k = 0; k < W; k++) acc[k] += p[u].v[k];
            done = !more[u];
        }
    }
    T* dst = dwte + (size_t)tok * C + col;
    add_into<T, W>(dst, load_vec<T, W>(dst), acc);
}

// ------------------------------------------------------------- v3 ----------

#define MERGE_UNROLL 16   // scratch partials in flight per thread in the v3 merge
// U = rows in flight per thread in the v3 chunk kernel. The default 4, not v2's 8: ~62
// registers let 10 blocks of 96 threads share an SM, so the 1024 chunks of B*T = 65536
// run in one wave (U = 8: ~100 registers, 6 blocks/SM, 1.3 waves and a thin tail),
// still with ~60 KB of loads in flight per SM. U = 8 is instantiated too, for the bench.

// keys[n] = (tokens[n] << bits) | n: sorted, they order the positions by (token, position).
template <typename Key>
__device__ void encoder_sort_keys(Key* keys, const int* tokens, int N, int bits) {   // (N,) (N,)
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n < N) keys[n] = ((Key)(u32)tokens[n] << bits) | (Key)(u32)n;
}

template <typename Key>
__device__ __forceinline__ int key_token(const Key* keys, int p, int N, int bits) {   // -1 past either end
    return (p >= 0 && p < N) ? (int)(keys[p] >> bits) : -1;
}

// Stage 1, v2's scheme and order (see encoder_backward_dwte): block (chunk, column slice),
// one thread per 16-byte pack of columns.
template <typename T, typename Key, int V3_UNROLL>
__device__ void encoder_backward_dwte_v3(T* dwte, float* scratch, const T* dout,   // (V,C) (chunks,2,C) (N,C)
                                         const Key* keys, int N, int C, int bits) { // (N,) sorted
    using R = Raw<T>;
    constexpr int P = R::P;
    __shared__ int s_row[CHUNK], s_tok[CHUNK + 2];
    const int chunk = blockIdx.x;
    const int start = chunk * CHUNK, len = min(CHUNK, N - start);
    const Key mask = ((Key)1 << bits) - 1;
    for (int i = threadIdx.x; i < CHUNK + 2; i += blockDim.x) s_tok[i] = key_token(keys, start - 1 + i, N, bits);
    for (int i = threadIdx.x; i < len; i += blockDim.x) s_row[i] = (int)(keys[start + i] & mask);
    __syncthreads();
    const int CP = C / P;                        // packs per row
    const int cw = blockIdx.y * blockDim.x + threadIdx.x;
    if (cw >= CP) return;                        // no barriers below
    const uint4* src = reinterpret_cast<const uint4*>(dout) + cw;
    uint4* dst = reinterpret_cast<uint4*>(dwte) + cw;
    const bool head_cont = s_tok[0] == s_tok[1];
    float acc[P];
    #pragma unroll
    for (int e = 0; e < P; e++) acc[e] = 0.0f;

    for (int l0 = 0; l0 < len; l0 += V3_UNROLL) {
        uint4 g[V3_UNROLL], d[V3_UNROLL];
        #pragma unroll
        for (int u = 0; u < V3_UNROLL; u++) {       // every load first: V3_UNROLL rows (+ dwte rows) in flight
            const int li = l0 + u;
            if (li < len) {
                g[u] = src[(size_t)s_row[li] * CP];
                const int tok = s_tok[li + 1];
                if (s_tok[li + 2] != tok && !(head_cont && tok == s_tok[1])) d[u] = dst[(size_t)tok * CP];
            }
        }
        #pragma unroll
        for (int u = 0; u < V3_UNROLL; u++) {
            const int li = l0 + u;
            if (li >= len) continue;
            add_pack<T>(acc, g[u]);
            const int tok = s_tok[li + 1];
            const bool last = li + 1 == len;
            const bool cont_after = s_tok[li + 2] == tok;              // only possible when last
            if (!last && cont_after) continue;                         // the run goes on
            const bool cont_before = head_cont && tok == s_tok[1];     // the chunk's first run
            if (!cont_before && !cont_after) {                         // a whole segment: ours alone
                float old[P];
                R::unpack(d[u], old);
                #pragma unroll
                for (int e = 0; e < P; e++) old[e] += acc[e];
                dst[(size_t)tok * CP] = R::pack_exact(old);
            } else {                                                   // slot 0 head, slot 1 tail
                float4* sp = reinterpret_cast<float4*>(scratch + ((size_t)chunk * 2 + (cont_before ? 0 : 1)) * C
                                                       + (size_t)cw * P);
                #pragma unroll
                for (int q = 0; q < P / 4; q++)
                    sp[q] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
            }
            #pragma unroll
            for (int e = 0; e < P; e++) acc[e] = 0.0f;
        }
    }
}

// 4 consecutive elements of T as raw bits (8 bytes of bf16, 16 of fp32).
template <typename T> struct Raw4;
template <> struct Raw4<bf16> {
    typedef uint2 type;
    static __device__ __forceinline__ void unpack(const uint2& r, float (&f)[4]) {
        f[0] = __uint_as_float(r.x << 16); f[1] = __uint_as_float(r.x & 0xffff0000u);
        f[2] = __uint_as_float(r.y << 16); f[3] = __uint_as_float(r.y & 0xffff0000u);
    }
    static __device__ __forceinline__ uint2 pack_exact(const float (&f)[4]) {
        return make_uint2(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]));
    }
};
template <> struct Raw4<float> {
    typedef uint4 type;
    static __device__ __forceinline__ void unpack(const uint4& r, float (&f)[4]) {
        f[0] = __uint_as_float(r.x); f[1] = __uint_as_float(r.y);
        f[2] = __uint_as_float(r.z); f[3] = __uint_as_float(r.w);
    }
    static __device__ __forceinline__ uint4 pack_exact(const float (&f)[4]) {
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
    }
};

// Stage 2: block (chunk, column slice), one thread per 4 fp32 columns. The chunk where a
// boundary-crossing run starts adds its tail partial and the head partials of the
// following chunks the run reaches, in chunk order (as v2).
template <typename T, typename Key>
__device__ void encoder_backward_dwte_merge_v3(T* dwte, const float* scratch,         // (V,C) (chunks,2,C)
                                               const Key* keys, int N, int C, int bits, int num_chunks) {
    using R4 = Raw4<T>;
    const int chunk = blockIdx.x;
    const int start = chunk * CHUNK, end = min(start + CHUNK, N);
    if (end >= N) return;                                   // nothing goes past the last chunk
    const int tok = key_token(keys, end - 1, N, bits);
    if (key_token(keys, end, N, bits) != tok) return;       // the last run ends in this chunk
    if (start > 0 && key_token(keys, start, N, bits) == tok && key_token(keys, start - 1, N, bits) == tok)
        return;                                             // began in an earlier chunk: not ours
    // The run reaches chunks chunk+1 .. last: those whose first position holds tok, a
    // consecutive range (sorted keys). Each warp counts them, 32 chunks per ballot.
    const int lane = threadIdx.x & 31;
    int last = chunk;
    for (int j0 = chunk + 1;; j0 += 32) {
        const int j = j0 + lane;
        const bool in = j < num_chunks && key_token(keys, j * CHUNK, N, bits) == tok;
        const u32 ballot = __ballot_sync(0xffffffffu, in);
        last += __popc(ballot);
        if (ballot != 0xffffffffu) break;
    }
    const int c4 = blockIdx.y * blockDim.x + threadIdx.x;   // 4-column group
    if (c4 * 4 >= C) return;
    const size_t col = (size_t)c4 * 4;
    float acc[4];
    {
        const float4 t4 = *reinterpret_cast<const float4*>(scratch + ((size_t)chunk * 2 + 1) * C + col);
        acc[0] = t4.x; acc[1] = t4.y; acc[2] = t4.z; acc[3] = t4.w;
    }
    for (int j0 = chunk + 1; j0 <= last; j0 += MERGE_UNROLL) {
        float4 p[MERGE_UNROLL];
        #pragma unroll
        for (int u = 0; u < MERGE_UNROLL; u++)
            if (j0 + u <= last) p[u] = *reinterpret_cast<const float4*>(scratch + (size_t)(j0 + u) * 2 * C + col);
        #pragma unroll
        for (int u = 0; u < MERGE_UNROLL; u++)
            if (j0 + u <= last) {
                acc[0] += p[u].x; acc[1] += p[u].y; acc[2] += p[u].z; acc[3] += p[u].w;
            }
    }
    typename R4::type* dst = reinterpret_cast<typename R4::type*>(dwte + (size_t)tok * C + col);
    float old[4];
    R4::unpack(*dst, old);
    #pragma unroll
    for (int e = 0; e < 4; e++) old[e] += acc[e];
    *dst = R4::pack_exact(old);
}

// --------------------------------------------------------- entry points ------

#define ENCODER_KERNELS(VER, W, T, SUF)                                                                   \
    extern "C" __global__ void encoder_forward_kernel_##VER##_##SUF(                                     \
        T* out, const int* tokens, const T* wte, const T* wpe, int N, int T_, int C) {                   \
        encoder_forward<T, W>(out, tokens, wte, wpe, N, T_, C);                                          \
    }                                                                                                     \
    extern "C" __global__ void encoder_backward_dwpe_kernel_##VER##_##SUF(                               \
        T* dwpe, const T* dout, int B, int T_, int C) {                                                  \
        encoder_backward_dwpe<T, W>(dwpe, dout, B, T_, C);                                               \
    }                                                                                                     \
    extern "C" __global__ void encoder_backward_dwte_kernel_##VER##_##SUF(                               \
        T* dwte, float* scratch, const T* dout, const int* order, const int* sorted_tokens, int N, int C) { \
        encoder_backward_dwte<T, W>(dwte, scratch, dout, order, sorted_tokens, N, C);                    \
    }                                                                                                     \
    extern "C" __global__ void encoder_backward_dwte_merge_kernel_##VER##_##SUF(                         \
        T* dwte, const float* scratch, const int* sorted_tokens, int N, int C, int num_chunks) {         \
        encoder_backward_dwte_merge<T, W>(dwte, scratch, sorted_tokens, N, C, num_chunks);               \
    }

ENCODER_KERNELS(v1, 1, float, f32)
ENCODER_KERNELS(v1, 1, bf16, bf16)
ENCODER_KERNELS(v2, 4, float, f32)
ENCODER_KERNELS(v2, 8, bf16, bf16)

#define ENCODER_SORT_KEYS(Key, KSUF)                                                                      \
    extern "C" __global__ void encoder_sort_keys_kernel_##KSUF(Key* keys, const int* tokens, int N, int bits) { \
        encoder_sort_keys<Key>(keys, tokens, N, bits);                                                   \
    }

// v3 dwte kernels, per dtype and key width: encoder_backward_dwte_kernel_v3_u4_bf16_u32, ... (u4 = 4 rows in
// flight per thread; u8 measured slower, 44.5% vs 57.2% of copy, and was removed)
#define ENCODER_V3_CHUNK(U, T, SUF, Key, KSUF)                                                            \
    extern "C" __global__ void __launch_bounds__(256) encoder_backward_dwte_kernel_v3_u##U##_##SUF##_##KSUF( \
        T* dwte, float* scratch, const T* dout, const Key* keys, int N, int C, int bits) {              \
        encoder_backward_dwte_v3<T, Key, U>(dwte, scratch, dout, keys, N, C, bits);                      \
    }
#define ENCODER_V3(T, SUF, Key, KSUF)                                                                     \
    ENCODER_V3_CHUNK(4, T, SUF, Key, KSUF)                                                                \
    extern "C" __global__ void encoder_backward_dwte_merge_kernel_v3_##SUF##_##KSUF(                    \
        T* dwte, const float* scratch, const Key* keys, int N, int C, int bits, int num_chunks) {       \
        encoder_backward_dwte_merge_v3<T, Key>(dwte, scratch, keys, N, C, bits, num_chunks);             \
    }

ENCODER_SORT_KEYS(u32, u32)
ENCODER_SORT_KEYS(u64, u64)
ENCODER_V3(float, f32, u32, u32)
ENCODER_V3(float, f32, u64, u64)
ENCODER_V3(bf16, bf16, u32, u32)
ENCODER_V3(bf16, bf16, u64, u64)
