"""Probe: gemm v7 (TMA) variants against v6 and cuBLAS, at the ladder's shapes and the LM head's.

Run:  PYTHONPATH=. python3 tools/probes/gemm_v7_variants.py [MxKxN ...]

Variants of kernels_cu/ladder/gemm/tma.cu compiled with -D options (the launch's shared memory
follows): the default (4 stages, C staged in 2 rounds of 128 columns) and 3 stages with all 256
columns staged at once (no wait between rounds, one stage less of prefetch). Every variant's C is
first checked against cuBLAS's (bf16 C; max |diff| over max |C|), then all are timed in
alternation with cuBLAS gemmEx (NN, the same layout), medians of 7 rounds x 10 calls.
Shapes M x K x N: 4096^3, the GPT-2 linear layers at 65536 rows, and the LM head's three GEMMs on
one 8192-row chunk in NN form (logits x @ W^T: 8192x768x50304; dx: 8192x50304x768; dW^T-shaped:
50304x8192x768).
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import runtime
from gpucore.bench import time_interleaved
from gpucore.cublas import gemm_ex
from gpucore.ladder import gemm as lg

SHAPES = [(4096, 4096, 4096), (65536, 768, 2304), (65536, 768, 3072), (65536, 3072, 768),
          (8192, 768, 50304), (8192, 50304, 768), (50304, 8192, 768)]
VARIANTS = {"v7 (4 stages, 2 x 128 cols)": (4, 128), "v7 (3 stages, 256 cols)": (3, 256)}
bf16 = gpucore.dtypes.bfloat16


def variant_fn(stages, cols, a, b, c):
    M, K = a.shape
    N = b.shape[1]
    kernel = runtime.get_kernel("ladder/gemm/tma", "gemm_forward_kernel_v7_bf16_bf16",
                                options=(f"-DSTAGES7={stages}", f"-DEPI_COLS7={cols}"), arch="90a")
    smem = stages * 49152 + 2 * 64 * cols * 2 + 1024
    kernel.max_dynamic_shared_size_bytes = smem
    maps = lg._tma_maps(a, b, c)
    grid = (min(-(-M // 128) * -(-N // 256), runtime.sm_count()),)
    args = (c, maps, np.int32(M), np.int32(N), np.int32(K))
    return lambda: kernel(grid, (384,), args, shared_mem=smem)


def main(shapes):
    rng = cp.random.default_rng(0)
    print(f"{'shape':>18} {'variant':>30} {'ms':>8} {'TFLOP/s':>8} {'cuBLAS':>8} {'%':>6} {'err':>8}")
    for (M, K, N) in shapes:
        a = (rng.standard_normal((M, K), dtype=cp.float32) * 0.5).astype(bf16)
        b = (rng.standard_normal((K, N), dtype=cp.float32) * 0.05).astype(bf16)
        ref = cp.empty((M, N), bf16)
        gemm_ex(a, b, ref, M, N, K)
        refmax = float(cp.abs(ref.astype(cp.float32)).max())
        outs, fns, names = [], [], []
        for name, (stages, cols) in VARIANTS.items():
            c = cp.empty((M, N), bf16)
            fn = variant_fn(stages, cols, a, b, c)
            fn()
            outs.append(c)
            fns.append(fn)
            names.append(name)
        c6 = cp.empty((M, N), bf16)
        fns.append(lambda: gpucore.gemm(a, b, out=c6, version=6))
        fns[-1]()
        outs.append(c6)
        names.append("v6")
        errs = [float(cp.abs(o.astype(cp.float32) - ref.astype(cp.float32)).max()) / refmax for o in outs]
        times = time_interleaved([lambda: gemm_ex(a, b, ref, M, N, K)] + fns, rounds=7, repeat=10)
        flop = 2.0 * M * K * N
        ref_tf = flop / times[0] / 1e9
        shape = f"{M}x{K}x{N}"
        print(f"{shape:>18} {'cuBLAS gemmEx NN':>30} {times[0]:8.3f} {ref_tf:8.1f}")
        for name, ms, err in zip(names, times[1:], errs):
            tf = flop / ms / 1e9
            print(f"{shape:>18} {name:>30} {ms:8.3f} {tf:8.1f} {ref_tf:8.1f} {tf / ref_tf:6.1%} {err:8.1e}")
        del a, b, ref, outs, fns
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main([tuple(int(v) for v in s.split("x")) for s in sys.argv[1:]] or SHAPES)
