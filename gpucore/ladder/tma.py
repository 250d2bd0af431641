"""TMA tensor maps: what a Hopper kernel needs to copy 2-D tiles with one instruction.

    encode_2d(ptr, dtype, rows, cols, box_rows, box_cols)   -> 128 bytes (a CUtensorMap)
    check_2d(...)                                           the same rules, raising ValueError

The Tensor Memory Accelerator (sm_90) copies a whole box of a global array to shared memory (or
back) from one instruction, `cp.async.bulk.tensor`, given a *tensor map*: a 128-byte descriptor
of the array (base, sizes, row stride, element type), the box, and the swizzle pattern to write
in shared memory. The CUDA driver encodes it (`cuTensorMapEncodeTiled`, driver API), so this module
calls libcuda through ctypes; CuPy does not wrap it. Out-of-bounds parts of a box are read as
zeros and skipped on stores, which is why a TMA kernel needs no edge-tile code.

The map is opaque: the kernel passes its address to the copy instructions. Here it lives in
global memory (kernels_cu/ladder/gemm/tma.cu, gemm v7) and the kernel acquires it with
`fence.proxy.tensormap` before use. Rules checked before the driver sees them (its own error is
a bare CUDA_ERROR_INVALID_VALUE): the base 16-byte aligned, the row stride a multiple of 16 bytes,
box sides 1..256, and with the 128-byte swizzle a box row of at most 128 bytes.
"""
from __future__ import annotations

import ctypes

import numpy as np

from .. import dtypes

# CUtensorMapDataType, CUtensorMapSwizzle, CUtensorMapL2promotion (cuda.h)
_DATA_TYPE = {"float32": 7, "bfloat16": 9, "float16": 6, "uint8": 0}
SWIZZLE_NONE, SWIZZLE_128B = 0, 3
SWIZZLE_BYTES = {SWIZZLE_NONE: None, 1: 32, 2: 64, SWIZZLE_128B: 128}
_L2_PROMOTION_256B = 3
MAP_BYTES = 128

_lib = None


def _driver():
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"TMA tensor maps need the CUDA driver (libcuda.so.1): {e}") from None
        fn = _lib.cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                       ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return _lib


def _type_name(dtype) -> str:
    name = dtypes.name(dtype)
    if name not in _DATA_TYPE:
        raise ValueError(f"dtype: TMA maps here take {sorted(_DATA_TYPE)}, got {name}")
    return name


def check_2d(ptr: int, dtype, rows: int, cols: int, box_rows: int, box_cols: int,
             swizzle: int = SWIZZLE_128B, row_stride_bytes: int | None = None) -> int:
    """Raise ValueError unless the driver would accept this map; returns the row stride in bytes."""
    itemsize = np.dtype(dtype).itemsize
    _type_name(dtype)
    stride = cols * itemsize if row_stride_bytes is None else int(row_stride_bytes)
    if rows < 1 or cols < 1:
        raise ValueError(f"shape: a TMA map needs at least one row and column, got {rows} x {cols}")
    if ptr % 16:
        raise ValueError(f"ptr: a TMA map's base must be 16-byte aligned, got {ptr:#x}")
    if rows > 1 and (stride % 16 or stride >= 2**40):
        raise ValueError(f"row stride: a TMA map needs a multiple of 16 bytes below 2^40, got {stride} "
                         f"({cols} columns of {itemsize} bytes)")
    if stride < cols * itemsize:
        raise ValueError(f"row stride: {stride} bytes is shorter than a row ({cols} x {itemsize} bytes)")
    if not (1 <= box_rows <= 256 and 1 <= box_cols <= 256):
        raise ValueError(f"box: each side must be 1..256 elements, got {box_rows} x {box_cols}")
    if (box_cols * itemsize) % 16:
        raise ValueError(f"box: a box row must be a multiple of 16 bytes, got {box_cols} x {itemsize}")
    if swizzle not in SWIZZLE_BYTES:
        raise ValueError(f"swizzle: must be one of {sorted(SWIZZLE_BYTES)}, got {swizzle!r}")
    span = SWIZZLE_BYTES[swizzle]
    if span is not None and box_cols * itemsize > span:
        raise ValueError(f"box: with a {span}-byte swizzle a box row holds at most {span} bytes, "
                         f"got {box_cols} x {itemsize}")
    return stride


def encode_2d(ptr: int, dtype, rows: int, cols: int, box_rows: int, box_cols: int,
              swizzle: int = SWIZZLE_128B, row_stride_bytes: int | None = None) -> bytes:
    """The CUtensorMap of a row-major (rows, cols) array at device address ptr, copied in boxes
    of (box_rows, box_cols) elements, written to shared memory with `swizzle`."""
    stride = check_2d(ptr, dtype, rows, cols, box_rows, box_cols, swizzle, row_stride_bytes)
    lib = _driver()
    raw = ctypes.create_string_buffer(MAP_BYTES + 64)              # CUtensorMap is alignas(64)
    addr = (ctypes.addressof(raw) + 63) & ~63
    dims = (ctypes.c_uint64 * 2)(cols, rows)                      # innermost first
    strides = (ctypes.c_uint64 * 1)(stride)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    res = lib.cuTensorMapEncodeTiled(addr, _DATA_TYPE[_type_name(dtype)], 2,
                                     ctypes.c_void_p(ptr), dims, strides, box, elem, 0, swizzle,
                                     _L2_PROMOTION_256B, 0)
    if res != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {res}) for a {rows} x {cols} "
                           f"{_type_name(dtype)} array, box {box_rows} x {box_cols}")
    return ctypes.string_at(addr, MAP_BYTES)
