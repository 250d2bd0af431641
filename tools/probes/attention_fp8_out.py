"""Probe: the attention forward writing attproj's E4M3 input itself (attention_forward(out8=, out8_t=,
scale8=, amax8=): the F8 kernel's epilogue) against the forward followed by the cast it replaces
(fp8_quantize of the bf16 output, both layouts, amax), at d12's and d48's shapes, in alternation.
The cast re-reads the output (2 bytes a value) and writes 2: the epilogue keeps the writes and drops
the read and a launch. Run:  PYTHONPATH=. python3 tools/probes/attention_fp8_out.py
"""
import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import time_interleaved
from gpucore.ops.fp8 import fp8_quantize

rng = np.random.default_rng(0)
for name, B, NH in (("d12", 64, 12), ("d48", 16, 25)):
    T, C = 1024, NH * 64
    qkv = cp.asarray(rng.standard_normal((B, T, 3 * C), dtype=np.float32) * 1.5).astype(gpucore.bfloat16)
    out, lse = gpucore.attention_forward(qkv, NH)
    o8, o8t = cp.empty((B * T, C), np.uint8), cp.empty((C, B * T), np.uint8)
    s, am = cp.full(1, 200.0, np.float32), cp.zeros(1, np.float32)
    ms = time_interleaved([
        lambda: gpucore.attention_forward(qkv, NH, out=out, lse=lse),
        lambda: (gpucore.attention_forward(qkv, NH, out=out, lse=lse),
                 fp8_quantize(out.reshape(B * T, C), "e4m3", s, out=o8, out_t=o8t, amax=am)),
        lambda: gpucore.attention_forward(qkv, NH, out=out, lse=lse, out8=o8, out8_t=o8t, scale8=s, amax8=am)])
    print(f"{name} B={B} NH={NH}: forward {ms[0]:.4f} ms, forward + cast {ms[1]:.4f}, forward writing E4M3 "
          f"{ms[2]:.4f} (x{ms[1] / ms[2]:.3f}; {(ms[1] - ms[2]) * (12 if name == 'd12' else 48):.2f} ms a step)")
