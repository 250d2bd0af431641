"""GELU, tanh approximation as in GPT-2, forward and backward (kernels_cu/gelu.cu).

    gelu(x)  = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))
    dx       = gelu'(x) * dout                       (activation grad: =)

The reference computes in float64 and rounds once to the input dtype. The
kernels compute in float32 through the equivalent sigmoid form
x * sigmoid(2u) with __expf, so they agree with the reference to a few
float32 ulps (and to bf16 rounding in bfloat16).
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, runtime
from ._common import check_array, check_same_dtype, output

BLOCK = 256
UNROLL = 4          # 16-byte packs per thread, as in gelu.cu

_K = np.sqrt(2.0 / np.pi)
_A = 0.044715


def _sigmoids(x64):
    """s = sigmoid(2u) = 0.5 (1 + tanh u) and 1 - s, without cancellation.

    The tanh form 0.5 x (1 + tanh u) loses everything in the negative tail even
    in float64: at x = -6.27, 1 + tanh(u) ~ 2e-12 carries tanh's 1e-16 absolute
    error, 5e-5 relative -- more than the float32 kernels' own error (a GPU test
    caught the reference, not the kernel). exp overflow -> inf -> 0 is exact here.
    """
    u = _K * (x64 + _A * x64 ** 3)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-2.0 * u)), 1.0 / (1.0 + np.exp(2.0 * u))


def gelu_reference(x: np.ndarray) -> np.ndarray:
    """float64 GELU (tanh approximation) = x * sigmoid(2u)."""
    x64 = np.asarray(x, dtype=np.float64)
    s, _ = _sigmoids(x64)
    return x64 * s


def gelu_backward_reference(dout: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 dx = gelu'(x) * dout, gelu' = s + 2 x s (1 - s) u'."""
    x64 = np.asarray(x, dtype=np.float64)
    s, one_minus_s = _sigmoids(x64)
    grad = s + 2.0 * x64 * s * one_minus_s * _K * (1.0 + 3.0 * _A * x64 * x64)
    return grad * np.asarray(dout, dtype=np.float64)


def _grid(n: int, dtype) -> int:
    per_block = BLOCK * UNROLL * (16 // np.dtype(dtype).itemsize)   # elements
    return -(-n // per_block)


def gelu(x, out=None):
    """GELU of x (float32 or bfloat16, any shape), elementwise; out may be x."""
    check_array("x", x)
    xp = runtime.array_module(x, out)
    out = output("out", out, xp, x.shape, x.dtype)
    if xp is np:
        out[...] = gelu_reference(x).astype(x.dtype)
        return out
    n = x.size
    if n == 0:
        return out
    kernel = runtime.get_kernel("gelu", f"gelu_forward_kernel_{dtypes.kernel_suffix(x.dtype)}")
    runtime.launch(kernel, _grid(n, x.dtype), BLOCK, (out, x, np.int32(n)))
    return out


def gelu_backward(dout, x, dx=None):
    """dx = gelu'(x) * dout (overwritten, not accumulated); dx may alias dout."""
    check_array("dout", dout)
    check_array("x", x, shape=dout.shape)
    check_same_dtype(dout=dout, x=x)
    xp = runtime.array_module(dout, x, dx)
    dx = output("dx", dx, xp, dout.shape, dout.dtype)
    if xp is np:
        dx[...] = gelu_backward_reference(dout, x).astype(dout.dtype)
        return dx
    n = dout.size
    if n == 0:
        return dx
    kernel = runtime.get_kernel("gelu", f"gelu_backward_kernel_{dtypes.kernel_suffix(dout.dtype)}")
    runtime.launch(kernel, _grid(n, dout.dtype), BLOCK, (dx, dout, x, np.int32(n)))
    return dx
