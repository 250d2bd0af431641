/*
 * encoder/counting_sort.cu -- encoder backward v4: a stable counting sort of the positions by token,
 * specialised to this problem, in place of v3's CuPy (CUB radix) sort of 32-bit keys.
 *
 * Output: exactly v3's sorted key array, keys[i] = (token << bits) | position, ordered by
 * (token, position) (the keys are unique, so any correct sort gives these bits). The dwte
 * kernels of v3 (encoder.cu: chunk + merge) then run unchanged on it, so v4's gradients are
 * bit-identical to v3's (and v2's). dwpe: v2's kernel on the side stream (ops/encoder.py).
 *
 * Shapes: tokens (N,) int32 in [0, V) (checked by the launcher), V <= 65536.
 * Tiles: the positions are cut into tiles of V4_TILE (encoder.py: V4_TILE) consecutive
 *   positions, one 1024-thread block per tile.
 *
 *   1. tile_rank: per tile, the count of each token (16-bit counters for all V tokens in
 *      dynamic shared memory, 2V bytes) and each position's stable rank among the tile's
 *      positions with the same token. Within a warp the rank comes from __match_any_sync;
 *      across the 32 warps of a round of 1024 positions the warps' leaders bump the shared
 *      counters one warp after another (a barrier between warps: "baton"), so the ranks are
 *      in position order. Writes table[tile][v] = count (dense, int32) and local[n] = rank.
 *   2. scan: one thread per token: table[j][v] <- sum of table[j'][v] over j' < j (in place),
 *      the token's total, and an exclusive scan of the totals inside each 1024-token block
 *      (start_local) plus each block's sum (blocktot).
 *   3. scatter: slot(n) = start(token) + table[tile(n)][token] + local[n], where start(v) =
 *      start_local[v] + sum of blocktot over earlier blocks (<= 64 values, scanned per block);
 *      keys[slot] = (token << bits) | n.
 * Every step is integer arithmetic whose result does not depend on scheduling: deterministic.
 */
#include "common.cuh"

#define V4_TILE 2048                 // positions per tile_rank block (encoder.py: V4_TILE)
#define V4_ROUNDS (V4_TILE / 1024)   // rounds of 1024 positions (one per thread) per tile
#define V4_SCAN_BLOCK 1024           // tokens per scan block (encoder.py: V4_SCAN_BLOCK)

// Step 1. grid = number of tiles, block = 1024, dynamic shared memory = 2 * V bytes.
extern "C" __global__ void __launch_bounds__(1024) encoder_v4_tile_rank_kernel(
    int* table, int* local, const int* tokens, int N, int V) {   // (tiles,V) (N,) (N,)
    extern __shared__ unsigned short s_cnt[];                     // (V,) this tile's counts so far
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int base_n = blockIdx.x * V4_TILE + tid;
    int tok[V4_ROUNDS];
    #pragma unroll
    for (int r = 0; r < V4_ROUNDS; r++) {                         // loads first: in flight while zeroing
        const int n = base_n + r * 1024;
        tok[r] = n < N ? tokens[n] : -1;                          // -1: past the end (never counted)
    }
    for (int v = tid; v < V; v += 1024) s_cnt[v] = 0;
    __syncthreads();
    const u32 lt = (1u << lane) - 1u;
    #pragma unroll
    for (int r = 0; r < V4_ROUNDS; r++) {
        const u32 peers = __match_any_sync(0xffffffffu, tok[r]);   // lanes with my token
        const int lrank = __popc(peers & lt);                       // earlier lanes with my token
        int before = 0;                                             // earlier warps/rounds with my token
        for (int w = 0; w < 32; w++) {                              // the baton: warps in order
            if (warp == w && lrank == 0 && tok[r] >= 0) {
                before = s_cnt[tok[r]];
                s_cnt[tok[r]] = (unsigned short)(before + __popc(peers));
            }
            __syncthreads();
        }
        before = __shfl_sync(0xffffffffu, before, __ffs(peers) - 1);   // from my group's leader
        const int n = base_n + r * 1024;
        if (n < N) local[n] = before + lrank;
    }
    // The last baton step ended with a barrier: s_cnt holds the tile's counts.
    int* row = table + (size_t)blockIdx.x * V;
    for (int v = tid; v < V; v += 1024) row[v] = s_cnt[v];
}

// Step 2. grid = ceil(V / 1024), block = 1024.
extern "C" __global__ void __launch_bounds__(1024) encoder_v4_scan_kernel(
    int* table, int* start_local, int* blocktot, int tiles, int V) {   // (tiles,V) (V,) (ceil(V/1024),)
    __shared__ int s_warp[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int v = blockIdx.x * V4_SCAN_BLOCK + tid;
    int run = 0;                                     // the token's count in tiles < j
    if (v < V) {
        int* col = table + v;
        int j = 0;
        for (; j + 8 <= tiles; j += 8) {             // 8 loads in flight, then the in-place prefix
            int c[8];
            #pragma unroll
            for (int u = 0; u < 8; u++) c[u] = col[(size_t)(j + u) * V];
            #pragma unroll
            for (int u = 0; u < 8; u++) {
                col[(size_t)(j + u) * V] = run;
                run += c[u];
            }
        }
        for (; j < tiles; j++) {
            const int c = col[(size_t)j * V];
            col[(size_t)j * V] = run;
            run += c;
        }
    }
    // Exclusive scan of the totals over the block's tokens (warp shuffles, then the warp sums).
    int incl = run;
    #pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += y;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = s_warp[lane];                        // every lane reads before any writes (shfl syncs)
        #pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, d);
            if (lane >= d) w += y;
        }
        s_warp[lane] = w;                            // inclusive prefix over warps
    }
    __syncthreads();
    if (v < V) start_local[v] = incl - run + (warp > 0 ? s_warp[warp - 1] : 0);
    if (tid == 0) blocktot[blockIdx.x] = s_warp[31];
}

// Step 3. grid = ceil(N / blockDim), any blockDim >= 32.
template <typename Key>
__device__ void encoder_v4_scatter(Key* keys, const int* tokens, const int* table, const int* local,  // (N,) (N,) (tiles,V) (N,)
                                   const int* start_local, const int* blocktot,                       // (V,) (<=64,)
                                   int N, int V, int bits) {
    __shared__ int s_bp[64];                         // exclusive prefix of blocktot (V <= 65536: <= 64 blocks)
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const int nb = (V + V4_SCAN_BLOCK - 1) / V4_SCAN_BLOCK;
        const int a = 2 * lane < nb ? blocktot[2 * lane] : 0;
        const int b = 2 * lane + 1 < nb ? blocktot[2 * lane + 1] : 0;
        int incl = a + b;
        #pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, incl, d);
            if (lane >= d) incl += y;
        }
        const int excl = incl - a - b;
        s_bp[2 * lane] = excl;
        s_bp[2 * lane + 1] = excl + a;
    }
    __syncthreads();
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const int tok = tokens[n];
    const int slot = s_bp[tok / V4_SCAN_BLOCK] + start_local[tok] + table[(size_t)(n / V4_TILE) * V + tok] + local[n];
    keys[slot] = ((Key)(u32)tok << bits) | (Key)(u32)n;
}

#define ENCODER_V4_SCATTER(Key, KSUF)                                                                    \
    extern "C" __global__ void encoder_v4_scatter_kernel_##KSUF(                                         \
        Key* keys, const int* tokens, const int* table, const int* local, const int* start_local,       \
        const int* blocktot, int N, int V, int bits) {                                                   \
        encoder_v4_scatter<Key>(keys, tokens, table, local, start_local, blocktot, N, V, bits);          \
    }

ENCODER_V4_SCATTER(u32, u32)
ENCODER_V4_SCATTER(u64, u64)
