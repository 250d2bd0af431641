"""Probe: the FP8 layernorm forward (E4M3 out in both orientations, amax) at d12's and d48's shapes,
timed in alternation, with its share of the copy bandwidth: the plain variant (what the model runs:
x read; out8, out8_t written) with 32- and 64-row blocks (answers ops/layernorm.py fp8_block_rows),
the residual variant (x, b read; residual, out8, out8_t written; through layernorm_forward_fp8's
checks) at the default rows, and each OLD_TREE argument's plain kernel (its kernels_cu/layernorm.cu)
-- every plain variant launched directly and its bytes, mean and rstd compared with
layernorm_forward_fp8's.
Run:  PYTHONPATH=. python3 tools/probes/layernorm_fp8_rows.py [OLD_TREE ...]
"""
import sys
from pathlib import Path

import cupy as cp
import numpy as np

import gpucore
from gpucore import runtime
from gpucore.bench import copy_bandwidth_gbps, time_interleaved
from gpucore.ops.layernorm import _v2_packs, fp8_block_rows, fp8_smem_bytes, layernorm_forward_fp8

trees = [(arg, runtime.load_module(Path(arg).resolve() / "kernels_cu/layernorm.cu")) for arg in sys.argv[1:]]
copy = copy_bandwidth_gbps()
print(f"device-to-device copy: {copy:.0f} GB/s (read + written)")
rng = np.random.default_rng(0)
for name, N, C in (("d12", 65536, 768), ("d48", 16384, 1600)):
    bf = lambda *s: cp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(gpucore.bfloat16)  # noqa: E731
    x, b, w, bias = bf(N, C), bf(N, C), bf(C), bf(C)
    scale, amax = cp.full(1, 16.0, np.float32), cp.zeros(1, np.float32)
    R = fp8_block_rows(C)                        # the plain kernel's default (the residual one's may differ)

    def bufs():
        return (cp.empty((N, C), np.uint8), cp.empty((C, N), np.uint8), cp.empty(N, np.float32),
                cp.empty(N, np.float32))

    def plain(kernel, rows, o):
        """The plain kernel launched as layernorm_forward_fp8 launches it, without the Python checks
        (at d48 a ~55 us kernel: timed through the checks, the host's time showed in the rows)."""
        return lambda: runtime.launch(kernel, -(-N // rows), 256,
                                      (o[0], o[1], amax, o[2], o[3], x, w, bias, scale, np.uint64(0), np.int32(N),
                                       np.int32(C), np.float32(1e-5)), shared_mem=fp8_smem_bytes(C, rows))   # (an old tree's kernel uses less)

    variants = {}                                # label: (fn, out8, out8_t, mean, rstd, bytes moved per value)
    name_of = lambda rows: f"layernorm_forward_fp8_kernel_n{_v2_packs(C, 8)}_r{rows}"     # noqa: E731
    for rows in (32, 64):
        o = bufs()
        variants[f"plain, rows {rows}"] = (plain(runtime.get_kernel("layernorm", name_of(rows)), rows, o), *o, 4)
    o, res = bufs(), cp.empty((N, C), gpucore.bfloat16)
    variants[f"residual, rows {fp8_block_rows(C, residual=True)} (checked)"] = (lambda o=o: layernorm_forward_fp8(
        x, w, bias, scale, b=b, residual=res, out8=o[0], out8_t=o[1], amax=amax, mean=o[2], rstd=o[3]), *o, 8)
    for tree, mod in trees:
        o = bufs()
        variants[f"plain, rows {R}, {tree}"] = (plain(mod.get_function(name_of(R)), R, o), *o, 4)
    o = variants[f"plain, rows {R}"][1:5]        # the reference bytes: layernorm_forward_fp8's own call
    layernorm_forward_fp8(x, w, bias, scale, out8=o[0], out8_t=o[1], amax=amax, mean=o[2], rstd=o[3])
    ref = [None, *(a.copy() for a in o)]
    ms = time_interleaved([v[0] for v in variants.values()])
    for (label, v), m in zip(variants.items(), ms):
        gbs = v[5] * N * C / m / 1e6
        same = ""                                # the residual variant normalises x + b: other bytes
        if label.startswith("plain"):
            same = "same bytes" if all(bool((v[i] == ref[i]).all()) for i in range(1, 5)) else "BYTES DIFFER"
        print(f"{name} C={C} {label:<28} {m:.4f} ms  {gbs:6.0f} GB/s  {100 * gbs / copy:5.1f}% of copy  {same}")
