"""Probe: gemm v9 (2-block clusters, B multicast) -- how its time depends on the cluster count and
on each part of the cluster machinery, against v8 and cuBLAS.

Run:  PYTHONPATH=. python3 tools/probes/gemm_v9_clusters.py [MxKxN ...]

Rows: v8; v9 at 66 (one block an SM on 132 SMs) and 64 clusters; v9 built with the measurement
switches of kernels_cu/ladder/gemm/cluster.cu (-DV9_GROUP=g: g pair rows a raster group, default 8;
-DV9_NO_MULTICAST: every block loads all
of B; + -DV9_LOCAL_ONLY: and releases its stages to itself only, i.e. v8's pipeline launched in
clusters). Each result is compared with cuBLAS's C first; medians of 7 interleaved rounds x 10 calls.
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import runtime
from gpucore.bench import time_interleaved
from gpucore.cublas import gemm_ex
from gpucore.ladder import gemm as lg

SHAPES = [(4096, 4096, 4096), (65536, 768, 3072), (8192, 768, 50304)]
bf16 = gpucore.dtypes.bfloat16


def v9_variant(opts, clusters=None):
    """A launcher of v9 compiled with `opts`, on `clusters` clusters (default SMs / 2)."""
    family, _, _, threads, smem = lg.GEMM_VERSIONS[9]
    kernel = runtime.get_kernel(family, "gemm_forward_kernel_v9_bf16_bf16", options=opts, arch="90a")
    kernel.preferred_shared_memory_carveout = 100

    def run(a, b, out):
        (M, K), N = a.shape, b.shape[1]
        pairs = -(-M // 256) * -(-N // 128)
        grid = (2 * min(pairs, clusters or runtime.sm_count() // 2),)
        runtime.launch(kernel, grid, (threads,), (out, lg._tma_maps(a, b, out), np.int32(M), np.int32(N),
                                                  np.int32(K)), shared_mem=smem)
    return run


def main(shapes):
    rng = cp.random.default_rng(0)
    variants = [("v8", lambda a, b, c: gpucore.gemm(a, b, out=c, version=8))]
    for n in (66, 64):
        variants.append((f"v9 {n} clusters", lambda a, b, c, n=n: lg._gemm_v9(a, b, c, n)))
    for g in (1, 2, 4, 16):
        variants.append((f"v9 raster group {g} pairs", v9_variant((f"-DV9_GROUP={g}",))))
    variants.append(("v9 no multicast", v9_variant(("-DV9_NO_MULTICAST",))))
    variants.append(("v9 no mc, local release", v9_variant(("-DV9_NO_MULTICAST", "-DV9_LOCAL_ONLY"))))
    print(f"{'shape':>18} {'variant':>26} {'ms':>8} {'TFLOP/s':>8} {'%cuBLAS':>8} {'err':>8}")
    for (M, K, N) in shapes:
        a = (rng.standard_normal((M, K), dtype=cp.float32) * 0.5).astype(bf16)
        b = (rng.standard_normal((K, N), dtype=cp.float32) * 0.05).astype(bf16)
        ref = cp.empty((M, N), bf16)
        gemm_ex(a, b, ref, M, N, K)
        refmax = float(cp.abs(ref.astype(cp.float32)).max())
        outs = [cp.zeros((M, N), bf16) for _ in variants]
        fns = [lambda f=f, o=o: f(a, b, o) for (_, f), o in zip(variants, outs)]
        for fn in fns:
            fn()
        errs = [float(cp.abs(o.astype(cp.float32) - ref.astype(cp.float32)).max()) / refmax for o in outs]
        times = time_interleaved([lambda: gemm_ex(a, b, ref, M, N, K)] + fns, rounds=7, repeat=10)
        flop = 2.0 * M * K * N
        ref_tf = flop / times[0] / 1e9
        shape = f"{M}x{K}x{N}"
        print(f"{shape:>18} {'cuBLAS gemmEx NN':>26} {times[0]:8.3f} {ref_tf:8.1f}")
        for (name, _), ms, err in zip(variants, times[1:], errs):
            tf = flop / ms / 1e9
            print(f"{shape:>18} {name:>26} {ms:8.3f} {tf:8.1f} {tf / ref_tf:8.1%} {err:8.1e}", flush=True)
        del a, b, ref, outs, fns
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main([tuple(int(v) for v in s.split("x")) for s in sys.argv[1:]] or SHAPES)
