/*
 * ladder/gemm/simt.cu -- our own float32 GEMM, rungs v1-v3 of the ladder (CUDA cores, no tensor cores).
 *
 * Math:   C (M, N) = A (M, K) @ B (K, N), all row-major, float32 in, float32
 *         accumulation, float32 out. Any M, N, K (edges are bounds-checked and
 *         zero-padded). No gradient of its own: d A = dC @ B^T, d B = A^T @ dC
 *         are GEMMs too (the training path uses cuBLAS, gpucore/ops/matmul.py).
 * Grid:   (ceil(N / BN), ceil(M / BM)), one block per BM x BN tile of C.
 *
 * The ladder (what each rung fixes; predictions in tools/notes/matmul.md):
 *   v1 naive            one thread per C element, every operand from global
 *                       memory (L1/L2 hide some of it). Block 16x16.
 *   v2 smem tiling      32x32 tiles of A and B staged in shared memory, each
 *                       element fetched from global once per block instead of
 *                       once per thread: 32x less global traffic. Still one
 *                       FMA per two shared-memory loads -> smem-bound.
 *   v3 register tiling  128x128x8 block tile, 256 threads, each thread owns an
 *                       8x8 tile of C in registers: per k it loads 8 + 8
 *                       values from smem (as float4) for 64 FMAs. A is stored
 *                       transposed in smem (As[k][m]) so both operands are
 *                       float4 reads; a thread's 8 rows / cols are split 4 + 4,
 *                       64 apart, so a quarter-warp's float4 reads are
 *                       contiguous (no bank conflicts). Global loads are
 *                       128-bit when K (for A) / N (for B) is a multiple of 4,
 *                       and the next k-tile is fetched into registers while
 *                       the current one is computed (double-buffered smem).
 */
#include "common.cuh"

// ---------------------------------------------------------------- v1 ----
// blockDim = (16, 16): threadIdx.x walks N (coalesced B reads and C writes).
__device__ void gemm_v1(float* C, const float* A, const float* B, int M, int N, int K) {   // (M,N) (M,K) (K,N)
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int m = blockIdx.y * blockDim.y + threadIdx.y;
    if (m >= M || n >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < K; k++) acc += A[(size_t)m * K + k] * B[(size_t)k * N + n];
    C[(size_t)m * N + n] = acc;
}

// ---------------------------------------------------------------- v2 ----
#define T2 32
// blockDim = 1024 (32 x 32 threads); thread (ty, tx) computes C[m0 + ty, n0 + tx].
__device__ void gemm_v2(float* C, const float* A, const float* B, int M, int N, int K) {   // (M,N) (M,K) (K,N)
    __shared__ float As[T2][T2];
    __shared__ float Bs[T2][T2];
    const int tx = threadIdx.x % T2, ty = threadIdx.x / T2;
    const int m = blockIdx.y * T2 + ty, n = blockIdx.x * T2 + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += T2) {
        // Out-of-range elements are zero, so the inner loop needs no bounds checks.
        As[ty][tx] = (m < M && k0 + tx < K) ? A[(size_t)m * K + k0 + tx] : 0.0f;
        Bs[ty][tx] = (k0 + ty < K && n < N) ? B[(size_t)(k0 + ty) * N + n] : 0.0f;
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < T2; k++) acc += As[ty][k] * Bs[k][tx];   // As: warp broadcast; Bs: 32 banks
        __syncthreads();
    }
    if (m < M && n < N) C[(size_t)m * N + n] = acc;
}

// ---------------------------------------------------------------- v3 ----
#define BM3 128
#define BN3 128
#define BK3 8
#define THREADS3 256

// Registers holding one k-tile on its way from global to shared memory:
// thread t loads A[m0 + t/2][k0 + (t%2)*4 .. +4] and B[k0 + t/32][n0 + (t%32)*4 .. +4].
struct TileRegs3 {
    float4 a, b;
};

__device__ __forceinline__ float4 load4_checked(const float* p, int row, int col, int rows, int cols, bool vec) {
    // Four consecutive elements of a row-major (rows, cols) matrix starting at (row, col), zero-padded.
    if (vec && row < rows && col + 3 < cols)
        return *reinterpret_cast<const float4*>(p + (size_t)row * cols + col);   // cols % 4 == 0: aligned
    float v[4];
    #pragma unroll
    for (int i = 0; i < 4; i++) v[i] = (row < rows && col + i < cols) ? p[(size_t)row * cols + col + i] : 0.0f;
    return make_float4(v[0], v[1], v[2], v[3]);
}

__device__ __forceinline__ void v3_load(TileRegs3& r, const float* A, const float* B, int M, int N, int K,
                                        int m0, int n0, int k0, bool a_vec, bool b_vec) {
    const int t = threadIdx.x;
    r.a = load4_checked(A, m0 + t / 2, k0 + (t % 2) * 4, M, K, a_vec);
    r.b = load4_checked(B, k0 + t / 32, n0 + (t % 32) * 4, K, N, b_vec);
}

__device__ __forceinline__ void v3_store(const TileRegs3& r, float (*As)[BM3], float (*Bs)[BN3]) {
    const int t = threadIdx.x;
    const int am = t / 2, ak = (t % 2) * 4;
    As[ak + 0][am] = r.a.x;     // transposed: As[k][m]
    As[ak + 1][am] = r.a.y;
    As[ak + 2][am] = r.a.z;
    As[ak + 3][am] = r.a.w;
    *reinterpret_cast<float4*>(&Bs[t / 32][(t % 32) * 4]) = r.b;
}

__device__ void gemm_v3(float* C, const float* A, const float* B, int M, int N, int K) {   // (M,N) (M,K) (K,N)
    __shared__ __align__(16) float As[2][BK3][BM3];
    __shared__ __align__(16) float Bs[2][BK3][BN3];
    const int m0 = blockIdx.y * BM3, n0 = blockIdx.x * BN3;
    const int tr = threadIdx.x / 16, tc = threadIdx.x % 16;   // 16 x 16 threads, 8 x 8 outputs each
    const bool a_vec = (K % 4) == 0, b_vec = (N % 4) == 0;    // 16-byte aligned rows (bases: checked in Python)
    float acc[8][8];
    #pragma unroll
    for (int i = 0; i < 8; i++)
        #pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;

    const int ktiles = (K + BK3 - 1) / BK3;
    TileRegs3 regs;
    v3_load(regs, A, B, M, N, K, m0, n0, 0, a_vec, b_vec);
    v3_store(regs, As[0], Bs[0]);
    __syncthreads();
    for (int kt = 0; kt < ktiles; kt++) {
        const int buf = kt & 1;
        const bool more = kt + 1 < ktiles;
        if (more) v3_load(regs, A, B, M, N, K, m0, n0, (kt + 1) * BK3, a_vec, b_vec);   // in flight during the FMAs
        #pragma unroll
        for (int k = 0; k < BK3; k++) {
            float a[8], b[8];
            const float4 a0 = *reinterpret_cast<const float4*>(&As[buf][k][tr * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[buf][k][64 + tr * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[buf][k][tc * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[buf][k][64 + tc * 4]);
            a[0] = a0.x; a[1] = a0.y; a[2] = a0.z; a[3] = a0.w;
            a[4] = a1.x; a[5] = a1.y; a[6] = a1.z; a[7] = a1.w;
            b[0] = b0.x; b[1] = b0.y; b[2] = b0.z; b[3] = b0.w;
            b[4] = b1.x; b[5] = b1.y; b[6] = b1.z; b[7] = b1.w;
            #pragma unroll
            for (int i = 0; i < 8; i++)
                #pragma unroll
                for (int j = 0; j < 8; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        // buf ^ 1 was last read in iteration kt - 1, which every thread finished
        // before the barrier at its end: safe to overwrite now.
        if (more) v3_store(regs, As[buf ^ 1], Bs[buf ^ 1]);
        __syncthreads();
    }

    // Thread rows: m0 + tr*4 + {0..3} and m0 + 64 + tr*4 + {0..3}; cols likewise with tc.
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        const int m = m0 + (i < 4 ? tr * 4 + i : 64 + tr * 4 + i - 4);
        if (m >= M) continue;
        #pragma unroll
        for (int h = 0; h < 2; h++) {
            const int n = n0 + h * 64 + tc * 4;
            float* c = C + (size_t)m * N + n;
            if (b_vec && n + 3 < N) {
                *reinterpret_cast<float4*>(c) = make_float4(acc[i][h * 4], acc[i][h * 4 + 1],
                                                            acc[i][h * 4 + 2], acc[i][h * 4 + 3]);
            } else {
                #pragma unroll
                for (int j = 0; j < 4; j++)
                    if (n + j < N) c[j] = acc[i][h * 4 + j];
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) gemm_forward_kernel_v1_f32(
        float* C, const float* A, const float* B, int M, int N, int K) {
    gemm_v1(C, A, B, M, N, K);
}
extern "C" __global__ void __launch_bounds__(1024) gemm_forward_kernel_v2_f32(
        float* C, const float* A, const float* B, int M, int N, int K) {
    gemm_v2(C, A, B, M, N, K);
}
extern "C" __global__ void __launch_bounds__(THREADS3) gemm_forward_kernel_v3_f32(
        float* C, const float* A, const float* B, int M, int N, int K) {
    gemm_v3(C, A, B, M, N, K);
}
