"""Compressible device memory (Compute Data Compression, Ampere and later) for mostly-zero buffers.

Why: a GPU can keep a physical allocation compressed in DRAM and the L2 when asked at allocation
time. The thinned LM head's dlogits are ~97% zero bytes (settings.fp8_lm_head_sparse), and each
d12 chunk's bytes cross DRAM about five times (classifier, transpose, two GEMMs). In compressible
memory one FP8 head chunk ran x1.085 with 15% fewer joules on an H100, every output bit for bit the
same (tools/probes/compressible_head.py, tools/notes/fp8.md); at the 700 W cap the step's time
follows its joules. The data and the kernels do not change, only where the bytes live.

How: CuPy has no binding for the driver's virtual-memory calls, so this calls libcuda through
ctypes: cuMemCreate with allocFlags.compressionType = CU_MEM_ALLOCATION_COMP_GENERIC, an address
range of its own (cuMemAddressReserve), cuMemMap and cuMemSetAccess; the array's memory object
synchronizes the device, unmaps and releases it when the last view is gone. Where compression is
not available -- no libcuda, a GPU or driver without it (device attribute 107), an allocation the
driver did not grant it, any driver error -- empty() returns an ordinary cupy.empty array: this
changes speed only, never a result.

    empty(shape, dtype)   a cupy.ndarray, compressible where the GPU grants it
    supported()           whether this GPU offers compressible memory
    is_compressed(a)      whether a's memory is a granted compressible allocation
    held_bytes()          bytes held by these allocations now (outside CuPy's memory pool)
    device_bytes()        CuPy's pool plus held_bytes(): what a run holds on the device
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from . import runtime

# cuda.h's values: CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED and _GENERIC_COMPRESSION_SUPPORTED;
# CU_MEM_ALLOCATION_COMP_GENERIC; CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE and
# CU_MEM_ACCESS_FLAGS_PROT_READWRITE
ATTR_VMM, ATTR_COMPRESSION = 102, 107
COMP_GENERIC = 1
_PINNED, _ON_DEVICE, _READ_WRITE = 1, 1, 3
_RECOMMENDED = 1                           # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED


class _Location(ctypes.Structure):         # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):       # CUmemAllocationProp::allocFlags
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):             # CUmemAllocationProp (cuda.h, CUDA 11.0 and later)
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _Access(ctypes.Structure):           # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_U64, _SIZE, _INT = ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_int
_SIGNATURES = {
    "cuDeviceGetAttribute": [ctypes.POINTER(_INT), _INT, _INT],
    "cuMemGetAllocationGranularity": [ctypes.POINTER(_SIZE), ctypes.POINTER(_Prop), _INT],
    "cuMemCreate": [ctypes.POINTER(_U64), _SIZE, ctypes.POINTER(_Prop), _U64],
    "cuMemGetAllocationPropertiesFromHandle": [ctypes.POINTER(_Prop), _U64],
    "cuMemAddressReserve": [ctypes.POINTER(_U64), _SIZE, _SIZE, _U64, _U64],
    "cuMemMap": [_U64, _SIZE, _SIZE, _U64, _U64],
    "cuMemSetAccess": [_U64, _SIZE, ctypes.POINTER(_Access), _SIZE],
    "cuMemUnmap": [_U64, _SIZE],
    "cuMemAddressFree": [_U64, _SIZE],
    "cuMemRelease": [_U64],
}
_held = [0]


class DriverError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def _driver():
    """libcuda with the signatures above, or None (no driver here)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, _INT
    except (OSError, AttributeError):
        return None
    return lib


def _check(rc: int, what: str):
    if rc != 0:
        raise DriverError(f"{what}: CUresult {rc}")


@functools.lru_cache(maxsize=None)
def supported(device_id: int | None = None) -> bool:
    """Does this GPU (the current one by default) offer compressible memory through the driver?"""
    lib = _driver()
    if lib is None or runtime.cupy is None:
        return False
    dev = runtime.cupy.cuda.Device().id if device_id is None else device_id
    got = []
    for attr in (ATTR_VMM, ATTR_COMPRESSION):
        v = _INT()
        if lib.cuDeviceGetAttribute(ctypes.byref(v), attr, dev) != 0:
            return False
        got.append(v.value)
    return all(got)


class _Allocation:
    """One mapped physical allocation; unmapped and released when the last array using it dies."""

    def __init__(self, nbytes: int, device_id: int):
        self._lib = None                # set once everything below succeeded: __del__ frees only then
        lib = _driver()
        prop = _Prop(type=_PINNED, requestedHandleTypes=0, location=_Location(_ON_DEVICE, device_id))
        prop.allocFlags.compressionType = COMP_GENERIC
        gran = _SIZE()
        _check(lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), _RECOMMENDED),
               "cuMemGetAllocationGranularity")
        self.size = -(-max(nbytes, 1) // gran.value) * gran.value
        self.handle, self.ptr = _U64(), _U64()
        _check(lib.cuMemCreate(ctypes.byref(self.handle), self.size, ctypes.byref(prop), 0), "cuMemCreate")
        mapped = False
        try:
            got = _Prop()
            _check(lib.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(got), self.handle),
                   "cuMemGetAllocationPropertiesFromHandle")
            self.compressed = got.allocFlags.compressionType == COMP_GENERIC
            _check(lib.cuMemAddressReserve(ctypes.byref(self.ptr), self.size, 0, 0, 0), "cuMemAddressReserve")
            _check(lib.cuMemMap(self.ptr, self.size, 0, self.handle, 0), "cuMemMap")
            mapped = True
            access = _Access(location=_Location(_ON_DEVICE, device_id), flags=_READ_WRITE)
            _check(lib.cuMemSetAccess(self.ptr, self.size, ctypes.byref(access), 1), "cuMemSetAccess")
        except DriverError:
            self._release(lib, mapped)
            raise
        self._lib = lib
        _held[0] += self.size

    def _release(self, lib, mapped=True):
        if mapped:
            lib.cuMemUnmap(self.ptr, self.size)
        if self.ptr.value:
            lib.cuMemAddressFree(self.ptr, self.size)
        lib.cuMemRelease(self.handle)

    def __del__(self):
        if self._lib is None or _held is None:    # _held None: interpreter shutdown has cleared this module's
            return                                # globals; the context's teardown frees the memory
        try:
            if _capturing():        # no synchronize inside a graph capture: freed by the next empty()
                heir = _Allocation.__new__(_Allocation)
                heir.__dict__.update(self.__dict__)     # the handle, address and size live on in it
                self._lib = None
                _deferred.append(heir)
                return
            # no kernel may still use it (CuPy's pool orders frees by stream; this cannot)
            runtime.cupy.cuda.Device().synchronize()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the context may be gone already
            pass
        self.release_now()

    def release_now(self):
        if self._lib is not None:
            _held[0] -= self.size
            lib, self._lib = self._lib, None
            self._release(lib)


_deferred: list = []           # allocations whose last array died during a graph capture


def _capturing() -> bool:
    cp = runtime.cupy
    return cp is not None and cp.cuda.get_current_stream().is_capturing()


def _flush_deferred():
    if _deferred and not _capturing():
        runtime.cupy.cuda.Device().synchronize()
        while _deferred:
            _deferred.pop().release_now()


def empty(shape, dtype):
    """An uninitialised cupy array of shape and dtype in compressible memory where the GPU grants
    it, else an ordinary cupy.empty (same results either way; is_compressed says which)."""
    cp = runtime.cupy
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    dev = cp.cuda.Device().id
    # inside a CUDA graph capture the driver's allocation calls may break the capture: plain memory
    if nbytes == 0 or not supported(dev) or _capturing():
        return cp.empty(shape, dtype)
    _flush_deferred()
    try:
        alloc = _Allocation(nbytes, dev)
    except DriverError:
        return cp.empty(shape, dtype)
    if not alloc.compressed:        # granted as plain memory: CuPy's pool serves that as well
        del alloc
        return cp.empty(shape, dtype)
    mem = cp.cuda.UnownedMemory(alloc.ptr.value, alloc.size, owner=alloc, device_id=dev)
    return cp.ndarray(shape, dtype, memptr=cp.cuda.MemoryPointer(mem, 0))


def is_compressed(a) -> bool:
    """Is a (a cupy array or a view of one) in a granted compressible allocation from empty()?"""
    mem = getattr(getattr(a, "data", None), "mem", None)
    return isinstance(getattr(mem, "_owner", None), _Allocation)


def held_bytes() -> int:
    """Bytes held by compressible allocations now: device memory outside CuPy's pool."""
    return _held[0]


def device_bytes() -> int:
    """Device bytes a run holds now: CuPy's default pool and these allocations beside it (the
    figure `gpucore train` reports as its peak and `gpucore memory` measures)."""
    return int(runtime.cupy.get_default_memory_pool().total_bytes()) + held_bytes()
