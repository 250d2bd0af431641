"""Probe: could the FP8 fc GEMM write fcproj's E4M3 input itself? (issue 16)

Today (FP8 training) the fc GEMM writes fch (bf16, its BIAS epilogue) and one pass reads fch and
writes GELU(fch) in E4M3 twice, row-major and transposed (fp8_gelu_quantize): 2 + 2 bytes read and
written per value after the GEMM's 2. The alternative: cuBLASLt's GELU_AUX_BIAS epilogue with an
FP8 output -- D = E4M3(GELU(sum) x scale), amax(D) on the way, the sum as the aux matrix (float16:
cuBLASLt's rule when D is E4M3) -- and then a transpose of D's bytes (1 + 1): 1 byte less per
value, and GELU's arithmetic inside the epilogue. Times both at d12 and d48 shapes (interleaved
medians) and compares what they write.
combos=1 first lists which output / aux / C types and epilogues the heuristic has algorithms for
(H100, CUDA 13: the GELU epilogues with an E4M3 D want C's type = the aux type, bf16 or float16).
Run:  PYTHONPATH=. python3 tools/probes/fp8_gelu_epilogue.py [models=d12,d48] [combos=1]
"""
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import cublas, settings
from gpucore.bench import time_interleaved
from gpucore.ops.fp8 import fp8_dequantize, fp8_gelu_quantize, fp8_matmul, fp8_quantize, fp8_transpose

opts = dict(models="d12,d48", combos="0")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
BF = gpucore.bfloat16
rng = np.random.default_rng(0)
MODELS = {"d12": (65536, 768), "d48": (16384, 1600)}


def rnd(shape, s=1.0):
    return cp.asarray((s * rng.standard_normal(shape)).astype(np.float32)).astype(BF)


def cast(x):
    """x's E4M3 bytes with current scaling, and the (1,) scale_inv the GEMM wants."""
    amax = cp.zeros(1, np.float32)
    x8 = cp.empty(x.shape, np.uint8)
    s = cp.asarray([448.0 / float(cp.abs(x.astype(np.float32)).max())], np.float32)
    fp8_quantize(x, "e4m3", s, out=x8, amax=amax)
    return x8, 1.0 / s


def combos(N, M, K):
    """Which FP8-output configurations cuBLASLt's heuristic offers algorithms for (no launches)."""
    lt = cublas.lt_binding()
    dev, handle, _ = lt.device_state()
    rt = cp.cuda.runtime
    e4m3 = cublas.FP8_TYPES["e4m3"]
    x8, w8 = cp.zeros((N, K), np.uint8), cp.zeros((M, K), np.uint8)
    d8, aux, bias = cp.zeros((N, M), np.uint8), cp.zeros((N, M), BF), cp.zeros(M, BF)
    one, amax = cp.ones(1, np.float32), cp.zeros(1, np.float32)
    aligns = (16, 16, 16, 16)
    names = {rt.CUDA_R_16BF: "bf16", rt.CUDA_R_16F: "fp16", e4m3: "e4m3", None: "default"}
    for epi_name, epi in (("DEFAULT", cublas._EPILOGUE_DEFAULT), ("BIAS", cublas._EPILOGUE_BIAS),
                          ("GELU_AUX", cublas._EPILOGUE_GELU_AUX), ("GELU_AUX_BIAS", cublas._EPILOGUE_GELU_AUX_BIAS)):
        gelu = epi in (cublas._EPILOGUE_GELU_AUX, cublas._EPILOGUE_GELU_AUX_BIAS)
        biased = epi in (cublas._EPILOGUE_BIAS, cublas._EPILOGUE_GELU_AUX_BIAS)
        for tc in (rt.CUDA_R_16BF, rt.CUDA_R_16F):
            for aux_type in ((None, rt.CUDA_R_16BF, rt.CUDA_R_16F, e4m3) if gelu else (None,)):
                for with_amax in (True, False):
                    for fast in (True, False):
                        key = ("probe", epi, tc, aux_type, with_amax, fast, N, M, K)
                        scales = (one.data.ptr, one.data.ptr, one.data.ptr, amax.data.ptr if with_amax else 0)
                        plan = lt.plan(key, handle, 1, 0, M, N, K, K, K, e4m3, e4m3, tc, epi,
                                       bias.data.ptr if biased else 0, aligns, aux_ptr=aux.data.ptr if gelu else 0,
                                       scale_ptrs=scales, fast_accum=fast, td=e4m3, aux_type=aux_type)
                        n = 0 if plan is None else len(plan.candidates)
                        print(f"  {epi_name:<14} C {names[tc]:<5} aux {names[aux_type] if gelu else '-':<8} "
                              f"amax {int(with_amax)} fast {int(fast)}: {n} algorithms")


with settings.using(lt_tune_cache="/tmp/fp8_gelu_epilogue.json"):
    if opts["combos"] == "1":
        combos(*((65536, 3072, 768) if "d12" in opts["models"] else (16384, 6400, 1600)))
    for model in opts["models"].split(","):
        N, C = MODELS[model]
        K, M = C, 4 * C
        x8, sx = cast(rnd((N, K)))
        w8, sw = cast(rnd((M, K), 0.05))
        bias = rnd((M,), 0.1)
        fch = cp.empty((N, M), BF)
        g8a, g8ta = cp.empty((N, M), np.uint8), cp.empty((M, N), np.uint8)
        g8b, g8tb = cp.empty((N, M), np.uint8), cp.empty((M, N), np.uint8)
        am_a, am_b = cp.zeros(1, np.float32), cp.zeros(1, np.float32)
        # the GELU output's scale: from a first run of today's path
        fp8_matmul(x8, w8, "e4m3", "e4m3", sx, sw, out=fch, bias=bias, fast_accum=True)
        g = gpucore.gelu(fch)
        s = cp.asarray([448.0 / 2 / float(cp.abs(g.astype(np.float32)).max())], np.float32)

        def today_gemm():
            fp8_matmul(x8, w8, "e4m3", "e4m3", sx, sw, out=fch, bias=bias, fast_accum=True)

        def today_cast():
            fp8_gelu_quantize(fch, s, out=g8a, out_t=g8ta, amax=am_a)

        def epi_gemm(amax=True):
            cublas.lt_fp8_gemm(x8, w8, g8b, N, M, K, "e4m3", "e4m3", sx, sw, bias=bias, fast_accum=True,
                               gelu_aux=fch16, out_format="e4m3", out_scale=s, out_amax=am_b if amax else None)

        def epi_t():
            fp8_transpose(g8b, out=g8tb)

        for aux_dtype in (BF, np.float16):      # bf16 needs no new kernels downstream; float16 is Lt's rule
            fch16 = cp.empty((N, M), aux_dtype)
            try:
                epi_gemm()
                break
            except Exception as e:      # noqa: BLE001 -- report what cuBLASLt said, then the next
                print(f"{model}: the FP8-output GELU_AUX_BIAS GEMM with a {np.dtype(aux_dtype).name} aux failed: {e}")
        else:
            continue
        print(f"{model}: aux {np.dtype(aux_dtype).name}")
        today_gemm(), today_cast(), epi_t()
        cp.cuda.Device().synchronize()
        # what each wrote: the aux against fch, D against today's bytes, the amax
        f16 = fch16.astype(np.float32)
        fbf = fch.astype(np.float32)
        rel = float(cp.abs(f16 - fbf).max() / cp.abs(fbf).max())
        s_inv = 1.0 / float(s[0])
        da = fp8_dequantize(g8a[:2048].get(), "e4m3", s_inv)      # NumPy: the first 2048 rows
        db = fp8_dequantize(g8b[:2048].get(), "e4m3", s_inv)
        same = float((g8a == g8b).mean())
        gap = float(np.abs(da - db).max() / np.abs(da).max())
        tsame = bool((g8tb == g8b.T).all())
        print(f"{model} {N}x{M}x{K}: aux vs fch max diff {rel:.2e} of max; D bytes equal to today's {100 * same:.2f}%, "
              f"max gap {gap:.3e} of amax; amax today {float(am_a[0]):.5f} epilogue {float(am_b[0]):.5f}; "
              f"transpose ok {tsame}")
        fns = {"today: GEMM (bias, bf16 fch)": today_gemm,
               "today: GELU + cast (x8, x8T)": today_cast,
               "today: both": lambda: (today_gemm(), today_cast()),
               "epilogue: GEMM (GELU_AUX_BIAS, E4M3 D, amax)": epi_gemm,
               "epilogue: GEMM without amax": lambda: epi_gemm(False),
               "epilogue: transpose": epi_t,
               "epilogue: both": lambda: (epi_gemm(), epi_t())}
        times = time_interleaved(list(fns.values()), rounds=9, repeat=10)
        for name, t in zip(fns, times):
            print(f"  {model} {name:<46} {t:.4f} ms")
        print(f"  {model} per layer saved: {times[2] - times[6]:+.4f} ms (x{times[2] / times[6]:.3f})")
