"""Probe: how much of a GEMM's output a memory pass right after it finds in the L2, by the order it
reads the rows. The training path's GEMM (matmul_forward, cuBLASLt as raced) writes out (N, M) bf16;
then a read-only pass (each block XORs one contiguous chunk of rows into one word) reads it with its
blocks in row order ("fwd") or the last rows first ("rev": chunk = grid - 1 - block). Timed in
alternation: the GEMM alone, the pass alone (after a 256 MB flush), GEMM + pass each way. If cuBLAS
writes the last rows last, "rev" reads the still-resident tail from the L2 and its pair is faster.
Run:  PYTHONPATH=. python3 tools/probes/l2_after_gemm.py
"""
import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import time_interleaved
from gpucore.ops.matmul import matmul_forward

SRC = r"""
extern "C" __global__ void read_chunks(const uint4* x, unsigned* out, long long n16, int rev) {
    const int chunk = rev ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const long long per = (n16 + gridDim.x - 1) / gridDim.x;
    const long long a = chunk * per, b = min(n16, a + per);
    unsigned acc = 0;
    for (long long i = a + threadIdx.x; i < b; i += blockDim.x) {
        const uint4 v = x[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[chunk] = acc;   // keeps the loads; never true for real data
}
"""
kern = cp.RawModule(code=SRC).get_function("read_chunks")
rng = np.random.default_rng(0)
flush = cp.empty(256 << 20, dtype=np.uint8)

for name, N, K, M in (("d12 fc forward", 65536, 768, 3072), ("d48 fc forward", 16384, 1600, 6400),
                      ("d48 attproj forward", 16384, 1600, 1600), ("d12 attproj forward", 65536, 768, 768)):
    x = cp.asarray(rng.standard_normal((N, K), dtype=np.float32)).astype(gpucore.bfloat16)
    w = cp.asarray(rng.standard_normal((M, K), dtype=np.float32) * 0.02).astype(gpucore.bfloat16)
    out = cp.empty((N, M), dtype=gpucore.bfloat16)
    sink = cp.zeros(4096, dtype=np.uint32)
    n16 = out.nbytes // 16
    grid = 132 * 8

    def read(rev):
        kern((grid,), (512,), (out, sink, np.int64(n16), np.int32(rev)))

    def gemm():
        matmul_forward(x, w, out=out)

    def cold_read():
        flush.fill(1)
        read(0)

    fns = [gemm, lambda: flush.fill(1), cold_read, lambda: (gemm(), read(0)), lambda: (gemm(), read(1))]
    t = time_interleaved(fns, rounds=9, repeat=5)
    g, f, cr, pf, pr = t
    print(f"{name} ({N} x {M}, {out.nbytes / 1e6:.0f} MB): GEMM {g:.4f} ms, read alone (cold) {cr - f:.4f}; "
          f"GEMM + read fwd {pf:.4f} (read {pf - g:.4f}), rev {pr:.4f} (read {pr - g:.4f}): "
          f"pair x{pf / pr:.3f}")
