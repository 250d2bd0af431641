"""compressible_pool/sitecustomize.py -- probe: every CuPy pool allocation of 2 MiB or more in
compressible memory (gpucore.compressible), to ask whether the step's other buffers compress too.

The thinned head's dlogits (97% zeros) gained 8-15% fewer joules a chunk in compressible memory.
The rest of the step's data is dense, but the generic compressor may still find blocks it can
shrink (E5M2 gradients with 10-46% zeros, GELU outputs, optimizer state). At the 700 W cap fewer
DRAM bytes are fewer joules, so this asks the whole step: put this directory first on PYTHONPATH
and every run of `python -m gpucore.cli train` allocates through it.

    tools/ab_train.py --model d12 -B 64 --steps 100 --skip 40 --rounds 2 \
        "plain=.:HOME=/tmp/h:--dtype fp8" "pool=.:HOME=/tmp/h,PYTHONPATH=tools/probes/compressible_pool:--dtype fp8"

Below 2 MiB (the driver's granularity) and inside a graph capture the memory is plain cudaMalloc.
The reported pool peak counts the compressible bytes twice (pool and held_bytes): read it as an
upper bound. Probe only; not part of the engine.
"""
import os
import sys

import cupy as cp

sys.path.insert(0, os.getcwd())     # site runs before `python -m` puts the tree on sys.path

from gpucore import compressible

_MIN = 2 << 20
_stats = {"compressed": 0, "plain": 0}


def _allocate(size):
    if size >= _MIN and compressible.supported() and not compressible._capturing():
        try:
            alloc = compressible._Allocation(size, cp.cuda.Device().id)
        except compressible.DriverError:
            alloc = None
        if alloc is not None and alloc.compressed:
            _stats["compressed"] += alloc.size
            mem = cp.cuda.UnownedMemory(alloc.ptr.value, alloc.size, owner=alloc, device_id=cp.cuda.Device().id)
            return cp.cuda.MemoryPointer(mem, 0)
    _stats["plain"] += size
    return cp.cuda.MemoryPointer(cp.cuda.Memory(size), 0)


_OrigPool = cp.cuda.MemoryPool
_pool = _OrigPool(_allocate)
cp.cuda.set_allocator(_pool.malloc)
cp.get_default_memory_pool = lambda: _pool
cp.cuda.MemoryPool = lambda allocator=None: _OrigPool(allocator or _allocate)   # step_graph's private pool


def _report():
    print(f"compressible_pool: {_stats['compressed'] / 1e9:.2f} GB compressible, "
          f"{_stats['plain'] / 1e9:.2f} GB plain", file=sys.stderr)


import atexit  # noqa: E402

atexit.register(_report)
