"""Probe: the one-pass attention backward's FP8 variant (dK, dV's E5M2 bytes written by the kernel)
against the plain kernel + the dqkv cast, at d12 B=64 (or B NH T given), timed in alternation:
  plain kernel | FP8 kernel | the dqkv cast (with bias sums) | the Q columns' cast |
  plain + cast (what training ran) | FP8 kernel + Q cast (attention_backward_fp8)
Run:  PYTHONPATH=. python3 tools/probes/attention_fp8_fused.py [B NH T] [-DFLAG ...]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore.bench import time_interleaved
from gpucore.ops import attention as attn
from gpucore.ops.fp8 import fp8_quantize, fp8_quantize_columns

_shape = [a for a in sys.argv[1:] if not a.startswith("-D")]
B, NH, T = (int(v) for v in _shape[:3]) if len(_shape) >= 3 else (64, 12, 1024)
hd, C = 64, NH * 64
N = B * T
rng = cp.random.default_rng(0)
bf16 = gpucore.dtypes.bfloat16
qkv = (rng.standard_normal((B, T, 3 * C), dtype=cp.float32)).astype(bf16)
dout = rng.standard_normal((B, T, C), dtype=cp.float32).astype(bf16)
out, lse = gpucore.attention_forward(qkv, NH)
dqkv = cp.empty_like(qkv)
g8, g8t = cp.empty((N, 3 * C), np.uint8), cp.empty((3 * C, N), np.uint8)
scale, amax = cp.asarray([256.0], np.float32), cp.zeros(1, np.float32)
db = cp.zeros(3 * C, np.float32)
part = cp.empty((B, 2 * C), np.float32)
print(f"B={B} NH={NH} T={T}: fused path applies: {attn.fp8_fused_reason(qkv, NH) is None}")


def plain():
    attn.backward_v3_onepass(dout, qkv, out, lse, NH, dqkv)


def fp8_kernel():
    attn.backward_v3_onepass(dout, qkv, out, lse, NH, dqkv, fp8=(g8, g8t, amax, part, scale))


def cast():
    fp8_quantize(dqkv.reshape(N, 3 * C), "e5m2", scale, out=g8, out_t=g8t, amax=amax, dbias=db)


def q_cast():
    fp8_quantize_columns(dqkv.reshape(N, 3 * C), C, scale, out=g8, out_t=g8t, amax=amax, dbias=db[:C])


def plain_and_cast():
    plain()
    cast()


def fused():
    attn.attention_backward_fp8(dout, qkv, out, lse, NH, dqkv, scale, g8, g8t, amax, db)


names = ["plain kernel", "FP8 kernel", "dqkv cast", "Q columns' cast", "plain + cast", "fused (FP8 kernel + Q cast)"]
times = time_interleaved([plain, fp8_kernel, cast, q_cast, plain_and_cast, fused], rounds=9, repeat=5)
for n, t in zip(names, times):
    print(f"{n:32s} {t:.4f} ms")

# Variants of the FP8 kernel compiled with -D flags given after the shape (e.g. -DV3F8_NO_T), timed
# against the plain and the FP8 kernel: which part of the FP8 epilogue costs what.
flags = [a for a in sys.argv[1:] if a.startswith("-D")]
if flags:
    import math
    from gpucore import runtime
    D = attn._preprocess(dout, out, NH)
    dqacc = cp.empty((B * NH, -(-T // 64), hd, 64), dtype=np.float32)

    def variant(opts):
        k = runtime.get_kernel("attention/flash_v3_bwd1", "attention_backward_onepass_kernel_v3_hd64_g2_bf16_e5m2",
                               options=attn.v3_compile_options() + tuple(opts), arch=attn.V3_ARCH)
        args = (dqkv, dqacc, qkv, dout, lse, D, np.int32(T), np.int32(NH), np.float32(1.0 / math.sqrt(hd)),
                g8, g8t, amax, part, scale)
        return lambda: runtime.launch(k, B * NH, 256, args, shared_mem=attn.v3_onepass_smem(hd, 2) + attn.ONEPASS_FP8_SUMS_BYTES)
    sets = [()] + [(f,) for f in flags] + [tuple(flags)]
    times = time_interleaved([plain, fp8_kernel] + [variant(o) for o in sets], rounds=9, repeat=5)
    print(f"{'plain (with preprocess)':40s} {times[0]:.4f} ms\n{'FP8 (with preprocess)':40s} {times[1]:.4f} ms")
    for o, t in zip(sets, times[2:]):
        print(f"{'FP8 kernel ' + (' '.join(o) or '(all)'):40s} {t:.4f} ms")
