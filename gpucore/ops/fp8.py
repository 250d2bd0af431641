"""FP8: scaled casts to E4M3 / E5M2, per-tensor scaling state, and the FP8 GEMM (kernels_cu/fp8.cu).

    fp8_quantize(x, fmt, scale, out=, out_t=, amax=)   uint8 FP8 bytes of x * scale (and/or transposed)
    fp8_requantize_gated(x, fmt, scale, gate, ...)       the same when the device flag gate != 0
    fp8_gelu_backward(dout, x, scale, out=, out_t=, ...)  E5M2 bytes of gelu_backward's dx, fused (+ dbias, gelu(x)^T)
    fp8_amax(x, amax)                                    amax = max(amax, max |x|)
    fp8_transpose(x8, out=)                              FP8 bytes (R, C) -> (C, R)
    fp8_dequantize(q, fmt, scale_inv)                    float32 q * scale_inv (the reference's view)
    fp8_dequantize_bf16(q, scale_inv)                    bf16 of E4M3 q * scale_inv (how kernels read an E4M3-kept fch)
    fp8_matmul(a8, b8, a_fmt, b_fmt, a_si, b_si, ...)    bf16 (a @ b^T) * a_si * b_si [+ bias] [+=], or its E4M3 bytes
    Fp8Scaling(n, formats, xp, ...)                      scale / scale_inv / amax / amax history of n tensors

The recipe is Transformer Engine's: E4M3 (4 exponent bits, max 448) for weights and activations,
E5M2 (max 57344, more range) for gradients; one fp32 scale per tensor maps its amax near the
format's largest value; the GEMM multiplies by 1/scale (cuBLASLt's A/B scale pointers) and
accumulates in fp32. FP8 data is held in uint8 arrays (CuPy has no float8 dtype); the format
travels beside it as "e4m3" / "e5m2". On NumPy the reference is exact: clip(f32(x) * scale,
+-max) cast by ml_dtypes (round to nearest even), which the GPU cast matches bit for bit.

Scaling (Fp8Scaling): "delayed" casts with the scale made from the amax of the last `history`
steps (each cast records this step's amax on the way: no extra pass), "current" reads each tensor
once more for its own amax just before the cast, "adaptive" casts with the last step's scale and
re-casts on the device only when this tensor's amax says the scale was wrong (saturation, or too
far below the range). In delayed mode a tensor's very first cast is current (there is no history
yet: an unscaled gradient of 1e-6 would flush to zero in E5M2); adaptive needs no such rule.

FP8 needs an Ada or Hopper GPU (sm_89+) and cuBLASLt: fp8_supported() says why not otherwise.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import cublas, dtypes, runtime
from .. import profiler
from ._common import check_array, overlaps
from .add import add
from .colsum import colsum_reference, reduce_partials
from .gelu import MAX_GRID_Y, gelu, gelu_backward_reference, gelu_reference

FORMATS = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
TILE = 64                     # the casts' tile width (and the GELU backward's height), 256 threads
CAST_ROWS = 128               # fp8_cast_kernel_*'s tile height (fp8.cu CAST_ROWS; tools/notes/fp8.md)
GELU_BWD_ROWS = 128           # fp8_gelu_backward_kernel's (fp8.cu GELU_BWD_ROWS)
TRANSPOSE_TILES = 2           # fp8_transpose_kernel: 64-column tiles per block (fp8.cu's TRANSPOSE_CT)
GATED_BLOCKS_PER_SM = 8       # a gated launch's grid: this many blocks per SM walk the tiles (see _grid)
SLOT = 4                      # floats per tensor in Fp8Scaling's arrays (16 bytes: aligned scale pointers)
U8 = np.dtype(np.uint8)
F32 = np.dtype(np.float32)


def _fmt(fmt: str):
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected 'e4m3' or 'e5m2', got {fmt!r}")
    return FORMATS[fmt]


def fp8_supported() -> tuple[bool, str]:
    """(True, "") on a GPU with FP8 tensor cores and cuBLASLt, else (False, why)."""
    if not runtime.gpu_available():
        return False, "FP8 needs an NVIDIA GPU (none found)"
    cc = int(runtime.device_arch())
    if cc < 89:
        name = runtime.device_properties()["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        return False, (f"FP8 needs an Ada or Hopper GPU (compute capability 8.9+); this {name} is "
                       f"{cc // 10}.{cc % 10}: use --dtype bf16")
    if cublas.lt_binding() is None:
        return False, f"FP8 matmuls need cuBLASLt ({cublas.lt_status()})"
    return True, ""


_FP8_OK: dict[int, tuple[bool, str]] = {}


def _require_fp8() -> None:
    """fp8_supported() for the current device, asked once per device (the FP8 GEMM runs ~150 times
    a d12 step, and the question costs a driver call)."""
    dev = runtime.cupy.cuda.runtime.getDevice()
    if dev not in _FP8_OK:
        _FP8_OK[dev] = fp8_supported()
    ok, why = _FP8_OK[dev]
    if not ok:
        raise RuntimeError(why)


# --------------------------------------------------------------- references ----

def fp8_quantize_reference(x, fmt: str, scale: float) -> np.ndarray:
    """uint8 bytes of clip(f32(x) * f32(scale), -max, max) in `fmt`, round to nearest even."""
    t, fmax = _fmt(fmt)
    y = np.asarray(x, dtype=np.float32) * np.float32(scale)
    with np.errstate(invalid="ignore"):
        y = np.clip(y, np.float32(-fmax), np.float32(fmax))
    return y.astype(t).view(np.uint8)


def fp8_dequantize(q, fmt: str, scale_inv: float = 1.0) -> np.ndarray:
    """float32 values of FP8 bytes q (a NumPy uint8 array) times scale_inv."""
    t, _ = _fmt(fmt)
    return np.asarray(q, dtype=np.uint8).view(t).astype(np.float32) * np.float32(scale_inv)


def fp8_dequantize_bf16(q, scale_inv) -> np.ndarray:
    """bfloat16 values of E4M3 bytes q (NumPy uint8) times scale_inv: one fp32 product, rounded to
    nearest even -- how the GELU cast and the GELU backward read an fch kept in E4M3 (fp8_cast.cuh
    dequant8_e4m3), before the bf16 path's arithmetic."""
    return fp8_dequantize(q, "e4m3", np.float32(scale_inv)).astype(dtypes.bfloat16)


def _fold_amax(amax, m) -> None:
    """amax (1,) = max(amax, m) with a NaN on either side staying NaN (the kernels' bit max)."""
    amax[...] = m if np.isnan(m) else max(float(amax[0]), float(m))


def _host_scalar(a) -> float:
    return float(a.get()[0] if runtime.is_gpu_array(a) else np.asarray(a).reshape(-1)[0])


# -------------------------------------------------------------------- casts ----

def _check_scalar(name, a, xp):
    check_array(name, a, dtype=np.float32, shape=(1,))
    if (xp is np) != isinstance(a, np.ndarray):
        raise TypeError(f"{name}: must live on the same device as x")


@profiler.profiled("fp8 cast", nbytes=profiler.io_bytes)
def fp8_quantize(x, fmt: str, scale, *, out=None, out_t=None, amax=None, dbias=None):
    """FP8 bytes of x * scale: x (R, C) bfloat16; scale (1,) float32 on x's device.

    out (R, C) and/or out_t (C, R) uint8 receive the cast (row-major, transposed); at least one.
    amax (1,) float32, optional: amax = max(amax, max |x|) (of x, before scaling). dbias (C,)
    bfloat16 or float32, optional, "e5m2" only (a gradient's cast): dbias += the column sums of x
    (float32 in a fixed order on the GPU, from the same pass; float64 in the reference) -- the bias
    gradient of the linear whose output gradient x is. On the GPU R and C must be multiples of 16
    (the FP8 GEMM's rule) and the GPU sm_89+.
    Returns (out, out_t).
    """
    return _quantize(x, fmt, scale, out, out_t, amax, None, dbias=dbias)


@profiler.profiled("fp8 re-cast (gated)")
def fp8_requantize_gated(x, fmt: str, scale, gate, *, out=None, out_t=None):
    """fp8_quantize(x, fmt, scale, out=, out_t=) when gate (1,) float32 != 0, decided on the
    device (adaptive scaling: fp8_guard set gate and scale); a launch that returns at once else."""
    return _quantize(x, fmt, scale, out, out_t, None, gate)


@profiler.profiled("fp8 gelu cast", nbytes=profiler.io_bytes)
def fp8_gelu_quantize(x, scale, *, out=None, out_t=None, amax=None, x_scale_inv=None):
    """E4M3 bytes of gelu(x) * scale: the same bits as gelu(x) (bf16, gelu.cu's kernel) followed by
    fp8_quantize(., "e4m3", scale, ...), in one pass that never writes the bf16 GELU output. x (R, C)
    bfloat16 (the fc output, GELU's input); out / out_t / amax (of gelu(x)) as fp8_quantize's.
    x_scale_inv (1,) float32, optional: x is E4M3 bytes (uint8) read as fp8_dequantize_bf16(x,
    x_scale_inv) (fch kept in E4M3, settings.fp8_fch_e4m3)."""
    return _quantize(x, "e4m3", scale, out, out_t, amax, None, gelu_first=True, x_scale_inv=x_scale_inv)


@profiler.profiled("fp8 gelu cast (gated re-run)")
def fp8_gelu_quantize_gated(x, scale, gate, *, out=None, out_t=None, x_scale_inv=None):
    """fp8_gelu_quantize(x, scale, out=, out_t=, x_scale_inv=) when gate (1,) != 0 on the device
    (adaptive scaling)."""
    return _quantize(x, "e4m3", scale, out, out_t, None, gate, gelu_first=True, x_scale_inv=x_scale_inv)


def check_cast_args(x, fmt, scale, out, out_t, amax, gate, xp, xname="x"):
    """The cast's argument checks (x (R, C) bf16 already checked), and on the GPU its layout rules."""
    _fmt(fmt)
    _check_scalar("scale", scale, xp)
    if amax is not None:
        _check_scalar("amax", amax, xp)
    if gate is not None:
        _check_scalar("gate", gate, xp)
    if out is None and out_t is None:
        raise ValueError("out, out_t: give at least one output")
    R, C = x.shape
    for name, o, shape in (("out", out, (R, C)), ("out_t", out_t, (C, R))):
        if o is not None:
            check_array(name, o, dtype=np.uint8, shape=shape)
            if (xp is np) != isinstance(o, np.ndarray):
                raise TypeError(f"{name}: must live on the same device as x")
    if xp is np:
        return
    if R % 16 or C % 16:
        raise ValueError(f"{xname}: FP8 casts on the GPU need rows and columns that are multiples of 16, got {R} x {C}")
    for name, a in ((xname, x), ("out", out), ("out_t", out_t)):
        if a is not None and a.data.ptr % 16:
            raise ValueError(f"{name}: must be 16-byte aligned")


def _grid(R, C, gated, rows=TILE):
    """Tiles (C/64, R/rows) for the casts (rows: CAST_ROWS for fp8_cast's, GELU_BWD_ROWS for the
    GELU backward's; at most MAX_GRID_Y row tiles, the kernels walk the rest). A gated launch
    (adaptive re-cast) gets at most GATED_BLOCKS_PER_SM blocks per SM that walk the tiles in a loop,
    so a no-op costs a few blocks' start, not tens of thousands (and a real re-cast still fills the
    GPU). Same bits either way."""
    gx, gy = -(-C // TILE), min(-(-R // rows), MAX_GRID_Y)   # the kernels walk the rest
    if gated:
        gy = max(1, min(gy, GATED_BLOCKS_PER_SM * runtime.sm_count() // gx))
    return gx, gy


def _check_dbias(dbias, C, xp, xname):
    check_array("dbias", dbias, shape=(C,))
    if dbias.dtype not in (dtypes.bfloat16, np.dtype(np.float32)):
        raise TypeError(f"dbias: must be bfloat16 or float32, got {dtypes.name(dbias.dtype)}")
    if (xp is np) != isinstance(dbias, np.ndarray):
        raise TypeError(f"dbias: must live on the same device as {xname}")


def _check_x8(x_scale_inv, xp, gelu: bool):
    """x_scale_inv given (x holds E4M3 bytes, checked by the caller): only the GELU kernels read such
    an x (their _x8 variants)."""
    if not gelu:
        raise ValueError("x_scale_inv: only the GELU cast reads an E4M3 x")
    _check_scalar("x_scale_inv", x_scale_inv, xp)


def _quantize(x, fmt, scale, out, out_t, amax, gate, gelu_first=False, dbias=None, x_scale_inv=None):
    x8 = x_scale_inv is not None
    check_array("x", x, dtype=np.uint8 if x8 else dtypes.bfloat16, ndim=2)
    xp = runtime.array_module(x, scale, out, out_t, amax, gate, dbias, x_scale_inv)
    if x8:
        _check_x8(x_scale_inv, xp, gelu_first)
    check_cast_args(x, fmt, scale, out, out_t, amax, gate, xp)
    R, C = x.shape
    if dbias is not None:
        if fmt != "e5m2":
            raise ValueError(f"dbias: only a gradient's cast (e5m2) sums its columns, got {fmt!r}")
        _check_dbias(dbias, C, xp, "x")
    if xp is np:
        if gate is not None and float(gate[0]) == 0.0:
            return out, out_t
        if x8:
            x = fp8_dequantize_bf16(x, _host_scalar(x_scale_inv))
        if gelu_first:
            x = gelu_reference(x).astype(dtypes.bfloat16)
        q = fp8_quantize_reference(x, fmt, _host_scalar(scale))
        if out is not None:
            out[...] = q
        if out_t is not None:
            out_t[...] = q.T
        if amax is not None and x.size:
            _fold_amax(amax, np.abs(np.asarray(x, dtype=np.float32)).max())
        if dbias is not None:
            colsum_reference(dbias, x)
        return out, out_t
    if x.size == 0:
        return out, out_t
    null = np.uint64(0)
    if dbias is not None:          # the cast that also sums the columns, then colsum's stage 2
        partials = xp.empty((-(-R // CAST_ROWS), C), np.float32)
        runtime.launch(runtime.get_kernel("fp8", "fp8_cast_colsum_kernel_e5m2"), _grid(R, C, False, CAST_ROWS), 256,
                       (null if out is None else out, null if out_t is None else out_t,
                        null if amax is None else amax, partials, x, scale, np.int32(R), np.int32(C)))
        reduce_partials(dbias, partials)
        return out, out_t
    name = ("fp8_gelu_cast_kernel_e4m3" + ("_x8" if x8 else "")) if gelu_first else f"fp8_cast_kernel_{fmt}"
    xs = (x, x_scale_inv) if x8 else (x,)    # the _x8 kernel takes x's scale_inv right after x (fp8.cu)
    runtime.launch(runtime.get_kernel("fp8", name), _grid(R, C, gate is not None, CAST_ROWS), 256,
                   (null if out is None else out, null if out_t is None else out_t, null if amax is None else amax,
                    *xs, scale, null if gate is None else gate, np.int32(R), np.int32(C)))
    return out, out_t


@profiler.profiled("fp8 gelu backward", nbytes=profiler.io_bytes)
def fp8_gelu_backward(dout, x, scale, *, out=None, out_t=None, amax=None, dbias=None, gelu_t=None,
                      gelu_scale=None, x_scale_inv=None):
    """E5M2 bytes of dx * scale, dx = gelu'(x) * dout in bf16 (gelu_backward's dx, never stored):
    the same bits as gelu_backward followed by fp8_quantize(dx, "e5m2", scale, ...), in one pass.

    dout, x (R, C) bfloat16 (GELU's output gradient and its input); out (R, C) / out_t (C, R) uint8,
    at least one; amax (1,) float32, optional: max(amax, max |dx|); dbias (C,) bfloat16 or float32,
    optional: dbias += the column sums of dx (float32 on the GPU, in a fixed order; float64 in the
    reference). gelu_t (C, R) uint8 with gelu_scale (1,) float32, optional: also the E4M3 bytes of
    gelu(x) * gelu_scale, transposed -- the bits of fp8_gelu_quantize(x, gelu_scale, out_t=gelu_t)
    from the same pass (the GELU output a model did not keep, remade for fcproj's weight gradient).
    x_scale_inv (1,) float32, optional: x is E4M3 bytes (uint8), read as fp8_dequantize_bf16(x,
    x_scale_inv) (fch kept in E4M3, settings.fp8_fch_e4m3).
    Returns (out, out_t).
    """
    return _gelu_backward(dout, x, scale, out, out_t, amax, dbias, None, gelu_t, gelu_scale, x_scale_inv)


@profiler.profiled("fp8 gelu backward (gated re-run)")
def fp8_gelu_backward_gated(dout, x, scale, gate, *, out=None, out_t=None, x_scale_inv=None):
    """fp8_gelu_backward(dout, x, scale, out=, out_t=, x_scale_inv=) when gate (1,) != 0 on the
    device (adaptive scaling's re-cast: dout is still intact, since dx was never written)."""
    return _gelu_backward(dout, x, scale, out, out_t, None, None, gate, x_scale_inv=x_scale_inv)


def _gelu_backward(dout, x, scale, out, out_t, amax, dbias, gate, gelu_t=None, gelu_scale=None, x_scale_inv=None):
    x8 = x_scale_inv is not None
    check_array("dout", dout, dtype=dtypes.bfloat16, ndim=2)
    check_array("x", x, dtype=np.uint8 if x8 else dtypes.bfloat16, shape=dout.shape)
    xp = runtime.array_module(dout, x, scale, out, out_t, amax, dbias, gate, gelu_t, gelu_scale, x_scale_inv)
    if x8:
        _check_x8(x_scale_inv, xp, True)
    R, C = dout.shape
    if dbias is not None:
        _check_dbias(dbias, C, xp, "dout")
    if (gelu_t is None) != (gelu_scale is None):
        raise ValueError("gelu_t, gelu_scale: give both or neither")
    if gelu_t is not None:
        _check_scalar("gelu_scale", gelu_scale, xp)
        check_array("gelu_t", gelu_t, dtype=np.uint8, shape=(C, R))
        if (xp is np) != isinstance(gelu_t, np.ndarray):
            raise TypeError("gelu_t: must live on the same device as x")
    if xp is np:
        if gate is not None:
            _check_scalar("gate", gate, xp)
            if float(gate[0]) == 0.0:
                return out, out_t
        if x8:
            x = fp8_dequantize_bf16(x, _host_scalar(x_scale_inv))
        if gelu_t is not None:
            _quantize(x, "e4m3", gelu_scale, None, gelu_t, None, None, gelu_first=True)
        dx = gelu_backward_reference(dout, x).astype(dtypes.bfloat16)
        _quantize(dx, "e5m2", scale, out, out_t, amax, None)
        if dbias is not None:
            colsum_reference(dbias, dx)
        return out, out_t
    check_cast_args(dout, "e5m2", scale, out, out_t, amax, gate, xp, xname="dout")
    for name, a in (("x", x), ("gelu_t", gelu_t)):
        if a is not None and a.data.ptr % 16:
            raise ValueError(f"{name}: must be 16-byte aligned")
    tiles = -(-R // GELU_BWD_ROWS)
    if dout.size == 0:
        return out, out_t
    partials = xp.empty((tiles, C), np.float32) if dbias is not None else None
    null = np.uint64(0)
    # the _x8 kernel takes x's scale_inv right after x (fp8.cu)
    xs = (x, x_scale_inv) if x8 else (x,)
    runtime.launch(runtime.get_kernel("fp8", "fp8_gelu_backward_kernel_e5m2" + ("_x8" if x8 else "")),
                   _grid(R, C, gate is not None, GELU_BWD_ROWS), 256,
                   (null if out is None else out, null if out_t is None else out_t, null if amax is None else amax,
                    null if partials is None else partials, dout, *xs, scale, null if gate is None else gate,
                    null if gelu_t is None else gelu_t, null if gelu_scale is None else gelu_scale,
                    np.int32(R), np.int32(C)))
    if dbias is not None:
        reduce_partials(dbias, partials)
    return out, out_t


@profiler.profiled("fp8 transpose", nbytes=profiler.io_bytes)
def fp8_transpose(x8, *, out=None):
    """out (C, R) uint8 = x8 (R, C)^T: FP8 bytes turned around (the FP8 GEMM wants both operands
    K-contiguous; the LM head's dwte sums over tokens, and dlogits8 / lnf8 are token-major). On the
    GPU R and C must be multiples of 16 and both arrays 16-byte aligned."""
    check_array("x8", x8, dtype=np.uint8, ndim=2, max_elements=None)
    R, C = x8.shape
    xp = runtime.array_module(x8, out)
    if out is None:
        out = xp.empty((C, R), np.uint8)
    check_array("out", out, dtype=np.uint8, shape=(C, R), max_elements=None)
    if xp is np:
        out[...] = x8.T
        return out
    if R % 16 or C % 16:
        raise ValueError(f"x8: the GPU transpose needs rows and columns that are multiples of 16, got {R} x {C}")
    for name, a in (("x8", x8), ("out", out)):
        if a.data.ptr % 16:
            raise ValueError(f"{name}: must be 16-byte aligned")
    if x8.size:
        gx, gy = -(-C // (TILE * TRANSPOSE_TILES)), min(-(-R // TILE), MAX_GRID_Y)   # the kernel walks the rest
        runtime.launch(runtime.get_kernel("fp8", "fp8_transpose_kernel"), (gx, gy), 256,
                       (out, x8, np.int32(R), np.int32(C)))
    return out


@profiler.profiled("fp8 amax", nbytes=profiler.io_bytes)
def fp8_amax(x, amax):
    """amax (1,) float32 = max(amax, max |x|), x bfloat16 (size a multiple of 8 on the GPU)."""
    check_array("x", x, dtype=dtypes.bfloat16)
    xp = runtime.array_module(x, amax)
    _check_scalar("amax", amax, xp)
    if xp is np:
        if x.size:
            _fold_amax(amax, np.abs(np.asarray(x, dtype=np.float32)).max())
        return amax
    if x.size % 8 or x.data.ptr % 16:
        raise ValueError("x: the GPU amax needs a 16-byte aligned array of a multiple of 8 elements")
    if x.size:
        blocks = max(1, min(-(-x.size // (256 * 8)), runtime.sm_count() * 8))
        runtime.launch(runtime.get_kernel("fp8", "fp8_amax_kernel"), blocks, 256, (amax, x, np.int64(x.size)))
    return amax


# ------------------------------------------------------------------ scaling ----

MODES = ("current", "delayed", "adaptive")


class Fp8Scaling:
    """Per-tensor FP8 scales of n tensors, one format each ("e4m3"/"e5m2"), on xp.

    scale[i] multiplies tensor i before its cast, scale_inv[i] = 1/scale[i] goes to the GEMM,
    amax[i] collects this step's max |x| from the casts; end_step() turns them into the next
    step's scales (delayed) and clears amax. `mode` (module docstring; cast() runs it):
      "current"   each cast reads its tensor once more for its own amax first;
      "delayed"   the scale from the amax of the last `history` steps;
      "adaptive"  the scale from the last step's amax (history 1), checked on the device after
                  the cast: when the tensor's own amax left the window -- a value saturated, or
                  the data sits more than `window` binades below the target -- the scale is set
                  from it and a gated re-cast runs (fp8_guard_kernel). Current scaling's result
                  whenever it matters, delayed scaling's single pass otherwise. A cast's guard
                  may also set the scales of tensors cast after it that move with it
                  (cast(predict=), predict_scales): fewer of their casts need the re-cast.
    margin: scales are 2^-margin below the largest value (headroom for growth between steps).
    """

    def __init__(self, n: int, formats, xp, *, mode: str = "delayed", history: int = 16, margin: int = 0,
                 window: int = 1):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        if len(formats) != n:
            raise ValueError(f"formats: expected {n}, got {len(formats)}")
        if history < 1:
            raise ValueError(f"history: must be >= 1, got {history}")
        if window < 0:
            raise ValueError(f"window: must be >= 0, got {window}")
        if mode == "adaptive":
            history = 1
        self.n, self.xp, self.mode, self.history_len = n, xp, mode, history
        self.formats = list(formats)
        self.margin_scale = float(2.0 ** -margin)
        self.window_low = float(2.0 ** -(margin + window))   # recast below fmax * window_low
        self._guard_consts = (np.float32(self.margin_scale), np.float32(self.window_low))
        fmax = np.array([_fmt(f)[1] for f in formats], np.float32)
        self.fmax = xp.asarray(fmax)
        # One 16-byte slot per tensor: cuBLASLt wants its scale pointers 16-byte aligned (a scale at
        # a 4-byte offset fails with CUBLAS_STATUS_NOT_SUPPORTED). scale / scale_inv / amax are
        # strided (n,) views of column 0.
        # slots: scale, scale_inv, amax, scratch (current: a cast's amax; adaptive: a cast's amax, gate), history row
        self._slots = xp.zeros((5, n, SLOT), np.float32)
        self._slots[:2, :, 0] = 1.0
        self.scale, self.scale_inv, self.amax = (self._slots[k, :, 0] for k in range(3))
        # per tensor: scale, scale_inv, amax, a cast's amax, gate -- (1,) views made once (a CuPy
        # slice costs microseconds of host time, and a d12 step asks for them ~600 times)
        self._views = [tuple(self._slots[k, i, :1] for k in range(4)) + (self._slots[3, i, 1:2],)
                       for i in range(n)]
        self._fmax32 = [np.float32(FORMATS[f][1]) for f in self.formats]
        self.history = xp.zeros((history, n), np.float32)
        self.started = np.zeros(n, bool)     # host: has tensor i been cast before (delayed mode)
        self.step_index = 0

    def tensor(self, i: int):
        """(scale, scale_inv, amax) (1,) views of tensor i."""
        return self._views[i][:3]

    @property
    def amax_slots(self):
        """This step's amax of every tensor as one contiguous (n, SLOT) array (column 0; the rest
        stay zero): data-parallel ranks take its max over ranks before end_step(), so that every
        rank turns the same history into the same scales (gpucore/distributed/reducer.py)."""
        return self._slots[2]

    def cast(self, i: int, x, *, out=None, out_t=None, record: bool = True, current: bool = False, dbias=None,
             measured: bool = False, predict: tuple = ()):
        """Tensor i (x, bf16 (R, C)) into out and/or out_t by the mode's rule; record=False: with
        the scale it already has and no amax (the backward's re-cast of a forward tensor);
        current=True: current scaling for this cast whatever the mode (the weights); dbias (an
        e5m2 tensor's): += x's column sums, from the first cast's pass (fp8_quantize).
        measured=True (adaptive): x's producer already folded max |x| into measured_amax(i), so
        the guard runs first and one cast follows with the scale it leaves -- the bytes, scale and
        amax of the cast-then-re-cast, without the second pass.
        predict (adaptive): tensors cast later this step that move with this one; its guard sets
        their scales from this cast's amax (Fp8Scaling.predict_scales)."""
        fmt = self.formats[i]
        scale, _, amax = self.tensor(i)
        if predict and not (record and (measured or (self.can_produce(i) and not current))):
            raise ValueError("predict: only a cast that adaptive scaling's guard checks (record, not current)")
        if measured:
            if self.mode != "adaptive":
                raise ValueError(f"measured: a producer's amax is used by adaptive scaling only, not {self.mode!r}")
            self.started[i] = True
            self._guard(i, predict)
            return fp8_quantize(x, fmt, scale, out=out, out_t=out_t, dbias=dbias)
        if not record:
            return fp8_quantize(x, fmt, scale, out=out, out_t=out_t, dbias=dbias)
        if self.can_produce(i) and not current:
            return self.produce(i, lambda sc, am: fp8_quantize(x, fmt, sc, out=out, out_t=out_t, amax=am, dbias=dbias),
                                lambda sc, gate: fp8_requantize_gated(x, fmt, sc, gate, out=out, out_t=out_t),
                                predict=predict)
        self.prepare(i, x, current=current)
        return fp8_quantize(x, fmt, scale, out=out, out_t=out_t, amax=amax, dbias=dbias)

    def measured_amax(self, i: int):
        """Adaptive mode: the (1,) float32 slot (zero between uses) into which the op that makes
        tensor i may fold its max |x| as it writes x (fp8_amax's bit max), for cast(i, x,
        measured=True); None in the other modes."""
        return self._views[i][3] if self.mode == "adaptive" else None

    def can_produce(self, i: int) -> bool:
        """Can tensor i be cast by the kernel that makes it (produce), with no bf16 copy to measure
        first? Adaptive: always; delayed: once it has a history; current: never."""
        return self.mode == "adaptive" or (self.mode == "delayed" and bool(self.started[i]))

    def produce(self, i: int, first, again, predict: tuple = ()):
        """Tensor i cast by its producer: first(scale, amax) launches the kernel that writes the FP8
        bytes with `scale` and takes the amax into `amax`; adaptive mode then checks that amax on the
        device and calls again(scale, gate), the same kernel gated on `gate` (a no-op unless the
        scale had to change). Needs can_produce(i). predict: as cast()'s (adaptive only)."""
        scale, _, amax = self.tensor(i)
        self.started[i] = True
        if self.mode == "delayed":
            if predict:
                raise ValueError("predict: adaptive scaling's guard sets the predicted scales; delayed has none")
            return first(scale, amax)
        cast_amax, gate = self._views[i][3:]
        first(scale, cast_amax)
        self._guard(i, predict)
        return again(scale, gate)

    def _check_predict(self, i: int, predict: tuple) -> tuple[int, int]:
        """predict (up to two tensor indices) as the guard kernel's (p0, p1), -1 for none."""
        if len(predict) > 2:
            raise ValueError(f"predict: at most 2 tensors, got {len(predict)}")
        for p in predict:
            if not 0 <= p < self.n or p == i:
                raise ValueError(f"predict: tensor {p} is not another of the {self.n} tensors (this one is {i})")
            if self.formats[p] != self.formats[i]:
                raise ValueError(f"predict: tensor {p} is {self.formats[p]}, tensor {i} {self.formats[i]}: "
                                 "a prediction keeps the format")
        return tuple(predict) + (-1,) * (2 - len(predict))

    def predict_scales(self, i: int, a, predict: tuple):
        """NumPy reference of the guard kernel's prediction: tensor i's cast this step took amax a;
        each tensor p in predict gets the scale its last step's amax times a / (i's last step's
        amax) would give, unless an input or the product is zero or not finite."""
        hist = self.history[0]
        hi = np.float32(hist[i])
        if not (a <= np.float32(3.0e38) and a > 0 and hi <= np.float32(3.0e38) and hi > 0):
            return
        ratio = np.float32(a / hi)
        for p in predict:
            m = np.float32(np.float32(hist[p]) * ratio)
            if m <= np.float32(3.0e38) and m > 0:
                ps = np.float32(self._fmax32[p] / m * self._guard_consts[0])
                self.scale[p] = ps
                self.scale_inv[p] = np.float32(1.0) / ps

    def _guard(self, i, predict: tuple = ()):
        """fp8_guard_kernel for tensor i, after a cast that took its amax into the tensor's cast-amax
        slot (the NumPy branch is its reference); predict: the tensors whose scales it sets from
        this cast's amax (predict_scales)."""
        fmax = self._fmax32[i]
        scale, scale_inv, amax, cast_amax, gate = self._views[i]
        margin_scale, low = self._guard_consts
        p0, p1 = self._check_predict(i, predict)
        if self.xp is np:
            a = np.float32(cast_amax[0])
            cast_amax[...] = 0
            _fold_amax(amax, a)
            s = np.float32(scale[0])
            recast = bool(np.isfinite(a) and a > 0 and (a * s > fmax or a * s < fmax * low))
            if recast:
                ns = np.float32(fmax / a * margin_scale)
                scale[...] = ns
                scale_inv[...] = np.float32(1.0) / ns
            gate[...] = 1.0 if recast else 0.0
            if predict:
                self.predict_scales(i, a, predict)
            return
        # The kernel finds tensor i's five values in the slots itself (the views above, on the host).
        runtime.launch(runtime.get_kernel("fp8", "fp8_guard_kernel"), 1, 32,
                       (self._slots, self.history, fmax, margin_scale, low,
                        np.int32(self.n * SLOT), np.int32(SLOT), np.int32(i), np.int32(p0), np.int32(p1)))

    def prepare(self, i: int, x, current: bool = False):
        """Before tensor i's cast: in current mode (and at its first cast in delayed mode, or when
        `current` asks for it) measure x's amax now and set the scale from it."""
        if self.mode == "delayed" and self.started[i] and not current:
            return
        self.started[i] = True
        tmp = self._slots[3, i, :1]          # zero here: the update below reads it and zeroes it again
        fp8_amax(x, tmp)
        self._set_scale(i, tmp)

    def _set_scale(self, i, amax1):
        xp = self.xp
        if xp is np:
            m = float(amax1[0])
            amax1[...] = 0
            if np.isfinite(m) and m > 0:
                self.scale[i] = np.float32(self.fmax[i] / np.float32(m) * np.float32(self.margin_scale))
                self.scale_inv[i] = np.float32(1.0) / self.scale[i]
            return
        # one-tensor update: a history of one row (written before it is read), its own slot
        hist = self._slots[4, i, :1]
        scale, scale_inv, _ = self.tensor(i)
        runtime.launch(runtime.get_kernel("fp8", "fp8_update_scale_kernel"), 1, 32,
                       (scale, scale_inv, amax1, hist, self.fmax[i:i + 1],
                        np.int32(1), np.int32(1), np.int32(0), np.float32(self.margin_scale), np.int32(1)))

    def end_step(self):
        """This step's amax into the history; the scales of the next step from the history's max."""
        slot = self.step_index % self.history_len
        self.step_index += 1
        xp = self.xp
        if xp is np:
            self.history[slot] = self.amax
            self.amax[...] = 0
            m = self.history.max(axis=0)
            ok = np.isfinite(self.history).all(axis=0) & (m > 0)
            new = (self.fmax / np.where(ok, m, 1) * np.float32(self.margin_scale)).astype(np.float32)
            self.scale[ok] = new[ok]
            self.scale_inv[ok] = (np.float32(1.0) / new[ok]).astype(np.float32)
            return
        runtime.launch(runtime.get_kernel("fp8", "fp8_update_scale_kernel"), -(-self.n // 128), 128,
                       (self._slots[0], self._slots[1], self._slots[2], self.history, self.fmax, np.int32(self.n),
                        np.int32(self.history_len), np.int32(slot), np.float32(self.margin_scale), np.int32(SLOT)))

    def state(self) -> dict:
        """Host arrays for a checkpoint."""
        get = (lambda a: a.get()) if self.xp is not np else np.array
        return {"scale": get(self.scale), "history": get(self.history), "started": self.started.copy(),
                "step_index": self.step_index}

    def load_state(self, st: dict):
        saved = np.asarray(st["scale"]).shape
        if saved != (self.n,):
            raise ValueError(f"FP8 scaling state for {saved[0] if saved else 0} tensors, this model scales "
                             f"{self.n} (settings.fp8_lm_head must be what the saving run had)")
        self.scale[...] = self.xp.asarray(st["scale"])
        self.scale_inv[...] = self.xp.asarray((np.float32(1.0) / np.asarray(st["scale"])).astype(np.float32))
        self.history[...] = self.xp.asarray(st["history"])
        self.started[...] = st["started"]
        self.step_index = int(st["step_index"])


# ------------------------------------------------------------------- matmul ----

def fp8_matmul_reference(a8, b8, a_fmt, b_fmt, a_scale_inv, b_scale_inv, bias=None):
    """float64 (dequantized a) @ (dequantized b)^T [+ bias]."""
    a = fp8_dequantize(a8, a_fmt, a_scale_inv).astype(np.float64)
    b = fp8_dequantize(b8, b_fmt, b_scale_inv).astype(np.float64)
    r = a @ b.T
    return r if bias is None else r + np.asarray(bias, dtype=np.float64)


@profiler.profiled("fp8 matmul", flops=lambda r, args, kw: 2.0 * args[0].shape[0] * args[1].shape[0] * args[0].shape[1])
def fp8_matmul(a8, b8, a_fmt: str, b_fmt: str, a_scale_inv, b_scale_inv, *, out=None, bias=None,
               accumulate=False, fast_accum=False, gelu_out=None, residual=None, out_scale=None, out_amax=None):
    """out (M, N) bfloat16 = (a (M, K) @ b (N, K)^T) * a_scale_inv * b_scale_inv [+ bias (N,)] [+ out].

    a8, b8: uint8 FP8 bytes (not both "e5m2"); scales (1,) float32 on the same device.
    accumulate: out += the product (out must be given). fast_accum: Hopper's fast FP8 accumulation.
    gelu_out (M, N) bfloat16, optional: also gelu(out) (of the fp32 sum: cuBLASLt's GELU_AUX
    epilogue; when Lt has no such FP8 algorithm, the gelu kernel after the GEMM).
    residual (M, N) bfloat16, optional: added before the rounding into out (cuBLASLt's C apart
    from D; matmul_forward's residual); not overlapping out, not with accumulate or gelu_out.
    out_scale (1,) float32, optional: out (M, N) is uint8 and receives the E4M3 bytes of the result
    times out_scale (saturating: fp8_quantize_reference of the float32 result; cuBLASLt's FP8 D), and
    out_amax (1,) float32, optional, is SET to max |result| (before the scale). Not with accumulate,
    gelu_out or residual. fch kept in E4M3 (settings.fp8_fch_e4m3).
    """
    _fmt(a_fmt), _fmt(b_fmt)
    if a_fmt == b_fmt == "e5m2":
        raise ValueError("a_fmt, b_fmt: E5M2 x E5M2 has no FP8 GEMM; one operand must be E4M3")
    check_array("a8", a8, dtype=np.uint8, ndim=2, max_elements=None)
    check_array("b8", b8, dtype=np.uint8, ndim=2, max_elements=None)
    M, K = a8.shape
    N = b8.shape[0]
    if b8.shape[1] != K:
        raise ValueError(f"b8: expected (N, {K}) to match a8's K, got {tuple(b8.shape)}")
    xp = runtime.array_module(a8, b8, a_scale_inv, b_scale_inv, out, bias)
    _check_scalar("a_scale_inv", a_scale_inv, xp)
    _check_scalar("b_scale_inv", b_scale_inv, xp)
    if accumulate and out is None:
        raise ValueError("out: accumulate=True adds into out, so out must be given")
    out8 = out_scale is not None
    if out8:
        _check_scalar("out_scale", out_scale, xp)
        if out_amax is not None:
            _check_scalar("out_amax", out_amax, xp)
        if accumulate or gelu_out is not None or residual is not None:
            raise ValueError("out_scale: an E4M3 output not with accumulate, gelu_out or residual")
    elif out_amax is not None:
        raise ValueError("out_amax: only with out_scale (an E4M3 output)")
    if out is None:
        out = xp.empty((M, N), dtype=np.uint8 if out8 else dtypes.bfloat16)
    check_array("out", out, dtype=np.uint8 if out8 else dtypes.bfloat16, shape=(M, N), max_elements=None)
    if bias is not None:
        check_array("bias", bias, dtype=dtypes.bfloat16, shape=(N,))
    if gelu_out is not None:
        check_array("gelu_out", gelu_out, dtype=dtypes.bfloat16, shape=(M, N), max_elements=None)
        if accumulate:
            raise ValueError("gelu_out: not with accumulate=True")
    if residual is not None:
        check_array("residual", residual, dtype=dtypes.bfloat16, shape=(M, N), max_elements=None)
        if accumulate or gelu_out is not None:
            raise ValueError("residual: not with accumulate=True or gelu_out")
        if overlaps(xp, residual, out):
            raise ValueError("residual: must not overlap out (accumulate=True adds into out itself)")
    if xp is np:
        r = fp8_matmul_reference(a8, b8, a_fmt, b_fmt, _host_scalar(a_scale_inv), _host_scalar(b_scale_inv), bias)
        if out8:
            r32 = r.astype(np.float32)
            out[...] = fp8_quantize_reference(r32, "e4m3", _host_scalar(out_scale))
            if out_amax is not None:
                out_amax[...] = np.abs(r32).max() if r32.size else 0.0
            return out
        r = r + (out.astype(np.float64) if accumulate else 0)
        r = r + (residual.astype(np.float64) if residual is not None else 0)
        out[...] = r.astype(out.dtype)
        if gelu_out is not None:
            gelu_out[...] = gelu_reference(r).astype(gelu_out.dtype)
        return out
    if M % 16 or N % 16 or K % 16:
        raise ValueError(f"a8, b8: the FP8 GEMM needs M, N, K multiples of 16, got {M}, {N}, {K}")
    _require_fp8()
    if out8:
        cublas.lt_fp8_gemm(a8, b8, out, M, N, K, a_fmt, b_fmt, a_scale_inv, b_scale_inv, bias=bias,
                           fast_accum=fast_accum, out_format="e4m3", out_scale=out_scale, out_amax=out_amax)
        return out
    if gelu_out is not None:
        try:
            cublas.lt_fp8_gemm(a8, b8, gelu_out, M, N, K, a_fmt, b_fmt, a_scale_inv, b_scale_inv, bias=bias,
                               fast_accum=fast_accum, gelu_aux=out)
            return out
        except RuntimeError:
            pass          # no FP8 algorithm with the GELU epilogue here: the GEMM, then the gelu kernel
    if residual is not None:
        try:
            cublas.lt_fp8_gemm(a8, b8, out, M, N, K, a_fmt, b_fmt, a_scale_inv, b_scale_inv, beta=1.0, bias=bias,
                               fast_accum=fast_accum, c=residual)
            return out
        except RuntimeError:
            pass          # no FP8 algorithm with a C matrix here: the GEMM, then the add
    cublas.lt_fp8_gemm(a8, b8, out, M, N, K, a_fmt, b_fmt, a_scale_inv, b_scale_inv,
                       beta=1.0 if accumulate else 0.0, bias=bias, fast_accum=fast_accum)
    if gelu_out is not None:
        gelu(out, out=gelu_out)
    if residual is not None:
        add(out, residual, out=out)
    return out
