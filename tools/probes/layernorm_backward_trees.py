"""Probe: the v2 layernorm backward (stage 1: dx +=, the block partials; plain and with the dx
column sum) of this tree against each OTHER argument's (a tree: its kernels_cu/layernorm.cu; or a .cu
file, e.g. a variant of layernorm.cu made for pricing one of its parts), at the d12 / d24 /
d36 / d48 row lengths (B*T rows as a d12 B=64 or a d48 B=16 step has them); bf16, interleaved medians,
GB/s counted as dout + x read, dx read and written. Each tree runs with the grid its own plain
kernel's occupancy gives (what ops/layernorm.py would launch); dx and the partials are compared bit
for bit on this tree's grid (the partials' grouping is the grid's).
Run:  PYTHONPATH=. python3 tools/probes/layernorm_backward_trees.py [OTHER ...]
"""
import sys
from pathlib import Path

import cupy as cp
import numpy as np

import gpucore
from gpucore import runtime
from gpucore.bench import copy_bandwidth_gbps, time_interleaved
from gpucore.ops import layernorm as ln

BF = gpucore.bfloat16
trees = [(".", None)] + [(arg, runtime.load_module(Path(arg).resolve() if arg.endswith(".cu")
                                                   else Path(arg).resolve() / "kernels_cu/layernorm.cu"))
                         for arg in sys.argv[1:]]
rng = np.random.default_rng(0)
copy = copy_bandwidth_gbps()
print(f"device-to-device copy: {copy:.0f} GB/s (read + written)")


def kernel(mod, name):
    return runtime.get_kernel("layernorm", name) if mod is None else mod.get_function(name)


for rows, C in ((65536, 768), (32768, 1024), (16384, 1280), (16384, 1600)):
    bf = lambda *s: cp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(BF)  # noqa: E731
    x, dout, w = bf(rows, C), bf(rows, C), bf(C)
    _, mean, rstd = gpucore.layernorm_forward(x, w, cp.zeros(C, BF))
    S, N = ln.backward_split(BF, C)
    tag = f"n{N}" + ("_s2" if S == 2 else "")
    rpb = ln.WARPS // S
    base = bf(rows, C)
    variants, outs = {}, {}
    for tree, mod in trees:
        plain = kernel(mod, f"layernorm_backward_kernel_v2_{tag}_bf16")
        grid = min(runtime.sm_count() * ln._resident_blocks(plain, ln.BLOCK), -(-rows // rpb))
        for colsum in (False, True):
            k = kernel(mod, f"layernorm_backward_{'colsum_' if colsum else ''}kernel_v2_{tag}_bf16")
            dx = base.copy()
            scratch = cp.empty((grid, 3 if colsum else 2, C), np.float32)
            args = (scratch, dx, dout, x, w, mean, rstd, np.int32(rows), np.int32(C))
            label = f"{'colsum' if colsum else 'plain'}, {tree} (grid {grid})"
            variants[label] = lambda k=k, grid=grid, args=args: runtime.launch(k, grid, ln.BLOCK, args)
            outs[label] = (k, colsum)
    ms = time_interleaved(list(variants.values()), rounds=9, repeat=20)
    nbytes = 4 * rows * C * 2
    for (label, _), t in zip(variants.items(), ms):
        print(f"{rows}x{C:<5} {tag:<6} {label:<34} {t * 1e3:7.1f} us  {nbytes / t / 1e6:6.0f} GB/s  "
              f"{nbytes / t / 1e6 / copy:6.1%}")
    # bits: every kernel once on this tree's grid, from the same dx
    grid = min(runtime.sm_count() * ln._resident_blocks(kernel(None, f"layernorm_backward_kernel_v2_{tag}_bf16"),
                                                        ln.BLOCK), -(-rows // rpb))
    ref = {}
    for label, (k, colsum) in outs.items():
        dx, scratch = base.copy(), cp.empty((grid, 3 if colsum else 2, C), np.float32)
        runtime.launch(k, grid, ln.BLOCK, (scratch, dx, dout, x, w, mean, rstd, np.int32(rows), np.int32(C)))
        if colsum not in ref:
            ref[colsum] = (dx, scratch)
            continue
        same = bool((dx == ref[colsum][0]).all()) and bool((scratch == ref[colsum][1]).all())
        print(f"{'':20} {label}: dx and partials {'bit for bit this tree' if same else 'DIFFER'}")
