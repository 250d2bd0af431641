"""Probe: gemm v7 (TMA) at each block width against v6 and cuBLAS, at the ladder's and the LM head's shapes.

Run:  PYTHONPATH=. python3 tools/probes/gemm_v7_widths.py [MxKxN ...]

v7 runs 128 x 256 or 128 x 192 blocks; gpucore.gemm picks the width with fewer (waves x width)
(gpucore/ladder/gemm.py, _v7_block_n). This times both widths so the rule can be checked: each
result is first compared with cuBLAS's bf16 C (max |diff| over max |C|), then all are timed in
alternation with cuBLAS gemmEx (NN, the same layout), medians of 7 rounds x 10 calls. The row
marked * is the width gemm() picks.
Shapes M x K x N: 4096^3, the GPT-2 linear layers at 65536 rows, and the LM head's three GEMMs on
one 8192-row chunk in NN form (logits x @ W^T: 8192x768x50304; dx: 8192x50304x768; dW-shaped:
50304x8192x768).
"""
import sys

import cupy as cp

import gpucore
from gpucore import runtime
from gpucore.bench import time_interleaved
from gpucore.cublas import gemm_ex
from gpucore.ladder import gemm as lg

SHAPES = [(4096, 4096, 4096), (65536, 768, 2304), (65536, 768, 3072), (65536, 3072, 768),
          (8192, 768, 50304), (8192, 50304, 768), (50304, 8192, 768)]
bf16 = gpucore.dtypes.bfloat16


def main(shapes):
    rng = cp.random.default_rng(0)
    print(f"{'shape':>18} {'variant':>18} {'ms':>8} {'TFLOP/s':>8} {'cuBLAS':>8} {'%':>6} {'err':>8}")
    for (M, K, N) in shapes:
        a = (rng.standard_normal((M, K), dtype=cp.float32) * 0.5).astype(bf16)
        b = (rng.standard_normal((K, N), dtype=cp.float32) * 0.05).astype(bf16)
        ref = cp.empty((M, N), bf16)
        gemm_ex(a, b, ref, M, N, K)
        refmax = float(cp.abs(ref.astype(cp.float32)).max())
        picked = lg._v7_block_n(M, N, runtime.sm_count())
        names, fns, outs = [], [], []
        for bn in (256, 192):
            c = cp.zeros((M, N), bf16)
            fns.append(lambda c=c, bn=bn: lg._gemm_v7(a, b, c, bn))
            outs.append(c)
            names.append(f"v7 128x{bn}" + (" *" if bn == picked else ""))
        c8 = cp.zeros((M, N), bf16)
        fns.append(lambda: gpucore.gemm(a, b, out=c8, version=8))
        outs.append(c8)
        names.append("v8 ping-pong")
        c6 = cp.zeros((M, N), bf16)
        fns.append(lambda: gpucore.gemm(a, b, out=c6, version=6))
        outs.append(c6)
        names.append("v6")
        for fn in fns:
            fn()
        errs = [float(cp.abs(o.astype(cp.float32) - ref.astype(cp.float32)).max()) / refmax for o in outs]
        times = time_interleaved([lambda: gemm_ex(a, b, ref, M, N, K)] + fns, rounds=7, repeat=10)
        flop = 2.0 * M * K * N
        ref_tf = flop / times[0] / 1e9
        shape = f"{M}x{K}x{N}"
        print(f"{shape:>18} {'cuBLAS gemmEx NN':>18} {times[0]:8.3f} {ref_tf:8.1f}")
        for name, ms, err in zip(names, times[1:], errs):
            tf = flop / ms / 1e9
            print(f"{shape:>18} {name:>18} {ms:8.3f} {tf:8.1f} {ref_tf:8.1f} {tf / ref_tf:6.1%} {err:8.1e}")
        del a, b, ref, outs, fns
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main([tuple(int(v) for v in s.split("x")) for s in sys.argv[1:]] or SHAPES)
