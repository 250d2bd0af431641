"""gpucore: GPT-2 training on NVIDIA GPUs, hand-written CUDA kernels driven from Python.

The numpy-like API: every op takes NumPy arrays (runs the NumPy reference on
the CPU) or CuPy arrays (runs the CUDA kernel on the GPU), float32 or
bfloat16 (`gpucore.bfloat16`, i.e. ml_dtypes.bfloat16).

`gpucore.gemm` (our own GEMM kernels, version=1..6) is the ladder's
(gpucore/ladder/gemm.py), imported on first use: training never loads the
ladders. Choices between kernel paths: gpucore.settings.
"""
from .dtypes import bfloat16, float32
from .ops.add import add
from .ops.attention import attention, attention_backward, attention_forward
from .ops.cast import astype
from .ops.matmul import batched_matmul, matmul, matmul_backward, matmul_forward
from .ops.reduce import reduce_max as max  # noqa: A004 - numpy-like names on purpose
from .ops.reduce import reduce_sum as sum  # noqa: A004
from .ops.adamw import adamw_update, grad_norm, stochastic_round
from .ops.sfadamw import sfadamw_average, sfadamw_update
from .ops.classifier import cross_entropy, fused_classifier
from .ops.softmax import softmax, softmax_backward
from .ops.encoder import encoder_backward, encoder_backward_plan, encoder_forward
from .ops.gelu import gelu, gelu_backward
from .ops.layernorm import fused_residual_layernorm_forward, layernorm, layernorm_backward, layernorm_forward
from .ops.fp8 import Fp8Scaling, fp8_amax, fp8_dequantize, fp8_matmul, fp8_quantize, fp8_supported
from .runtime import KernelCompileError, gpu_available

from . import settings

__version__ = "0.1.0"


def __getattr__(name):
    # gpucore.gemm lives in the ladder package, which training must not import: load it on first use.
    if name == "gemm":
        from .ladder.gemm import gemm
        return gemm
    raise AttributeError(f"module 'gpucore' has no attribute {name!r}")


__all__ = [
    "bfloat16", "float32", "gpu_available", "KernelCompileError", "settings",
    "add", "astype", "sum", "max",
    "attention", "attention_forward", "attention_backward",
    "matmul", "matmul_forward", "matmul_backward", "batched_matmul", "gemm",
    "softmax", "softmax_backward", "cross_entropy", "fused_classifier", "grad_norm", "adamw_update",
    "stochastic_round", "sfadamw_update", "sfadamw_average",
    "encoder_forward", "encoder_backward", "encoder_backward_plan", "gelu", "gelu_backward",
    "layernorm", "layernorm_forward", "layernorm_backward", "fused_residual_layernorm_forward",
    "fp8_quantize", "fp8_amax", "fp8_dequantize", "fp8_matmul", "fp8_supported", "Fp8Scaling",
]


def load_ipython_extension(ip):
    """`%load_ext gpucore`: the %%cuda cell magic (gpucore/notebook.py; IPython is imported only then)."""
    from .notebook import load_ipython_extension as load
    load(ip)
