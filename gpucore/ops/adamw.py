"""AdamW over the flat parameter buffer, and the gradient's global L2 norm (kernels_cu/adamw.cu).

One launch updates every parameter of the model: fp32 master weights, fp32
m and v, the optional bf16 working copy (params_lowp), with decoupled weight
decay only inside `decay_spans` (GPT-2 decays its matrices, not biases or
layernorm gains). The update rule is PyTorch's AdamW:

    g  = grads * grad_scale * clip,   clip = min(1, max_grad_norm / (grad_norm + 1e-6))
    m  = beta1 m + (1 - beta1) g;     v = beta2 v + (1 - beta2) g^2
    p -= lr * (m / (1 - beta1^step) / (sqrt(v / (1 - beta2^step)) + eps) + wd * p)

Gradient clipping needs no host synchronisation: `grad_norm(grads)` leaves a
0-d float32 array on the device (two-stage fixed-grid reduction: deterministic,
no atomics) and the update kernel reads it from device memory. `grad_norm` is
taken as given: pass the norm of the gradient you want clipped (the clip scale
multiplies grads * grad_scale).

Without fp32 master weights (`master_weights=` "bf16", "sr", "kahan"; the
default "fp32" is the above): params are the bf16 weights themselves, the
update d = -lr * (m_hat / (sqrt(v_hat) + eps) + wd * p) is computed in fp32
from p = float(params) and rounded back to bf16 by nearest-even ("bf16": an
update below half an ulp is lost, so training stalls), stochastically ("sr":
unbiased, from a counter-based hash of (seed, step, element index), no
generator state), or with a bf16 Kahan compensation buffer ("kahan": the
rounding error is added back at the next step). Memory per parameter: fp32
master + bf16 copy 14 bytes with m and v, "sr"/"bf16" 10, "kahan" 12.
`stochastic_round` is that rounding on its own; its NumPy version computes
the same hash with uint32 arithmetic, so CPU and GPU agree bit for bit.

The reference runs in float64 and rounds once to float32; the kernel computes
in float32, so they agree to float32 rounding (bf16 modes: to that rounding
before the bf16 one, so a value that lands near a bf16 rounding boundary may
round the other way). The fp32-master kernel takes the square root and the
division on the SFU's approximations (a few ulp of the update term: an error
far below p's own ulp): the step runs at the GPU's power cap, where the
IEEE sequences' instructions cost step time (kernels_cu/adamw.cu's header).
"""
from __future__ import annotations

import numbers

import numpy as np

from .. import dtypes, runtime
from .. import profiler
from ._common import check_array, output

UPDATE_BLOCK = 256
UPDATE_BLOCKS_PER_SM = 8       # grid-stride loop; 8 x 256 threads fills an SM at 40 registers
NORM_BLOCK = 512
NORM_BLOCKS_PER_SM = 4
MAX_BOUNDS = 48 * 1024 // 4    # the boundary table lives in (default-limit) dynamic shared memory

_BOUNDS_CACHE: dict[tuple, object] = {}   # (device id, boundaries) -> device int32 array

MASTER_WEIGHTS = ("fp32", "bf16", "sr", "kahan")
_MASTER_ALIASES = {"none": "bf16", "none-sr": "sr", "none-kahan": "kahan", "float32": "fp32"}
LOWP_MODE = {"bf16": 0, "sr": 1, "kahan": 2}   # the kernel's `mode`


# ----------------------------------------------------------- helpers -------

def check_real(name, x, *, lo=None, lo_open=False, hi=None, hi_open=False):
    """x as a float, checked (not bool, not NaN, within the bounds); TypeError/ValueError naming `name`.
    Shared with ops/sfadamw.py, as are decay_mask, device_bounds and check_uint."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(x).__name__}")
    x = float(x)
    if x != x:
        raise ValueError(f"{name}: must not be NaN")
    if lo is not None and (x < lo or (lo_open and x == lo)):
        raise ValueError(f"{name}: must be {'>' if lo_open else '>='} {lo}, got {x}")
    if hi is not None and (x > hi or (hi_open and x == hi)):
        raise ValueError(f"{name}: must be {'<' if hi_open else '<='} {hi}, got {x}")
    return x


def decay_boundaries(decay_spans, n: int) -> list[int]:
    """Sorted boundaries [s0, e0, s1, e1, ...] of the merged, non-empty decay spans.

    None means the whole buffer is decayed; [] means nothing is.
    """
    if decay_spans is None:
        return [0, n] if n else []
    try:
        spans = [tuple(s) for s in decay_spans]
    except TypeError:
        raise TypeError("decay_spans: expected a list of (start, stop) pairs") from None
    clean = []
    for s in spans:
        if len(s) != 2 or not all(isinstance(e, numbers.Integral) and not isinstance(e, bool) for e in s):
            raise TypeError(f"decay_spans: each span must be a (start, stop) pair of ints, got {s!r}")
        a, b = int(s[0]), int(s[1])
        if not 0 <= a <= b <= n:
            raise ValueError(f"decay_spans: span ({a}, {b}) is not within [0, {n}] with start <= stop")
        if a < b:
            clean.append((a, b))
    clean.sort()
    merged: list[list[int]] = []
    for a, b in clean:
        if merged and a <= merged[-1][1]:          # overlapping or touching: one span
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [e for span in merged for e in span]


def decay_mask(bounds: list[int], n: int) -> np.ndarray:
    """(n,) bool: True inside the spans of a boundary table (decay_boundaries)."""
    mask = np.zeros(n, dtype=bool)
    for a, b in zip(bounds[0::2], bounds[1::2]):
        mask[a:b] = True
    return mask


def device_bounds(bounds: list[int]):
    """The boundary table on the current device, uploaded once per distinct table."""
    cupy = runtime.cupy
    key = (cupy.cuda.Device().id, tuple(bounds))
    arr = _BOUNDS_CACHE.get(key)
    if arr is None:
        if len(_BOUNDS_CACHE) > 64:                 # a training run uses one table; keep the cache small
            _BOUNDS_CACHE.clear()
        arr = cupy.asarray(np.asarray(bounds if bounds else [0], dtype=np.int32))
        _BOUNDS_CACHE[key] = arr
    return arr


def normalize_master_weights(master_weights) -> str:
    """'fp32', 'bf16', 'sr' or 'kahan' (also 'none' = 'bf16', 'none-sr' = 'sr'); ValueError otherwise."""
    mw = _MASTER_ALIASES.get(master_weights, master_weights) if isinstance(master_weights, str) else None
    if mw not in MASTER_WEIGHTS:
        raise ValueError(f"master_weights: must be one of {', '.join(MASTER_WEIGHTS)} "
                         f"(or none-sr), got {master_weights!r}")
    return mw


def check_uint(name, x, bits):
    """x as an int in [0, 2^bits); TypeError/ValueError naming `name`."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if not 0 <= x < (1 << bits):
        raise ValueError(f"{name}: must be in [0, 2^{bits}), got {x}")
    return int(x)


# ----------------------------------------------------------- stochastic rounding

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def sr_keys(seed: int, step: int) -> tuple[int, int]:
    """The two 32-bit keys of (seed, step) for the stochastic-rounding hash (host, exact integers)."""
    k = _splitmix64(_splitmix64(seed & _M64) ^ (step & _M64))
    return k & 0xFFFFFFFF, k >> 32


def _mix32(x: np.ndarray) -> np.ndarray:
    """lowbias32 on a uint32 array (wrapping arithmetic, as the kernel's u32)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def sr_bits_reference(n: int, k1: int, k2: int, offset: int = 0) -> np.ndarray:
    """(n,) uint32: the 16 random bits (low half) of elements offset .. offset + n - 1."""
    with np.errstate(over="ignore"):
        idx = np.arange(n, dtype=np.uint32) + np.uint32(offset)
        return _mix32(_mix32(idx ^ np.uint32(k1)) + np.uint32(k2)) >> np.uint32(16)


def stochastic_round_reference(x, bits) -> np.ndarray:
    """float32 x rounded to bf16 with random bits (< 2^16): add them to the dropped half, truncate."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    with np.errstate(over="ignore"):
        h = ((u + bits.astype(np.uint32)) >> np.uint32(16)).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    h[nan] = ((u[nan] >> np.uint32(16)) & np.uint32(0x8000)).astype(np.uint16) | np.uint16(0x7FC0)
    return h.view(dtypes.bfloat16)


def stochastic_round(x, *, seed: int, step: int, index_offset: int = 0, out=None):
    """float32 x (1-D) rounded to bfloat16 stochastically, element i with the hash of (seed, step, i + offset).

    Unbiased: E[float(result)] = x (for x inside bf16's finite range). The "sr" master-weights
    update rounds with exactly these bits. index_offset: the elements' position in a larger buffer
    (a shard), so a sharded update rounds as the whole buffer would.
    """
    check_array("x", x, dtype=np.float32, ndim=1)
    seed = check_uint("seed", seed, 64)
    step = check_uint("step", step, 64)
    index_offset = check_uint("index_offset", index_offset, 32)
    xp = runtime.array_module(x, out)
    out = output("out", out, xp, x.shape, dtypes.bfloat16)
    k1, k2 = sr_keys(seed, step)
    if xp is np:
        out[...] = stochastic_round_reference(x, sr_bits_reference(x.size, k1, k2, index_offset))
        return out
    n = x.size
    if n:
        kernel = runtime.get_kernel("adamw", "adamw_stochastic_round_kernel")
        grid = max(1, min(-(-n // UPDATE_BLOCK), runtime.sm_count() * UPDATE_BLOCKS_PER_SM))
        runtime.launch(kernel, grid, UPDATE_BLOCK, (out, x, np.int32(n), np.uint32(k1), np.uint32(k2),
                                                    np.uint32(index_offset)))
    return out


# ----------------------------------------------------------- grad norm -----

def grad_norm_reference(grads: np.ndarray) -> float:
    """float64 sqrt(sum(grads^2))."""
    g = np.asarray(grads, dtype=np.float64).reshape(-1)
    return float(np.sqrt(np.dot(g, g)))


@profiler.profiled("grad norm", nbytes=profiler.io_bytes)
def grad_norm(grads, out=None):
    """Global L2 norm of grads ((n,) float32 or bfloat16) as a 0-d float32 array (on grads' device)."""
    check_array("grads", grads, ndim=1)
    xp = runtime.array_module(grads, out)
    out = output("out", out, xp, (), np.float32)
    if xp is np:
        out[...] = grad_norm_reference(grads)
        return out
    n = grads.size
    if n == 0:
        out.fill(0)
        return out
    suf = dtypes.kernel_suffix(grads.dtype)
    num_blocks = max(1, min(runtime.sm_count() * NORM_BLOCKS_PER_SM,
                            -(-n // (NORM_BLOCK * (16 // grads.dtype.itemsize)))))
    partials = xp.empty(num_blocks, dtype=np.float32)
    k1 = runtime.get_kernel("adamw", f"adamw_grad_norm_stage1_kernel_{suf}")
    k2 = runtime.get_kernel("adamw", "adamw_grad_norm_stage2_kernel")
    runtime.launch(k1, num_blocks, NORM_BLOCK, (partials, grads, np.int32(n)))
    runtime.launch(k2, 1, 1024, (out, partials, np.int32(num_blocks)))
    return out


_grad_norm = grad_norm   # adamw_update's `grad_norm` argument shadows the function


# ----------------------------------------------------------- AdamW ---------

def adamw_reference(params, grads, m, v, *, lr, step, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
                    decay_spans=None, grad_norm=None, max_grad_norm=None, grad_scale=1.0):
    """float64 (params, m, v) after one AdamW step; the inputs are not modified."""
    n = params.size
    p = np.asarray(params, dtype=np.float64).copy()
    m = np.asarray(m, dtype=np.float64).copy()
    v = np.asarray(v, dtype=np.float64).copy()
    scale = float(grad_scale)
    if max_grad_norm is not None:
        norm = grad_norm_reference(grads) if grad_norm is None else float(np.asarray(grad_norm, np.float64))
        scale *= min(1.0, max_grad_norm / (norm + 1e-6))
    g = np.asarray(grads, dtype=np.float64) * scale
    wd = np.where(decay_mask(decay_boundaries(decay_spans, n), n), weight_decay, 0.0)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    mhat = m / (1 - beta1 ** step)
    vhat = v / (1 - beta2 ** step)
    p -= lr * (mhat / (np.sqrt(vhat) + eps) + wd * p)
    return p, m, v


def adamw_lowp_reference(params, grads, m, v, *, master_weights, kahan_comp=None, seed=0, index_offset=0,
                         lr, step, **kw):
    """bf16 params without master weights: (params bf16, m, v float64, kahan_comp bf16 or None) after one step.

    The new fp32 value is the float64 AdamW step from p = float(params) rounded once to float32 (the
    kernel's fp32 result up to its rounding); then "bf16" rounds it to nearest even, "sr"
    stochastically with the hash of (seed, step, index), "kahan" adds the compensation in float32
    arithmetic (NumPy float32 adds are IEEE, as the kernel's) and keeps the new rounding error.
    kw: as adamw_reference (beta1, beta2, eps, weight_decay, decay_spans, clipping, grad_scale).
    """
    p32 = np.asarray(params).astype(np.float32)
    p_new, m_new, v_new = adamw_reference(p32, grads, m, v, lr=lr, step=step, **kw)
    out, comp = round_lowp_reference(master_weights, p32, p_new, kahan_comp=kahan_comp, seed=seed, step=step,
                                     index_offset=index_offset)
    return out, m_new, v_new, comp


def round_lowp_reference(master_weights, p32, p_new, *, kahan_comp=None, seed=0, step=1, index_offset=0):
    """The bf16 weights (and Kahan compensation, else None) after an update from bf16 values p32 (as
    float32) to the float64 values p_new, as the lowp kernels round: the new value rounded once to
    float32, then to bf16 by nearest even ("bf16"), stochastically ("sr": bits of (seed, step, index)),
    or with the compensation added in float32 arithmetic ("kahan")."""
    mode = normalize_master_weights(master_weights)
    p32 = np.asarray(p32, dtype=np.float32)
    comp = None
    if mode == "bf16":
        out = p_new.astype(np.float32).astype(dtypes.bfloat16)
    elif mode == "sr":
        k1, k2 = sr_keys(seed, step)
        out = stochastic_round_reference(p_new.astype(np.float32), sr_bits_reference(p32.size, k1, k2, index_offset))
    elif mode == "kahan":
        d = (p_new - p32.astype(np.float64)).astype(np.float32)          # the update, as the kernel's fp32 d
        u = d + np.asarray(kahan_comp).astype(np.float32)
        out = (p32 + u).astype(dtypes.bfloat16)
        comp = (u - (out.astype(np.float32) - p32)).astype(dtypes.bfloat16)
    else:
        raise ValueError("master_weights: the bf16 rounding is for 'bf16', 'sr' or 'kahan'")
    return out, comp


def check_update_arrays(params, grads, moment, v, *, params_lowp, kahan_comp, grad_norm, master_weights, seed,
                        index_offset):
    """The argument checks every fused optimizer update shares (AdamW's m, schedule-free's z: `moment`
    is (name, array)); returns (master_weights, n, seed, index_offset, xp)."""
    mname, marr = moment
    mw = normalize_master_weights(master_weights)
    check_array("params", params, dtype=np.float32 if mw == "fp32" else dtypes.bfloat16, ndim=1)
    n = params.size
    check_array("grads", grads, shape=(n,))
    check_array(mname, marr, dtype=np.float32, shape=(n,))
    check_array("v", v, dtype=np.float32, shape=(n,))
    if params_lowp is not None:
        if mw != "fp32":
            raise ValueError(f"params_lowp: only with master_weights='fp32' (with {mw!r} the params are bf16)")
        check_array("params_lowp", params_lowp, dtype=dtypes.bfloat16, shape=(n,))
    if (kahan_comp is not None) != (mw == "kahan"):
        raise ValueError("kahan_comp: required with master_weights='kahan', and only then")
    if kahan_comp is not None:
        check_array("kahan_comp", kahan_comp, dtype=dtypes.bfloat16, shape=(n,))
    seed = check_uint("seed", seed, 64)
    index_offset = check_uint("index_offset", index_offset, 32)
    if grad_norm is not None:
        check_array("grad_norm", grad_norm, dtype=np.float32)
        if grad_norm.size != 1:
            raise ValueError(f"grad_norm: expected a 0-d (or one-element) array, got shape {tuple(grad_norm.shape)}")
    xp = runtime.array_module(params, grads, marr, v, params_lowp, grad_norm, kahan_comp)
    return mw, n, seed, index_offset, xp


def check_update_scalars(n, grads, *, beta2, eps, weight_decay, grad_scale, max_grad_norm, decay_spans,
                         grad_norm):
    """The scalar checks every fused optimizer update shares, the decay boundary table, and the
    gradient norm computed when clipping asks for one that was not given. Returns
    (beta2, eps, weight_decay, grad_scale, max_grad_norm, bounds, grad_norm)."""
    beta2 = check_real("beta2", beta2, lo=0.0, hi=1.0, hi_open=True)
    eps = check_real("eps", eps, lo=0.0)
    weight_decay = check_real("weight_decay", weight_decay)
    grad_scale = check_real("grad_scale", grad_scale)
    if max_grad_norm is not None:
        max_grad_norm = check_real("max_grad_norm", max_grad_norm, lo=0.0, lo_open=True)
    bounds = decay_boundaries(decay_spans, n)
    if len(bounds) > MAX_BOUNDS:
        raise ValueError(f"decay_spans: {len(bounds) // 2} disjoint spans after merging; at most "
                         f"{MAX_BOUNDS // 2} fit the kernel's shared-memory table")
    if max_grad_norm is not None and grad_norm is None:
        grad_norm = _grad_norm(grads)
    return beta2, eps, weight_decay, grad_scale, max_grad_norm, bounds, grad_norm


@profiler.profiled("adamw", nbytes=profiler.io_bytes)
def adamw_update(params, grads, m, v, *, lr, step, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
                 decay_spans=None, grad_norm=None, max_grad_norm=None, grad_scale=1.0, params_lowp=None,
                 master_weights="fp32", kahan_comp=None, seed=0, index_offset=0):
    """One AdamW step, in place on params, m and v; returns params.

    params, m, v: (n,) float32; grads: (n,) float32 or bfloat16.
    decay_spans: (start, stop) element ranges that get weight decay; None = all, [] = none.
    grad_norm: 0-d float32 array (e.g. from grad_norm(grads), may stay on the device); with
      max_grad_norm it sets the clip scale min(1, max_grad_norm / (grad_norm + 1e-6)) inside the
      kernel. max_grad_norm without grad_norm computes grad_norm(grads) first. grad_norm without
      max_grad_norm has no effect.
    params_lowp: optional (n,) bfloat16, written with bf16(params) in the same pass.
    master_weights: "fp32" (the default: params are fp32 master weights), or params are the (n,)
      bfloat16 weights themselves, rounded back after the fp32 update by "bf16" (nearest even),
      "sr" (stochastic, bits from (seed, step, index_offset + i)) or "kahan" (with kahan_comp,
      an (n,) bfloat16 compensation buffer updated in place, zeros at the start). No params_lowp then.
    seed (int >= 0), index_offset (the first element's index in the whole buffer, for shards): "sr" only.
    """
    mw, n, seed, index_offset, xp = check_update_arrays(params, grads, ("m", m), v, params_lowp=params_lowp,
                                                        kahan_comp=kahan_comp, grad_norm=grad_norm,
                                                        master_weights=master_weights, seed=seed,
                                                        index_offset=index_offset)
    lr = check_real("lr", lr, lo=0.0)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step: expected an int (1 for the first step), got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"step: must be >= 1 (bias correction divides by 1 - beta^step), got {step}")
    beta1 = check_real("beta1", beta1, lo=0.0, hi=1.0, hi_open=True)
    beta2, eps, weight_decay, grad_scale, max_grad_norm, bounds, grad_norm = check_update_scalars(
        n, grads, beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
        max_grad_norm=max_grad_norm, decay_spans=decay_spans, grad_norm=grad_norm)

    if mw != "fp32":
        return _adamw_update_lowp(params, grads, m, v, xp=xp, mode=mw, kahan_comp=kahan_comp, seed=seed,
                                  index_offset=index_offset, bounds=bounds, lr=lr, step=step, beta1=beta1,
                                  beta2=beta2, eps=eps, weight_decay=weight_decay, decay_spans=decay_spans,
                                  grad_norm=grad_norm, max_grad_norm=max_grad_norm, grad_scale=grad_scale)
    if xp is np:
        p, m_new, v_new = adamw_reference(params, grads, m, v, lr=lr, step=step, beta1=beta1, beta2=beta2,
                                          eps=eps, weight_decay=weight_decay, decay_spans=decay_spans,
                                          grad_norm=grad_norm, max_grad_norm=max_grad_norm,
                                          grad_scale=grad_scale)
        params[...] = p
        m[...] = m_new
        v[...] = v_new
        if params_lowp is not None:
            params_lowp[...] = params.astype(dtypes.bfloat16)
        return params
    if n == 0:
        return params
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    dev_bounds = device_bounds(bounds)
    kernel = runtime.get_kernel("adamw", f"adamw_update_kernel_{dtypes.kernel_suffix(grads.dtype)}")
    grid = max(1, min(-(-n // (4 * UPDATE_BLOCK)), runtime.sm_count() * UPDATE_BLOCKS_PER_SM))
    runtime.launch(kernel, grid, UPDATE_BLOCK, (
        params, m, v,
        params_lowp if params_lowp is not None else params,   # not written when write_lowp == 0
        grads, dev_bounds,
        grad_norm if (grad_norm is not None and max_grad_norm is not None) else params,  # not read when max_norm == 0
        np.int32(n), np.int32(len(bounds)), np.int32(params_lowp is not None),
        np.float32(lr), np.float32(beta1), np.float32(beta2), np.float32(1.0 - beta1), np.float32(1.0 - beta2),
        np.float32(bc1), np.float32(bc2),
        np.float32(eps), np.float32(weight_decay), np.float32(grad_scale),
        np.float32(max_grad_norm if max_grad_norm is not None else 0.0)),
        shared_mem=4 * len(bounds))
    return params


def _adamw_update_lowp(params, grads, m, v, *, xp, mode, kahan_comp, seed, index_offset, bounds, lr, step,
                       beta1, beta2, eps, weight_decay, decay_spans, grad_norm, max_grad_norm, grad_scale):
    """adamw_update on bf16 params without master weights (arguments already checked)."""
    if xp is np:
        p, m_new, v_new, comp = adamw_lowp_reference(
            params, grads, m, v, master_weights=mode, kahan_comp=kahan_comp, seed=seed, index_offset=index_offset,
            lr=lr, step=step, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            decay_spans=decay_spans, grad_norm=grad_norm, max_grad_norm=max_grad_norm, grad_scale=grad_scale)
        params[...] = p
        m[...] = m_new
        v[...] = v_new
        if comp is not None:
            kahan_comp[...] = comp
        return params
    n = params.size
    if n == 0:
        return params
    k1, k2 = sr_keys(seed, step)
    kernel = runtime.get_kernel("adamw", f"adamw_update_lowp_kernel_{dtypes.kernel_suffix(grads.dtype)}")
    grid = max(1, min(-(-n // UPDATE_BLOCK), runtime.sm_count() * UPDATE_BLOCKS_PER_SM))
    runtime.launch(kernel, grid, UPDATE_BLOCK, (
        params, m, v,
        kahan_comp if kahan_comp is not None else params,      # not touched unless mode == kahan
        grads, device_bounds(bounds),
        grad_norm if (grad_norm is not None and max_grad_norm is not None) else m,   # not read when max_norm == 0
        np.int32(n), np.int32(len(bounds)), np.int32(LOWP_MODE[mode]),
        np.float32(lr), np.float32(beta1), np.float32(beta2), np.float32(1.0 - beta1), np.float32(1.0 - beta2),
        np.float32(1.0 - beta1 ** step),
        np.float32(1.0 - beta2 ** step), np.float32(eps), np.float32(weight_decay), np.float32(grad_scale),
        np.float32(max_grad_norm if max_grad_norm is not None else 0.0),
        np.uint32(k1), np.uint32(k2), np.uint32(index_offset)),
        shared_mem=4 * len(bounds))
    return params
