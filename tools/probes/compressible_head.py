"""Probe: the FP8 LM head's thinned dlogits in compressible memory (Compute Data Compression).

Ampere and Hopper can keep an allocation compressed in DRAM and the L2 ("generic" compression,
opted into per physical allocation through the driver's virtual-memory API: cuMemCreate with
allocFlags.compressionType = CU_MEM_ALLOCATION_COMP_GENERIC). With the default thinning the
classifier's E5M2 dlogits are ~97% zero bytes, and each 8192-row chunk's bytes cross DRAM ~5 times
(the classifier writes 412 MB, fp8_transpose reads them and writes the transpose, the dx and dwte
GEMMs read one each): ~16 GB of mostly zeros a d12 step. At the 700 W cap a step's time follows its
joules, and DRAM traffic is part of them. Nothing about the arithmetic changes: the same kernels
read and write the same bytes.

This measures one chunk of the head's backward (the real kernels at d12 shapes, realistic rows: a
Zipf-like prior plus noise, as tools/probes/head_sparse_dlogits.py) with dlogits8 and its transpose
in ordinary memory (CuPy's pool) and in compressible memory, and the logits chunk in either:
ms, joules, watts and clock of the chain classifier -> transpose -> dx GEMM -> dwte GEMM and of each
stage, back to back under NVML's counter; and checks that every output is bit for bit the same.

Run (GPU):  PYTHONPATH=. python3 tools/probes/compressible_head.py [seconds=1] [rounds=2] [p=1.2207e-4]
"""
import ctypes
import sys

import cupy as cp
import numpy as np

import gpucore
from gpucore import power
from gpucore.ops.classifier import dlogits_fp8_scale, fused_classifier, sparse_tau_of
from gpucore.ops.fp8 import fp8_matmul, fp8_quantize, fp8_transpose

opts = dict(seconds="1", rounds="2", p=str(2.0 ** -13), a="1.0", s="3.0")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
R, V, Vp, C, TOKENS = 8192, 50257, 50304, 768, 65536
BF = gpucore.bfloat16

# ---------------------------------------------------------------- the driver's VMM API (ctypes)
ATTR_VMM, ATTR_COMPRESSION = 102, 107          # CU_DEVICE_ATTRIBUTE_*_SUPPORTED
COMP_GENERIC = 1                               # CU_MEM_ALLOCATION_COMP_GENERIC


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Flags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):                 # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Loc),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _Flags)]


class _Access(ctypes.Structure):               # CUmemAccessDesc
    _fields_ = [("location", _Loc), ("flags", ctypes.c_int)]


_cu = ctypes.CDLL("libcuda.so.1")
_U64, _SZ = ctypes.c_ulonglong, ctypes.c_size_t
for name, args in {
        "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
        "cuMemGetAllocationGranularity": [ctypes.POINTER(_SZ), ctypes.POINTER(_Prop), ctypes.c_int],
        "cuMemCreate": [ctypes.POINTER(_U64), _SZ, ctypes.POINTER(_Prop), _U64],
        "cuMemGetAllocationPropertiesFromHandle": [ctypes.POINTER(_Prop), _U64],
        "cuMemAddressReserve": [ctypes.POINTER(_U64), _SZ, _SZ, _U64, _U64],
        "cuMemMap": [_U64, _SZ, _SZ, _U64, _U64],
        "cuMemSetAccess": [_U64, _SZ, ctypes.POINTER(_Access), _SZ]}.items():
    getattr(_cu, name).argtypes = args


def _ok(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: CUresult {rc}")


def attribute(attr, dev=0) -> int:
    v = ctypes.c_int()
    _ok(_cu.cuDeviceGetAttribute(ctypes.byref(v), attr, dev), "cuDeviceGetAttribute")
    return v.value


def vmm_array(shape, dtype, compressed: bool):
    """A CuPy array on its own physical allocation (cuMemCreate + map), compressible if asked and
    granted; returns (array, granted). The memory is never freed (a probe)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    dev = cp.cuda.Device().id
    prop = _Prop(type=1, requestedHandleTypes=0, location=_Loc(1, dev))     # PINNED, DEVICE
    prop.allocFlags.compressionType = COMP_GENERIC if compressed else 0
    gran = _SZ()
    _ok(_cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 1), "granularity")
    size = -(-nbytes // gran.value) * gran.value
    handle, ptr = _U64(), _U64()
    _ok(_cu.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), 0), "cuMemCreate")
    got = _Prop()
    _ok(_cu.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(got), handle), "properties")
    _ok(_cu.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0), "cuMemAddressReserve")
    _ok(_cu.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
    acc = _Access(location=_Loc(1, dev), flags=3)                            # READWRITE
    _ok(_cu.cuMemSetAccess(ptr, size, ctypes.byref(acc), 1), "cuMemSetAccess")
    mem = cp.cuda.UnownedMemory(ptr.value, size, owner=None, device_id=dev)
    arr = cp.ndarray(shape, dtype, memptr=cp.cuda.MemoryPointer(mem, 0))
    return arr, got.allocFlags.compressionType == COMP_GENERIC


# ---------------------------------------------------------------- the head's chunk
def rows(rng):
    """R realistic logit rows (bf16, padded to Vp with -inf-like values) and targets drawn from them."""
    v = cp.arange(V, dtype=cp.float32)
    z = -float(opts["a"]) * cp.log1p(v)[None, :] + float(opts["s"]) * rng.standard_normal((R, V), dtype=cp.float32)
    p = cp.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    u = rng.random((R, 1), dtype=cp.float32)
    target = cp.minimum((cp.cumsum(p, axis=1) < u).sum(axis=1), V - 1).astype(cp.int32)
    logits = cp.zeros((R, Vp), BF)
    logits[:, :V] = z.astype(BF)
    return logits, target


def main():
    meter = power.require_meter()
    sync = cp.cuda.Device().synchronize
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: VMM {attribute(ATTR_VMM)}, "
          f"generic compression {attribute(ATTR_COMPRESSION)}")
    rng = cp.random.default_rng(0)
    logits0, target = rows(rng)
    grad_scale = 1.0 / TOKENS
    s = dlogits_fp8_scale(grad_scale)
    tau = sparse_tau_of(float(opts["p"]), grad_scale, s)
    seed = cp.asarray([7], cp.uint32)
    lnf = rng.standard_normal((R, C), dtype=cp.float32).astype(BF)
    wte = (0.02 * rng.standard_normal((Vp, C), dtype=cp.float32)).astype(BF)
    one, inv = cp.ones(1, cp.float32), cp.asarray([1.0 / s], cp.float32)
    x8, w8t = cp.empty((R, C), cp.uint8), cp.empty((C, Vp), cp.uint8)
    fp8_quantize(lnf, "e4m3", cp.asarray([64.0], cp.float32), out=x8)
    fp8_quantize(wte.T.copy(), "e4m3", cp.asarray([4096.0], cp.float32), out=w8t)
    x8t = fp8_transpose(x8)
    losses = cp.empty(R, cp.float32)

    setups = {}
    for name, comp_d8, comp_logits in (("plain", False, False), ("compressed dlogits8", True, False),
                                       ("compressed all", True, True)):
        if comp_logits:
            logits, g_l = vmm_array((R, Vp), BF, True)
            logits[...] = logits0
        else:
            logits, g_l = logits0, False
        if comp_d8:
            d8, g8 = vmm_array((R, Vp), np.uint8, True)
            d8t, g8t = vmm_array((Vp, R), np.uint8, True)
        else:
            d8, d8t, g8, g8t = cp.empty((R, Vp), cp.uint8), cp.empty((Vp, R), cp.uint8), False, False
        dx, dw = cp.empty((R, C), BF), cp.zeros((Vp, C), BF)
        print(f"{name}: compression granted -- logits {g_l}, dlogits8 {g8}, transpose {g8t}")

        def classify(logits=logits, d8=d8):
            fused_classifier(logits, target, vocab_size=V, grad_scale=grad_scale, losses=losses,
                             check_targets=False, dlogits8=d8, dlogits8_scale=s, write_dlogits=False,
                             sparse_tau=tau, sparse_seed=seed)

        def transpose(d8=d8, d8t=d8t):
            fp8_transpose(d8, out=d8t)

        def gemm_dx(d8=d8, dx=dx):
            fp8_matmul(d8, w8t, "e5m2", "e4m3", inv, one, out=dx)

        def gemm_dwte(d8t=d8t, dw=dw):
            fp8_matmul(d8t, x8t, "e5m2", "e4m3", inv, one, out=dw, accumulate=True)

        def chain(f=(classify, transpose, gemm_dx, gemm_dwte)):
            for g in f:
                g()

        dw[...] = 0
        chain()
        sync()
        setups[name] = dict(chain=chain, classifier=classify, transpose=transpose, dx=gemm_dx, dwte=gemm_dwte,
                            out=(d8.get(), d8t.get(), dx.get(), dw.get()))
    ref = setups["plain"]["out"]
    zeros = float(((ref[0] & 0x7F) == 0).mean())
    print(f"dlogits8: {zeros:.3f} zero bytes (tau {tau:g}: p < {float(opts['p']):.3g})")
    for name, st in setups.items():
        same = all(a.tobytes() == b.tobytes() for a, b in zip(st["out"], ref))
        print(f"{name}: outputs bit for bit the plain memory's: {same}")

    seconds, last = float(opts["seconds"]), {}
    for _ in range(int(opts["rounds"])):
        for stage in ("chain", "classifier", "transpose", "dx", "dwte"):
            for name, st in setups.items():
                power.measure(st[stage], meter, min_seconds=seconds / 3, sync=sync)     # settle
                last[(stage, name)] = power.measure(st[stage], meter, min_seconds=seconds, sync=sync)
    print(f"\none {R}-row chunk of the FP8 head's backward, round {opts['rounds']}, {seconds:g} s a row")
    print(f"{'stage':11s} {'memory':20s} {'ms':>8s} {'J/call':>8s} {'W':>5s} {'MHz':>5s} {'x vs plain':>10s}")
    for stage in ("chain", "classifier", "transpose", "dx", "dwte"):
        base = last[(stage, "plain")]
        for name in setups:
            r = last[(stage, name)]
            ms = 1e3 * r.seconds / r.calls
            print(f"{stage:11s} {name:20s} {ms:8.4f} {r.joules_per_call:8.4f} {r.watts:5.0f} {r.sm_mhz:5.0f} "
                  f"{(base.seconds / base.calls) / (r.seconds / r.calls):9.3f}x")


if __name__ == "__main__":
    main()
