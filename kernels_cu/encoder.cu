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
 */
#include "common.cuh"

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
