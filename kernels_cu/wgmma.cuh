/*
 * wgmma.cuh -- shared helpers for Hopper's warpgroup MMA (wgmma.mma_async, sm_90a).
 *
 * Used by ladder/gemm/wgmma.cu (gemm v5) and the attention v3 kernels (attention/flash_v3*.cu).
 * Rule for co-owners: APPEND ONLY (other files rely on the names and semantics below).
 * Names are prefixed wg_/wgmma_ so this header can be included next to attention/flash.cuh.
 *
 * The wgmma wrappers exist only where the compiler targets sm_90a (__CUDA_ARCH_FEAT_SM90_ALL);
 * kernel files guard their bodies with the same macro and __trap() otherwise, so
 * `kernels check --arch 80 --arch 90` still compiles them. wg_swz128 is plain arithmetic and is
 * defined for every arch. The sm_80 PTX these kernels also use (shared-memory addresses,
 * cp.async) is ptx.cuh's, included here: smem_u32_asm, cp_async16, cp_async_commit, cp_async_wait
 * (they replace this header's former wg_smem_u32, wg_cp_async16, wg_cp_async_commit/wait).
 *
 * 128-byte swizzle (CU_TENSOR_MAP_SWIZZLE_128B / descriptor layout type 1): a tile whose rows are
 * 128 bytes (64 bf16) is stored in "atoms" of 8 rows x 128 B = 1024 B, 1024-byte aligned; the
 * 16-byte chunk c (8 bf16) of row r lives at r * 128 + 16 * (c ^ (r & 7)). A tile wider than 64
 * bf16 is stored as column blocks of 64, each block a (rows x 128 B) swizzled sub-tile.
 *
 * Descriptors (smem_desc): bits [0,14) start >> 4, [16,30) LBO >> 4, [32,46) SBO >> 4,
 * [62,64) = 1 (128B swizzle). With 128B swizzle:
 *   K-major operand (A of any product, B of A @ B^T with B stored (N, K) row-major):
 *     SBO = 1024 (next 8 rows of M/N), LBO unused (pass 16); k-step of 16 inside a 64-wide
 *     block: start + 32 bytes (the hardware applies the XOR to the final address, so only the
 *     atom base must be 1024-aligned); next 64-wide K block: start + rows * 128.
 *   MN-major operand (B stored (K, N) row-major, imm-trans-b = 1):
 *     LBO = byte distance between 64-wide N column blocks, SBO = 1024 (next 8 k-rows);
 *     k-step of 16: start + 16 * 128 = 2048 bytes.
 *   (Both measured correct by gemm v5 on an H200: A K-major, B MN-major.)
 *
 * Fragments (PTX ISA, "Register Fragments and Shared Memory Matrix Layouts", wgmma .m64nNk16):
 *   Accumulator D (f32): warp i of the warpgroup holds rows 16i..16i+15; lane 4g+t holds, for
 *     each n8 block j, d[4j], d[4j+1] = D[g][8j+2t], D[g][8j+2t+1] and d[4j+2], d[4j+3] =
 *     D[g+8][8j+2t], D[g+8][8j+2t+1]  (mma.sync's m16n8 C layout, N/8 times).
 *   Register A (bf16, 4 x u32 per thread): warp i holds rows 16i..16i+15 of the 64 x 16 A, laid
 *     out as mma.m16n8k16's A fragment: a[0] = A[g][2t,2t+1], a[1] = A[g+8][2t,2t+1],
 *     a[2] = A[g][2t+8,+9], a[3] = A[g+8][2t+8,+9]. So the accumulator of n8 blocks 2k, 2k+1,
 *     converted to bf16 pairs, IS the A fragment of k-step k (wg_acc_to_a).
 *
 * Ordering rules (PTX ISA): wgmma_fence() before the first wgmma of a batch whenever the
 * accumulator or register-A registers were written by ordinary instructions since the last
 * wgmma (e.g. after rescaling O or building P); fence_proxy_async() after generic-proxy writes
 * to shared memory (cp.async, st.shared) that a wgmma will read, before the barrier that
 * publishes them; wgmma_commit() closes a group; wgmma_wait<N>() waits until at most N groups
 * are pending. Accumulator and A registers must not be touched between issue and wait;
 * wg_fence_regs() (an empty asm with "+f"/"+r") pins reads after the wait.
 */
#pragma once
#include "common.cuh"
#include "ptx.cuh"       // smem_u32_asm, cp_async16 / cp_async_commit / cp_async_wait (sm_80 PTX)

// Byte offset of 16-byte chunk c (0..7) of row r inside a 128B-swizzled (rows x 128 B) block.
__device__ __forceinline__ u32 wg_swz128(int r, int c) { return (u32)(r * 128 + ((c ^ (r & 7)) << 4)); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Shared-memory matrix descriptor with 128-byte swizzling (bit layout in the header).
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lbo_bytes, u32 sbo_bytes) {
    return (u64)((addr >> 4) & 0x3FFF) | ((u64)((lbo_bytes >> 4) & 0x3FFF) << 16) |
           ((u64)((sbo_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// desc's matrix moved `bytes` further (a multiple of 16): smem_desc(addr + bytes, ...) as one add to the
// start field, exact while addr + bytes stays under 2^18 (the field's reach: all of shared memory).
// Build a product's descriptors once and step them with this: smem_desc's shift and masks before
// every wgmma (and the move into a uniform register after them) were ~10 instructions on the
// critical path of each k-step (ncu, tools/notes/attention.md, sixteenth session).
__device__ __forceinline__ u64 desc_add(u64 desc, u32 bytes) { return desc + (bytes >> 4); }

#define WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                 "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

// d (64 x 256 per warpgroup, f32) += A (64 x 16, K-major) @ B (16 x 256, N-major), from shared memory.
__device__ __forceinline__ void wgmma_m64n256k16(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, 1, 1, 1, 0, 1;\n"          // scale-d = 1 (accumulate), scale-a/b = 1, trans-a 0, trans-b 1
        "}\n"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56),
          WG_D8(64), WG_D8(72), WG_D8(80), WG_D8(88), WG_D8(96), WG_D8(104), WG_D8(112), WG_D8(120)
        : "l"(desc_a), "l"(desc_b));
}

// Pin registers: reads after this cannot move above it (use after wgmma_wait on accumulators),
// writes before it cannot sink below it (use before wgmma_fence on accumulators / A fragments).
template <int N>
__device__ __forceinline__ void wg_fence_regs(float* d) {
    #pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void wg_fence_regs(u32* r) {
    #pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(r[i])::"memory");
}

// Register-A fragment of k-step k from an f32 accumulator (n8 blocks 2k, 2k+1), bf16 RNE.
__device__ __forceinline__ void wg_acc_to_a(u32 (&a)[4], const float* d, int k) {
    a[0] = pack_bf16x2(d[8 * k + 0], d[8 * k + 1]);
    a[1] = pack_bf16x2(d[8 * k + 2], d[8 * k + 3]);
    a[2] = pack_bf16x2(d[8 * k + 4], d[8 * k + 5]);
    a[3] = pack_bf16x2(d[8 * k + 6], d[8 * k + 7]);
}

// The wrappers below take scale_d at run time (0: D = A B, 1: D += A B), via a predicate.
// _ss_kk: A and B both from shared memory, both K-major (imm-trans-a = imm-trans-b = 0):
//   D (64 x N) = A (64 x 16) @ B^T with B stored (N, 16) K-major, e.g. S = Q K^T.
// _rs_mn: A from registers (wg_acc_to_a layout), B from shared memory MN-major (imm-trans-b = 1):
//   D (64 x N) += A (64 x 16) @ B with B stored (16, N) row-major, e.g. O += P V.
__device__ __forceinline__ void wgmma_m64n64k16_ss_kk(float* d, u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_m64n128k16_ss_kk(float* d, u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_m64n64k16_rs_mn(float* d, const u32 (&a)[4], u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_m64n128k16_rs_mn(float* d, const u32 (&a)[4], u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}


// _rs_kk: A from registers, B from shared memory K-major (imm-trans-b = 0): D (64 x 64) (+)= A @ B^T
// with B stored (64, 16) K-major, e.g. S^T = K Q^T with K's fragments held in registers.
__device__ __forceinline__ void wgmma_m64n64k16_rs_kk(float* d, const u32 (&a)[4], u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// Bulk copy shared -> global through the async proxy (PTX ISA "cp.async.bulk"): `bytes` (a multiple
// of 16, both addresses 16-byte aligned) from shared address src to dst, in the thread's current
// bulk group, the lines it writes under L2 cache policy `policy` (ptx.cuh's l2_evict_last /
// l2_evict_first); commit closes the group; wait_read<N> waits until at most N groups still READ
// shared memory (the source may then be overwritten), wait_done<N> until their writes are complete.
// Shared-memory writes the copy reads need fence_proxy_async() and a barrier before it.
__device__ __forceinline__ void bulk_store_s2g(void* dst, u32 src, u32 bytes, u64 policy) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;\n" ::"l"(dst),
                 "r"(src), "r"(bytes), "l"(policy)
                 : "memory");
}
// The same, but the source's f32 values are added to what dst holds, in the L2 (cp.reduce.async.bulk
// .add.f32, the f32 add of red.add.f32); completion as above. Two reductions into one address land in
// issue order only if the first has completed (wait_done) before the second is issued.
__device__ __forceinline__ void bulk_reduce_add_s2g(float* dst, u32 src, u32 bytes, u64 policy) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [%0], [%1], %2, %3;\n"
                 ::"l"(dst), "r"(src), "r"(bytes), "l"(policy)
                 : "memory");
}
// stmatrix .x4 (PTX ISA "stmatrix", sm_90): four 8 x 8 b16 matrices from registers to shared
// memory, each register in the mma-fragment layout (lane 4g+t: row g, columns 2t, 2t+1; the lower
// half the even column); lanes 8m..8m+7 give the (16-byte aligned) row addresses of matrix m.
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_done() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }

// _ss_mnmn: A and B both from shared memory, both MN-major (imm-trans-a = imm-trans-b = 1):
//   D (64 x 32) (+)= A (64 x 16) @ B (16 x 32) with A stored (16, 64) row-major (its transpose is
//   what sits in smem, M contiguous) and B stored (16, >= 32) row-major, e.g. one warpgroup's half
//   of the queries in dQ^T = K^T dS^T from the K tile and dS^T, both (keys, 64) tiles. Descriptors
//   as MN-major B (header): k-step + 2048 B; B's start may sit 64 bytes into a swizzled row.
__device__ __forceinline__ void wgmma_m64n32k16_ss_mnmn(float* d, u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "%16, %17, p, 1, 1, 1, 1;\n}\n"
        : WG_D8(0), WG_D8(8)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (64 x 192 per warpgroup, f32) += A (64 x 16, K-major) @ B (16 x 192, N-major), from shared memory: the
// m64n256k16 above at three quarters of the width (gemm v7's 128 x 192 tile: 768 = 4 x 192 columns).
__device__ __forceinline__ void wgmma_m64n192k16(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
        "%96, %97, 1, 1, 1, 0, 1;\n"
        "}\n"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56),
          WG_D8(64), WG_D8(72), WG_D8(80), WG_D8(88)
        : "l"(desc_a), "l"(desc_b));
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (64 x 128 per warpgroup, f32) += A (64 x 16, K-major) @ B (16 x 128, N-major), from shared memory,
// always accumulating: gemm v8's two m64 halves of a 128 x 128 tile (B descriptors as m64n256k16's).
__device__ __forceinline__ void wgmma_m64n128k16_ss_kmn(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, 1, 1, 1, 0, 1;\n"
        "}\n"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56)
        : "l"(desc_a), "l"(desc_b));
}
#endif
