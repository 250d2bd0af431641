/*
 * ptx.cuh -- the inline-PTX helpers that several kernel files need, each defined once:
 * shared-memory addresses, cp.async (global -> shared), ldmatrix, mma.sync m16n8k16 bf16.
 *
 * Why: these wrappers used to be copied into every kernel file that used them, under per-file
 * names (smem_addr / smem_u32_5 / wg_smem_u32, cp_async16_cg / cp_async16_5 / wg_cp_async16 /
 * cp_async16_full6, mma_16816 / mma_bf16, ldsm_x4, ...), and the copies had drifted apart
 * (a "memory" clobber here and not there, volatile or not). One definition is one place to read,
 * to check against the PTX ISA and to fix. Include it as "ptx.cuh": the compiler gets
 * -I kernels_cu, so files in subfolders include it by the same name. All of it is sm_80 PTX,
 * defined for every arch (but prefetch_l2, a bulk prefetch on sm_90 and nothing before);
 * Hopper-only PTX (wgmma, fence.proxy.async, descriptors) is in
 * wgmma.cuh, and the mbarrier wrappers stay in ladder/gemm/wgmma.cu, their only user.
 *
 * Each helper follows the PTX ISA section named beside it (chapter "Instructions"):
 *   smem_u32, smem_u32_asm  "Data Movement and Conversion Instructions: cvta": generic address
 *                       -> .shared window (cvta.to.shared.u64), then cvt.u32.u64: shared
 *                       addresses fit in 32 bits. Two spellings of the same conversion, see below.
 *   cp_async16          "Data Movement and Conversion Instructions: cp.async": .cg (cache in
 *                       L2 only; the only cache operator allowed with 16 bytes), cp-size 16,
 *                       src-size operand: src_bytes < 16 reads src_bytes and zero-fills the rest,
 *                       so 0 writes 16 zero bytes and reads nothing (src must still be a valid
 *                       address: callers pass the tensor base). With src_bytes 16 it compiles to
 *                       the same cubin bytes as the form without the operand (checked for
 *                       classifier.cu and gemm v6, which used that form).
 *   cp_async16_zfill    the same with a bool: valid ? copy : 16 zero bytes (a thin wrapper).
 *   cp_async4           cp.async.ca (L1 and L2: .cg does not exist for 4 bytes), cp-size 4,
 *                       src-size src_bytes (0 writes zero). Kept apart from cp_async16 because
 *                       of .ca and the size.
 *   cp_async16_hint     cp_async16 with .L2::cache_hint and a cache-policy operand (sm_80+).
 *   l2_evict_first / l2_evict_last  "Data Movement and Conversion Instructions: createpolicy":
 *                       createpolicy.fractional.L2::evict_{first,last}.b64 with fraction 1.0 -- a
 *                       64-bit policy for the .L2::cache_hint forms: lines it touches go first /
 *                       last when the L2 evicts (a priority; no persisting carve-out is needed).
 *   discard_l2_line     "discard": discard.global.L2 [a], 128 -- the 128-byte line at a (128-byte
 *                       aligned) is dropped from the L2 without being written back: its contents
 *                       become undefined. For dead scratch, so it neither occupies the L2 nor
 *                       costs a write to DRAM.
 *   cp_async_commit     "cp.async.commit_group": closes this thread's open group of cp.async.
 *   cp_async_wait<N>    "cp.async.wait_group": waits until at most N of this thread's committed
 *                       groups are pending. Only this thread's copies: other threads' need a
 *                       barrier after it before they are read.
 *   ldmatrix_x4(_trans) "Warp Level Matrix Data-Movement Instructions: ldmatrix", .m8n8 .x4
 *                       .shared .b16: lanes 8i..8i+7 give the row addresses (16 bytes, 16-byte
 *                       aligned) of 8x8 matrix i; register i of each lane receives the pair
 *                       (lane/4, 2*(lane%4)..+1) of matrix i, or with .trans the transposed pair
 *                       (2*(lane%4)..+1, lane/4).
 *   mma_bf16_16816      "Warp Level Matrix Multiply-Accumulate Instructions: mma":
 *                       mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d += a . b, with
 *                       the fragments of "Matrix Fragments for mma.m16n8k16 with floating point
 *                       type" (g = lane/4, t = lane%4; two bf16 per register, lower column low):
 *                         A (16x16, row): a0 (g, 2t..2t+1)  a1 (g+8, 2t..2t+1)
 *                                         a2 (g, 2t+8..+9)  a3 (g+8, 2t+8..+9)
 *                         B (16x8, col):  b0 (k = 2t..2t+1, n = g)  b1 (k = 2t+8..+9, n = g)
 *                         C/D (16x8 f32): d0,d1 (g, 2t..2t+1)  d2,d3 (g+8, 2t..2t+1)
 *                       b0, b1 are separate arguments: one ldmatrix_x4 loads the B fragments
 *                       of two n-tiles (r0,r1 and r2,r3).
 *
 * Why two spellings of the shared-address conversion: smem_u32 goes through CUDA's intrinsic
 * (__cvta_generic_to_shared), which the optimizer sees through; smem_u32_asm is the same
 * conversion as inline PTX, opaque to it. The result is the same, the code around it is not:
 * the flash v2 kernels and classifier.cu were written with the intrinsic, the GEMM ladder (v4,
 * v4b/c, v5, v6) and the attention v3 kernels with the asm, and moving either group to the
 * other spelling changes their register allocation (measured with ptxas -v: flash v2's
 * forward hd128_w4_mt1_n64 spills on sm_90 with the asm; attention v3's forward
 * hd64_g2_n128_s3 goes from 198 to 224 registers with the intrinsic). So both stay, and
 * every kernel keeps the one it was tuned with; new code should use smem_u32.
 *
 * Clobbers: where the old copies disagreed, the "memory" clobber won. Before, only classifier.cu's
 * cp.async issue had one; commit had one only in attention/flash.cuh and classifier.cu; wait
 * had none in tc.cu and tc2.cu. Now cp.async issue, commit and wait all have it. ldmatrix and mma
 * are asm volatile without a clobber, as all copies of ldmatrix were; attention/flash.cuh's
 * mma was not volatile. None of these changes altered a cubin: every kernel file compiles to
 * the same bytes as with its old private copies (sm_80, sm_90, and sm_90a for the Hopper files).
 */
#pragma once
#include "common.cuh"

// ---- shared-memory address -------------------------------------------------------------

// 32-bit .shared address of a generic pointer into shared memory, through CUDA's intrinsic:
// the optimizer sees the conversion and may fold or move it.
__device__ __forceinline__ u32 smem_u32(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// The same conversion as inline PTX (cvta.to.shared.u64 + cvt.u32.u64), opaque to the
// optimizer: same result, different code around it (see the header for who uses which).
__device__ __forceinline__ u32 smem_u32_asm(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// ---- cp.async: global -> shared ----------------------------------------------------------

// 16 bytes, L2 only (.cg). src_bytes (0..16) are read, the rest of the 16 are zero-filled:
// src_bytes 0 writes 16 zero bytes and reads nothing; 16 is a plain copy.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}

// The same with an L2 cache policy (l2_evict_first / l2_evict_last) for the lines it reads.
__device__ __forceinline__ void cp_async16_hint(u32 dst, const void* src, int src_bytes, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes), "l"(policy)
                 : "memory");
}

// 16 bytes when valid, else 16 zero bytes (src is not read); dst is a generic pointer to smem.
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
    cp_async16(smem_u32(dst), src, valid ? 16 : 0);
}

// 4 bytes, L1 + L2 (.ca); src_bytes 0 writes zero.
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}

// Close this thread's current group of cp.async.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// ---- L2 prefetch ---------------------------------------------------------------------------

// A hint: start bringing [p, p + bytes) from DRAM into L2, with no register and no wait -- for
// row kernels whose next row's loads would otherwise start only after this row's math (the
// layernorm kernels at large C, where registers hold one row per warp). sm_90: one bulk prefetch
// ("cp.async.bulk.prefetch.L2", p 16-byte aligned, bytes a multiple of 16); before sm_90 nothing.
__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes));
#else
    (void)p;
    (void)bytes;
#endif
}

// ---- L2 cache policies ---------------------------------------------------------------------

__device__ __forceinline__ u64 l2_evict_first() {
    u64 p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
    return p;
}
__device__ __forceinline__ u64 l2_evict_last() {
    u64 p;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(p));
    return p;
}
// Drop the 128-byte line at p (128-byte aligned) from the L2 unwritten; its contents become undefined.
__device__ __forceinline__ void discard_l2_line(const void* p) {
    asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(p) : "memory");
}

// ---- ldmatrix -----------------------------------------------------------------------------

// Four 8x8 b16 matrices; `addr` (.shared) is this lane's row address of matrix lane/8.
__device__ __forceinline__ void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// One 8x8 b16 matrix in the mma-fragment layout (lane 4g+t: row g, columns 2t, 2t+1) -> its transpose
// in the same layout (lane 4g+t: row g of the transpose = column g, rows 2t, 2t+1), in registers.
__device__ __forceinline__ u32 movmatrix_trans(u32 a) {
    u32 d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
    return d;
}

// ---- mma.sync -----------------------------------------------------------------------------

// d += a . b for one 16x8x16 tile: bf16 inputs, f32 accumulators (fragments in the header).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
