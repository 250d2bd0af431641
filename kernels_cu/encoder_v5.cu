/*
 * encoder_v5.cu -- encoder backward v5: v3's dwte chunk kernel with its loads streamed through
 * a per-thread cp.async ring in shared memory (dwte only; the sort is v4's, dwpe v2's, the merge
 * v3's, see ops/encoder.py).
 *
 * Math (as encoder.cu): dwte[v, :] += sum of dout[n, :] over the sorted positions n of token v.
 * Shapes: dwte (V, C), dout (N, C), keys (N,) sorted (token << bits) | position, scratch
 *   (chunks, 2, C) fp32; C a multiple of 16/sizeof(T), 16-byte aligned arrays (v2's conditions).
 * Gradient rule: dwte += (fp32 sums rounded once into T).
 *
 * Why: v3's chunk kernel is latency-bound. Each thread walks its chunk's 64 rows in 16
 * dependent steps of 4 loads (load 4, wait, sum 4, load the next 4): between steps nothing of
 * that thread is in flight, and one wave of blocks does them in lock step (57% of copy).
 * v5 keeps R - 1 rows in flight per thread all the time: row li + R - 1 is issued (cp.async,
 * into ring slot (li - 1) % R) right after row li - 1 was summed, so the ring refills one row
 * at a time instead of once per batch, and no registers are held by loads in flight.
 * Each thread copies and then reads only its own 16-byte pack of each row (slot-major layout
 * [slot][thread]: conflict-free), so cp.async.wait_group alone orders the data -- no barriers.
 * A slot is refilled only after the row it held was summed (the FADDs consumed the LDS
 * result, so the shared load has completed before the async copy can overwrite it).
 * The dwte row of every segment that ends complete at position li (v3's rule) is copied in
 * the same commit group as row li, into the slot's dwte half.
 *
 * Summation order, chunking (CHUNK = 64), scratch slots and the merge are exactly v3's: the
 * gradients are bit-identical to v3/v4 (the GPU tests assert it).
 *
 * Launch: grid (chunks, column slices), block = packs per slice (<= 128), dynamic shared memory
 * = R * blockDim * 32 bytes (R = V5_RING: 8 -> 24 KB at bf16 C = 768: 8 blocks per SM, so the
 * 1024 chunks of N = 65536 run in one wave with ~7 x 16 B x 96 x 8 = 86 KB of loads in flight per SM).
 */
#include "common.cuh"
#include "fast_packs.cuh"

#define CHUNK 64   // sorted positions per block: must equal encoder.cu's CHUNK (same partial sums)

__device__ __forceinline__ void v5_cp_async16(void* smem, const void* gmem) {
    const u32 dst = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void v5_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void v5_cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

template <typename Key>
__device__ __forceinline__ int v5_key_token(const Key* keys, int p, int N, int bits) {   // -1 past either end
    return (p >= 0 && p < N) ? (int)(keys[p] >> bits) : -1;
}

template <typename T, typename Key, int R>
__device__ void encoder_backward_dwte_v5(T* dwte, float* scratch, const T* dout,   // (V,C) (chunks,2,C) (N,C)
                                         const Key* keys, int N, int C, int bits) { // (N,) sorted
    static_assert(R >= 2, "the ring needs a slot being summed and one in flight");
    using Rw = Raw<T>;
    constexpr int P = Rw::P;
    extern __shared__ uint4 s_ring[];             // [R][2][blockDim]: dout pack, dwte pack per slot
    __shared__ int s_row[CHUNK], s_tok[CHUNK + 2];
    const int chunk = blockIdx.x;
    const int start = chunk * CHUNK, len = min(CHUNK, N - start);
    const Key mask = ((Key)1 << bits) - 1;
    for (int i = threadIdx.x; i < CHUNK + 2; i += blockDim.x) s_tok[i] = v5_key_token(keys, start - 1 + i, N, bits);
    for (int i = threadIdx.x; i < len; i += blockDim.x) s_row[i] = (int)(keys[start + i] & mask);
    __syncthreads();                              // the only barrier: s_row/s_tok published
    const int CP = C / P;                         // packs per row
    const int cw = blockIdx.y * blockDim.x + threadIdx.x;
    if (cw >= CP) return;                         // no barriers below
    const int nt = blockDim.x;
    uint4* my = s_ring + threadIdx.x;             // slot s: my[(2 s) * nt] dout, my[(2 s + 1) * nt] dwte
    const uint4* src = reinterpret_cast<const uint4*>(dout) + cw;
    uint4* dst = reinterpret_cast<uint4*>(dwte) + cw;
    const bool head_cont = s_tok[0] == s_tok[1];  // the first run began in an earlier chunk

    // Row li of the chunk into its slot, plus the dwte row when a complete segment ends there
    // (v3's load condition). Always one commit group per row index, even past len (empty
    // groups complete at once), so that group li is always the (li + 1)-th group committed.
    auto issue = [&](int li) {
        if (li < len) {
            const int s = li % R;
            v5_cp_async16(my + (2 * s) * nt, src + (size_t)s_row[li] * CP);
            const int tok = s_tok[li + 1];
            if (s_tok[li + 2] != tok && !(head_cont && tok == s_tok[1]))
                v5_cp_async16(my + (2 * s + 1) * nt, dst + (size_t)tok * CP);
        }
        v5_cp_async_commit();
    };

    #pragma unroll
    for (int li = 0; li < R - 1; li++) issue(li);   // prologue: rows 0 .. R-2 in flight

    float acc[P];
    #pragma unroll
    for (int e = 0; e < P; e++) acc[e] = 0.0f;
    for (int li = 0; li < len; li++) {
        // Committed so far: R - 1 + li groups (rows 0 .. li + R - 2). At most R - 2 pending
        // means rows 0 .. li have landed.
        v5_cp_async_wait<R - 2>();
        const int s = li % R;
        add_pack<T>(acc, my[(2 * s) * nt]);
        // Refill: row li + R - 1 goes into slot (li - 1) % R, whose row li - 1 was summed in the
        // previous iteration (its shared loads are complete); at li = 0 that slot is still unused.
        issue(li + R - 1);
        const int tok = s_tok[li + 1];
        const bool last = li + 1 == len;
        const bool cont_after = s_tok[li + 2] == tok;              // only possible when last
        if (!last && cont_after) continue;                         // the run goes on
        const bool cont_before = head_cont && tok == s_tok[1];     // the chunk's first run
        if (!cont_before && !cont_after) {                         // a whole segment: ours alone
            float old[P];
            Rw::unpack(my[(2 * s + 1) * nt], old);
            #pragma unroll
            for (int e = 0; e < P; e++) old[e] += acc[e];
            dst[(size_t)tok * CP] = Rw::pack_exact(old);
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
    v5_cp_async_wait<0>();                        // nothing in flight when the block exits (empty groups)
}

// encoder_backward_dwte_kernel_v5_r<R>_<dtype>_<key>, e.g. encoder_backward_dwte_kernel_v5_r8_bf16_u32.
#define ENCODER_V5_CHUNK(R, T, SUF, Key, KSUF)                                                            \
    extern "C" __global__ void __launch_bounds__(128) encoder_backward_dwte_kernel_v5_r##R##_##SUF##_##KSUF( \
        T* dwte, float* scratch, const T* dout, const Key* keys, int N, int C, int bits) {              \
        encoder_backward_dwte_v5<T, Key, R>(dwte, scratch, dout, keys, N, C, bits);                      \
    }
#define ENCODER_V5(T, SUF, Key, KSUF)                                                                     \
    ENCODER_V5_CHUNK(8, T, SUF, Key, KSUF)                                                                \
    ENCODER_V5_CHUNK(16, T, SUF, Key, KSUF)

ENCODER_V5(float, f32, u32, u32)
ENCODER_V5(float, f32, u64, u64)
ENCODER_V5(bf16, bf16, u32, u32)
ENCODER_V5(bf16, bf16, u64, u64)
