"""Probe: what the forward GEMMs' epilogues cost. For each linear of d12 (B*T = 65536) and d48
(B*T = 16384): out = x @ W^T timed with cuBLASLt's BIAS epilogue, without a bias, and (fc) with
GELU_AUX_BIAS / GELU_AUX; each raced as the training path races it (heuristic candidates, or with
search=N also N searched configurations), timed in alternation. Answers: would moving the biases
out of the GEMMs (into the kernels that read the outputs) pay?
Run:  PYTHONPATH=. python3 tools/probes/gemm_bias_epilogue.py [search=0] [models=d12,d48]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import settings
from gpucore.bench import time_interleaved
from gpucore.ops.matmul import matmul_forward

opts = dict(search="0", models="d12,d48")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
BF = gpucore.bfloat16
rng = np.random.default_rng(0)
MODELS = {"d12": (65536, 768), "d48": (16384, 1600)}


def rnd(shape, s=1.0):
    return cp.asarray((s * rng.standard_normal(shape)).astype(np.float32)).astype(BF)


print(f"{'GEMM':<14}{'M':>7}{'N':>6}{'K':>6}  {'variant':<16}{'ms':>8} {'TFLOP/s':>8} {'vs bias':>8}")
with settings.using(lt_search=int(opts["search"]), lt_tune_cache="/tmp/gemm_bias_epilogue.json"):
    for model in opts["models"].split(","):
        M, C = MODELS[model]
        for name, n_out, k_in in (("qkv", 3 * C, C), ("attproj", C, C), ("fc", 4 * C, C), ("fcproj", C, 4 * C)):
            x, w, b = rnd((M, k_in)), rnd((n_out, k_in), 0.05), rnd((n_out,), 0.1)
            out, aux = cp.empty((M, n_out), BF), cp.empty((M, n_out), BF)
            variants = {"bias": lambda: matmul_forward(x, w, b, out=out),
                        "no bias": lambda: matmul_forward(x, w, None, out=out)}
            if name == "fc":
                variants["bias+gelu_aux"] = lambda: matmul_forward(x, w, b, out=aux, gelu_out=out)
                variants["gelu_aux"] = lambda: matmul_forward(x, w, None, out=aux, gelu_out=out)
            ms = time_interleaved(list(variants.values()), rounds=9, repeat=10)
            flops = 2.0 * M * n_out * k_in
            for (v, _), t in zip(variants.items(), ms):
                print(f"{model + ' ' + name:<14}{M:>7}{n_out:>6}{k_in:>6}  {v:<16}{t:8.4f} "
                      f"{flops / t / 1e9:8.1f} {ms[0] / t:8.3f}")
            del x, w, b, out, aux

# The bias as one more input column (x gets a column of ones, W the bias; zeros pad K to Kp): a
# bias-free GEMM (and GELU_AUX without BIAS) at the cost of Kp - K more columns. Same results.
if opts.get("augment", "1") == "1":
    print(f"\n{'K-augmented':<14}{'M':>7}{'N':>6}{'K':>6}  {'variant':<16}{'ms':>8} {'TFLOP/s':>8} {'vs bias':>8}")
    with settings.using(lt_search=int(opts["search"]), lt_tune_cache="/tmp/gemm_bias_epilogue.json"):
        for model in opts["models"].split(","):
            M, C = MODELS[model]
            for name, n_out, k_in in (("qkv", 3 * C, C), ("fc", 4 * C, C)):
                x, w, b = rnd((M, k_in)), rnd((n_out, k_in), 0.05), rnd((n_out,), 0.1)
                out, aux = cp.empty((M, n_out), BF), cp.empty((M, n_out), BF)
                gelu = name == "fc"
                fns = {"bias": (lambda: matmul_forward(x, w, b, out=aux, gelu_out=out)) if gelu
                       else (lambda: matmul_forward(x, w, b, out=out))}
                keep = []
                for pad in (8, 16, 32, 64):
                    xa, wa = cp.zeros((M, k_in + pad), BF), cp.zeros((n_out, k_in + pad), BF)
                    xa[:, :k_in], xa[:, k_in] = x, 1.0
                    wa[:, :k_in], wa[:, k_in] = w, b
                    keep.append((xa, wa))
                    fns[f"K+{pad}"] = ((lambda xa=xa, wa=wa: matmul_forward(xa, wa, None, out=aux, gelu_out=out))
                                       if gelu else (lambda xa=xa, wa=wa: matmul_forward(xa, wa, None, out=out)))
                ms = time_interleaved(list(fns.values()), rounds=9, repeat=10)
                for (v, _), t in zip(fns.items(), ms):
                    print(f"{model + ' ' + name:<14}{M:>7}{n_out:>6}{k_in:>6}  {v:<16}{t:8.4f} "
                          f"{2.0 * M * n_out * k_in / t / 1e9:8.1f} {ms[0] / t:8.3f}")
                del x, w, b, out, aux, keep
