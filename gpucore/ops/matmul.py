"""The training matmul: linear layers (x @ W^T + b) and numpy-like matmuls, on cuBLAS.

    matmul_forward   out (N, M) = x (N, K) @ weight (M, K)^T + bias (M,) [+ residual]   [gelu_out = gelu(out)]
    matmul_backward  dx = dout @ weight [=], dweight += dout^T @ x [+=], dbias += dout.sum(0) [+=]
    batched_matmul   (Bt, M, N) = alpha * op(a) @ op(b) + beta * out   (attention v1)
    matmul           numpy-like 2-D / 3-D a @ b

The GEMMs run in cuBLAS (gpucore/cublas.py: cuBLASLt when it loads, else
gemmEx; batched: gemmStridedBatchedEx). Our own GEMM kernels are lessons, not
training: gpucore/ladder/gemm.py (`gpucore.gemm(version=...)`).

Bias in the forward: fused into the GEMM by cuBLASLt's bias epilogue, so it
costs no extra pass. Fallback (no cuBLASLt, settings.cublaslt False, or a
bf16 bias into a float32 out): a small kernel (kernels_cu/matmul.cu) writes
the broadcast bias into `out`, then gemmEx runs with beta = 1 -- one
pure-write pass over out, about +30% time at 65536 x 768 x 2304
(tools/notes/matmul.md).

GELU (the MLP's activation): matmul_forward(..., gelu_out=) also writes gelu(out).
With bfloat16 operands it runs in the GEMM's epilogue (cuBLASLt GELU_AUX_BIAS:
the sum is written once as `out`, its GELU as `gelu_out`), which saves the
separate GELU pass over the (N, 4C) activation (tools/notes/profile.md). The
epilogue applies GELU to the float32 sum before rounding, so gelu_out can
differ from gelu(out as stored) by bf16 rounding; the reference and float32
runs use the separate kernel (ops/gelu.py), which agrees with the float64
reference to float32 rounding. The backward's gelu' stays gelu_backward's one
pass (which also sums dx's columns for the fc bias): cuBLASLt's DGELU epilogue
was measured no faster and removed (tools/notes/profile.md).

Bias gradient in the backward: the deterministic column-sum kernel
(gpucore/ops/colsum.py) reads dout once more, after the GEMMs. In the GPT-2
backward three of the four bias gradients skip this pass: the gelu /
layernorm backward that writes their dout sums its columns on the way
(settings.fused_bias_grads). Measured and removed (tools/notes/matmul.md):
the column sum on a side stream, and cuBLASLt's BGRADB epilogue.

Precision: bf16 inputs multiply on tensor cores with float32 accumulation and
write bf16 or float32; float32 inputs use plain FP32 arithmetic (never TF32),
so they match the float64 NumPy reference to ~1e-6. NumPy inputs run that
reference.

Every argument is validated before any launch. Arrays bigger than 2^31
elements are allowed (cuBLAS takes 64-bit sizes; the logits are 65536 x
50304); matmul.cu indexes with 64-bit where that matters.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, runtime, settings
from .. import profiler
from ..cublas import gemm_ex, lt_gemm
from ._common import check_array, check_same_dtype, output, overlaps
from .add import add as _add
from .colsum import colsum
from .gelu import gelu as _gelu, gelu_reference

F32, BF16 = dtypes.float32, dtypes.bfloat16


# ------------------------------------------------------------------ checks ----

def _check(name, x, **kw):
    """check_array without the 32-bit element limit (cuBLAS takes 64-bit sizes)."""
    return check_array(name, x, max_elements=None, **kw)


def out_dtypes(in_dtype):
    """Output dtypes cuBLAS supports for this input dtype with float32 compute."""
    return (F32, BF16) if in_dtype == BF16 else (F32,)


def _output(name, out, xp, shape, dtype, in_dtype):
    """`out` checked (shape, an allowed dtype, device), or a fresh array of `dtype`."""
    return output(name, out, xp, shape, dtype, allowed=out_dtypes(in_dtype), max_elements=None)


def _device(xp, name, arr):
    if arr is not None and (xp is np) != isinstance(arr, np.ndarray):
        raise TypeError(f"{name}: must live on the same device as the inputs")


# --------------------------------------------------------------- references ----

def _f64(x):
    return np.asarray(x, dtype=np.float64)


def batched_matmul_reference(a, b, out=None, transpose_a=False, transpose_b=False, alpha=1.0, beta=0.0,
                             out_dtype=None):
    """alpha * op(a) @ op(b) + beta * out in float64, rounded once to the output dtype."""
    A = _f64(a).swapaxes(-1, -2) if transpose_a else _f64(a)
    B = _f64(b).swapaxes(-1, -2) if transpose_b else _f64(b)
    r = alpha * (A @ B)
    if beta != 0.0:
        r = r + beta * _f64(out)
    return r.astype(out_dtype or (out.dtype if out is not None else a.dtype))


def matmul_forward_reference(x, weight, bias=None, out_dtype=None):
    r = _f64(x) @ _f64(weight).T
    if bias is not None:
        r = r + _f64(bias)
    return r.astype(out_dtype or x.dtype)


def matmul_backward_reference(dout, x, weight):
    """(dx, dweight, dbias) in float64, without accumulation."""
    d = _f64(dout).reshape(-1, dout.shape[-1])
    xx = _f64(x).reshape(-1, x.shape[-1])
    return (d @ _f64(weight)).reshape(x.shape), d.T @ xx, d.sum(axis=0)




# ------------------------------------------------------------------ GEMMs ----

def _scale_inplace(out, beta):
    """The K = 0 case: out = beta * out (a GEMM with an empty sum)."""
    if beta == 0.0:
        out.fill(0)
    elif beta != 1.0:
        out[...] = (out.astype(np.float32) * np.float32(beta)).astype(out.dtype)


def _gelu_epilogue_ok(out, aux) -> bool:
    """cuBLASLt's GELU epilogue here: when settings.gelu_epilogue is on, bf16 only (float32 keeps
    the exact separate kernel), the aux matrix 16-byte aligned with a row length (its leading
    dimension) divisible by 8."""
    return (settings.current().gelu_epilogue and out.dtype == BF16 and aux.dtype == BF16
            and out.shape[-1] % 8 == 0 and aux.data.ptr % 16 == 0 and out.data.ptr % 16 == 0)


def _train_gemm(a, b, out, M, N, K, transpose_a=False, transpose_b=False, beta=0.0, bias=None):
    """The training path's GEMM: cuBLASLt (bias fused) when it can, else gemmEx (+ bias-fill kernel)."""
    # Lt's bias has D's type: a bf16 bias into a float32 out takes the fill.
    if (bias is None or bias.dtype == out.dtype) and lt_gemm(a, b, out, M, N, K, transpose_a, transpose_b,
                                                              1.0, beta, bias):
        return
    if bias is not None:
        _bias_fill(out, bias)
        beta = 1.0
    gemm_ex(a, b, out, M, N, K, transpose_a, transpose_b, 1.0, beta)


def _bias_fill(out2d, bias):
    """out2d (N, M) = broadcast bias (M,): one write pass, 16-byte stores where possible."""
    N, M = out2d.shape
    so, sb = dtypes.kernel_suffix(out2d.dtype), dtypes.kernel_suffix(bias.dtype)
    P = 16 // out2d.dtype.itemsize
    vec = so == sb and M % P == 0 and out2d.data.ptr % 16 == 0 and bias.data.ptr % 16 == 0
    V = P if vec else 1
    k = runtime.get_kernel("matmul", f"matmul_bias_fill_kernel_{'vec' if vec else 'scalar'}_{so}_{sb}")
    strips = -(-M // (32 * V))
    # About 16 blocks of 256 threads per SM in all; each walks rows with a fixed stride.
    row_groups = max(1, min(-(-N // 8), runtime.sm_count() * 16 // strips, 65535))
    runtime.launch(k, (strips, row_groups), (32, 8), (out2d, bias, np.int32(N), np.int32(M)))


def _same_view(xp, a, b) -> bool:
    """Are a and b the same elements in the same layout (the same array, or equal views)?"""
    def ptr(v):
        return v.__array_interface__["data"][0] if xp is np else v.data.ptr
    return a is b or (ptr(a) == ptr(b) and a.shape == b.shape and a.strides == b.strides)


@profiler.profiled("matmul forward", flops=profiler.matmul_forward_flops)
def matmul_forward(x, weight, bias=None, out=None, *, gelu_out=None, residual=None):
    """out (N, M) = x (N, K) @ weight (M, K)^T + bias (M,) [+ residual].

    x may have leading dims (..., K): they are flattened to N rows and out has
    shape (..., M). x, weight (and bias) share a dtype; with bfloat16 inputs,
    out may be bfloat16 (default) or float32; bias has x's dtype or out's.
    gelu_out (out's shape and dtype), optional: also gelu(out) (fused into the
    GEMM's epilogue for bfloat16; see the module docstring).
    residual (out's shape and dtype), optional: added to the sum before it is
    rounded into out (cuBLASLt's C matrix, read in the epilogue): out may be
    residual itself (+=) but not overlap it otherwise. Not with gelu_out.
    """
    _check("x", x)
    if x.ndim < 2:
        raise ValueError(f"x: expected at least 2 dimensions (N, K), got shape {tuple(x.shape)}")
    _check("weight", weight, ndim=2)
    check_same_dtype(x=x, weight=weight)
    K = x.shape[-1]
    M = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"weight: expected shape ({M}, {K}) to match x's last dim {K}, got {tuple(weight.shape)}")
    xp = runtime.array_module(x, weight, bias, out)
    out = _output("out", out, xp, x.shape[:-1] + (M,), x.dtype, x.dtype)
    if bias is not None:
        _check("bias", bias, dtypes_=tuple(dict.fromkeys((x.dtype, out.dtype))), shape=(M,))
        _device(xp, "bias", bias)
    if gelu_out is not None:
        _check("gelu_out", gelu_out, dtypes_=(out.dtype,), shape=out.shape)
        _device(xp, "gelu_out", gelu_out)
        if overlaps(xp, gelu_out, out):
            raise ValueError("gelu_out: must not overlap out (both are outputs)")
    if residual is not None:
        _check("residual", residual, dtypes_=(out.dtype,), shape=out.shape)
        _device(xp, "residual", residual)
        if gelu_out is not None:
            raise ValueError("residual: not with gelu_out (GELU of a sum with the residual is no layer's)")
        if not _same_view(xp, residual, out) and overlaps(xp, residual, out):
            raise ValueError("residual: must be out itself or not overlap it")
    if xp is np:
        r = _f64(x) @ _f64(weight).T
        if bias is not None:
            r = r + _f64(bias)
        if residual is not None:
            r = r + _f64(residual)
        out[...] = r.astype(out.dtype)
        if gelu_out is not None:
            gelu_out[...] = gelu_reference(r).astype(gelu_out.dtype)
        return out
    N = x.size // K if K else int(np.prod(x.shape[:-1]))
    if N == 0 or M == 0:
        return out
    out2d = out.reshape(N, M)
    if residual is not None:            # cuBLASLt adds it as C (beta = 1, read in the epilogue)
        res2d = residual.reshape(N, M)
        in_place = res2d.data.ptr == out2d.data.ptr     # (checked above: then the same view)
        if K > 0 and (bias is None or bias.dtype == out.dtype) and lt_gemm(
                x, weight, out2d, N, M, K, transpose_b=True, beta=1.0, bias=bias, c=None if in_place else res2d):
            return out
        if in_place:                    # else the plain path below, then an add pass
            res2d = res2d.copy()        # (it writes out before the add)
    if K == 0:                          # an empty sum: out = bias (or 0)
        if bias is None:
            out.fill(0)
        else:
            _bias_fill(out2d, bias)
    elif gelu_out is not None and _gelu_epilogue_ok(out, gelu_out) and (bias is None or bias.dtype == out.dtype) \
            and lt_gemm(x, weight, gelu_out.reshape(N, M), N, M, K, transpose_b=True, bias=bias, gelu_aux=out2d):
        return out
    else:
        _train_gemm(x, weight, out2d, N, M, K, transpose_b=True, bias=bias)
    if gelu_out is not None:
        _gelu(out, out=gelu_out)
    if residual is not None:
        _add(out2d, res2d, out=out2d)
    return out


@profiler.profiled("matmul backward", flops=profiler.matmul_backward_flops)
def matmul_backward(dout, x, weight, dx=None, dweight=None, dbias=None, need_dx=True, *,
                    need_dweight=True, need_dbias=True):
    """Gradients of out = x @ weight^T + bias. Returns (dx, dweight, dbias).

    dout (..., M), x (..., K), weight (M, K), all one dtype.
    dx (..., K)     = dout @ weight              [=]   (None returned when need_dx=False)
    dweight (M, K) += dout^T @ x                 [+=]  (zeros allocated when None)
    dbias (M,)     += dout summed over rows      [+=]  (zeros allocated when None)
    With bfloat16 inputs, dx/dweight/dbias may be float32 or bfloat16 (default:
    the input dtype). need_dweight=False / need_dbias=False skip those (None is
    returned): a layer without bias should pass need_dbias=False. dbias comes
    from the two-stage column-sum kernel (ops/colsum.py), after the GEMMs:
    it reads dout once more.
    """
    _check("dout", dout)
    _check("x", x)
    _check("weight", weight, ndim=2)
    check_same_dtype(dout=dout, x=x, weight=weight)
    M, K = weight.shape
    if x.ndim < 2 or x.shape[-1] != K:
        raise ValueError(f"x: expected shape (..., {K}) to match weight {tuple(weight.shape)}, got {tuple(x.shape)}")
    if tuple(dout.shape) != tuple(x.shape[:-1]) + (M,):
        raise ValueError(f"dout: expected shape {tuple(x.shape[:-1]) + (M,)}, got {tuple(dout.shape)}")
    xp = runtime.array_module(dout, x, weight, dx, dweight, dbias)
    in_dt = x.dtype
    if need_dx:
        dx = _output("dx", dx, xp, x.shape, in_dt, in_dt)
    else:
        dx = None
    if need_dweight and dweight is not None:
        _check("dweight", dweight, dtypes_=out_dtypes(in_dt), shape=(M, K))
        _device(xp, "dweight", dweight)
    if need_dbias and dbias is not None:
        _check("dbias", dbias, dtypes_=out_dtypes(in_dt), shape=(M,))
        _device(xp, "dbias", dbias)
    fresh_dw = need_dweight and dweight is None
    if fresh_dw:
        dweight = xp.zeros((M, K), dtype=in_dt) if xp is np else xp.empty((M, K), dtype=in_dt)
    if need_dbias and dbias is None:
        dbias = xp.zeros((M,), dtype=in_dt)
    if not need_dweight:
        dweight = None
    if not need_dbias:
        dbias = None

    if xp is np:
        rdx, rdw, rdb = matmul_backward_reference(dout, x, weight)
        if dx is not None:
            dx[...] = rdx.astype(dx.dtype)
        if dweight is not None:
            dweight[...] = (_f64(dweight) + rdw).astype(dweight.dtype)
        if dbias is not None:
            dbias[...] = (_f64(dbias) + rdb).astype(dbias.dtype)
        return dx, dweight, dbias

    N = x.size // K if K else int(np.prod(x.shape[:-1]))
    dout2d = dout.reshape(N, M)
    x2d = x.reshape(N, K)
    if dx is not None and N and K:
        if M == 0:
            dx.fill(0)
        else:
            _train_gemm(dout2d, weight, dx.reshape(N, K), N, K, M)               # (N,M) @ (M,K)
    if dweight is not None and M and K:
        if N == 0:
            if fresh_dw:
                dweight.fill(0)
        else:
            beta = 0.0 if fresh_dw else 1.0
            _train_gemm(dout2d, x2d, dweight, M, K, N, transpose_a=True, beta=beta)   # (N,M)^T @ (N,K)
    if dbias is not None and M and N:
        colsum(dbias, dout2d)
    return dx, dweight, dbias


# ------------------------------------------------------------------ public ----

def batched_matmul(a, b, out=None, transpose_a=False, transpose_b=False, alpha=1.0, beta=0.0):
    """out (Bt, M, N) = alpha * op(a) @ op(b) + beta * out, one GEMM per batch entry.

    a: (Bt, M, K), or (Bt, K, M) with transpose_a; b: (Bt, K, N), or (Bt, N, K)
    with transpose_b. float32, or bfloat16 (then out may be bfloat16 or float32;
    default: a's dtype). beta != 0 reads `out`, which must then be given.
    GPU: one cublasGemmStridedBatchedEx on the current stream.
    """
    _check("a", a, ndim=3)
    _check("b", b, ndim=3)
    check_same_dtype(a=a, b=b)
    Bt = a.shape[0]
    M, K = (a.shape[2], a.shape[1]) if transpose_a else (a.shape[1], a.shape[2])
    Kb, N = (b.shape[2], b.shape[1]) if transpose_b else (b.shape[1], b.shape[2])
    if b.shape[0] != Bt:
        raise ValueError(f"b: batch size {b.shape[0]} differs from a's {Bt}")
    if Kb != K:
        raise ValueError(f"b: inner dimension {Kb} differs from a's {K} (shapes {a.shape}, {b.shape}, "
                         f"transpose_a={transpose_a}, transpose_b={transpose_b})")
    alpha, beta = float(alpha), float(beta)
    if beta != 0.0 and out is None:
        raise ValueError("out: beta != 0 reads out, so out must be given")
    xp = runtime.array_module(a, b, out)
    out = _output("out", out, xp, (Bt, M, N), a.dtype, a.dtype)
    if xp is np:
        out[...] = batched_matmul_reference(a, b, out, transpose_a, transpose_b, alpha, beta, out.dtype)
        return out
    if Bt == 0 or M == 0 or N == 0:
        return out
    if K == 0:
        _scale_inplace(out, beta)
        return out
    gemm_ex(a, b, out, M, N, K, transpose_a, transpose_b, alpha, beta, batch=Bt)
    return out


def matmul(a, b, out=None):
    """numpy-like a @ b for 2-D (M, K) @ (K, N), batched 3-D (Bt, M, K) @ (Bt, K, N),
    and (Bt, M, K) @ (K, N) (b shared by every batch entry). cuBLAS on the GPU."""
    _check("a", a, ndim=(2, 3))
    _check("b", b, ndim=(2, 3))
    check_same_dtype(a=a, b=b)
    if a.ndim == 2 and b.ndim == 3:
        raise ValueError(f"b: a 3-D b needs a 3-D a, got shapes {a.shape} @ {b.shape}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"b: inner dimension {b.shape[-2]} differs from a's {a.shape[-1]} "
                         f"(shapes {a.shape} @ {b.shape})")
    if a.ndim == 3 and b.ndim == 3:
        return batched_matmul(a, b, out=out)
    xp = runtime.array_module(a, b, out)
    K, N = b.shape
    M = a.size // K if K else int(np.prod(a.shape[:-1]))
    shape = a.shape[:-1] + (N,)
    out = _output("out", out, xp, shape, a.dtype, a.dtype)
    if xp is np:
        out[...] = batched_matmul_reference(a, b, out_dtype=out.dtype)
        return out
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.fill(0)
        return out
    gemm_ex(a, b, out, M, N, K)   # a 3-D a is contiguous: rows of (Bt*M, K)
    return out


