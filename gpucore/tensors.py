"""Named tensor bookkeeping: ordered (name, shape, dtype) specs -> one flat allocation.

This is llm.c's way of managing memory: a model's parameters (or gradients,
master weights, AdamW moments, activations) are described once, as an ordered
list of specs, and live in ONE allocation carved into named views. One buffer
means one malloc, one memset to zero the gradients, one kernel for AdamW over
every parameter, and one file write for a checkpoint.

The same code runs on NumPy and CuPy (pass `xp`). Each view starts at an
offset aligned to `align` bytes (default 16, so 128-bit vector loads work on
every tensor); with every size a multiple of the alignment, as in GPT-2, the
views are packed back to back and the buffer is their exact concatenation.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import dtypes


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


class TensorLayout:
    """Offsets of an ordered list of specs inside one byte buffer."""

    def __init__(self, specs, align: int = 16):
        self.specs: list[TensorSpec] = []
        self.offsets: dict[str, int] = {}
        offset = 0
        for spec in specs:
            if not isinstance(spec, TensorSpec):
                name, shape, dtype = spec
                spec = TensorSpec(name, tuple(int(s) for s in shape), dtypes.normalize(dtype))
            if spec.name in self.offsets:
                raise ValueError(f"specs: duplicate tensor name {spec.name!r}")
            if any(s < 0 for s in spec.shape):
                raise ValueError(f"specs: negative dimension in {spec.name!r}: {spec.shape}")
            offset = -(-offset // align) * align
            self.offsets[spec.name] = offset
            self.specs.append(spec)
            offset += spec.nbytes
        self.nbytes = -(-offset // align) * align

    def __iter__(self):
        return iter(self.specs)

    def __len__(self):
        return len(self.specs)

    @property
    def num_elements(self) -> int:
        return sum(s.size for s in self.specs)

    def allocate(self, xp=np, zero: bool = True) -> "Tensors":
        buf = xp.zeros(self.nbytes, dtype=np.uint8) if zero else xp.empty(self.nbytes, dtype=np.uint8)
        return Tensors(self, buf)


class Tensors:
    """Named views into one flat buffer. `t["name"]` or `t.name` gives a view."""

    def __init__(self, layout: TensorLayout, buffer):
        if buffer.nbytes < layout.nbytes:
            raise ValueError(f"buffer: {buffer.nbytes} bytes, the layout needs {layout.nbytes}")
        self.layout = layout
        self.buffer = buffer
        self.views = {}
        for spec in layout:
            off = layout.offsets[spec.name]
            self.views[spec.name] = buffer[off:off + spec.nbytes].view(spec.dtype).reshape(spec.shape)

    def __getitem__(self, name):
        return self.views[name]

    def __getattr__(self, name):
        views = self.__dict__.get("views", {})
        if name in views:
            return views[name]
        raise AttributeError(name)

    def __iter__(self):
        return iter(self.views.items())

    def flat(self, dtype=None):
        """The whole buffer as a 1-D array of `dtype` (all specs must share it)."""
        kinds = {s.dtype for s in self.layout}
        dtype = dtypes.normalize(dtype) if dtype is not None else (kinds.pop() if len(kinds) == 1 else None)
        if dtype is None or any(s.dtype != dtype for s in self.layout):
            raise TypeError("flat: the tensors do not all share one dtype")
        return self.buffer[: self.layout.nbytes].view(dtype)

    def zero_(self):
        self.buffer.fill(0)
        return self
