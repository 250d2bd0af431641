"""gpucore.tensors: specs carved from one flat buffer, the same on NumPy and CuPy."""
import numpy as np
import pytest

from gpucore import bfloat16, runtime
from gpucore.tensors import TensorLayout


def _check_layout(xp):
    layout = TensorLayout([("wte", (10, 8), np.float32), ("ln_b", (3,), np.float32), ("h", (2, 4), bfloat16)])
    t = layout.allocate(xp)
    assert t.wte.shape == (10, 8) and t.wte.dtype == np.float32
    assert t["h"].dtype == bfloat16
    # offsets are 16-byte aligned and views do not overlap
    assert [layout.offsets[n] for n in ("wte", "ln_b", "h")] == [0, 320, 336]
    t.wte[...] = 1.0
    t.ln_b[...] = 2.0
    t.h[...] = 3.0
    assert float(t.wte.sum()) == 80.0 and float(t.ln_b.sum()) == 6.0
    assert float(t.h.astype(np.float32).sum()) == 24.0
    with pytest.raises(TypeError):
        t.flat()
    same = TensorLayout([("a", (4,), np.float32), ("b", (2, 2), np.float32)]).allocate(xp)
    same.a[...] = xp.arange(4, dtype=np.float32)
    same.b[...] = 7
    np.testing.assert_array_equal(np.asarray(same.flat().get() if xp is not np else same.flat()),
                                  [0, 1, 2, 3, 7, 7, 7, 7])
    same.zero_()
    assert float(same.b.sum()) == 0


def test_layout_numpy():
    _check_layout(np)


def test_layout_rejects_duplicates():
    with pytest.raises(ValueError, match="duplicate"):
        TensorLayout([("a", (1,), np.float32), ("a", (2,), np.float32)])


@pytest.mark.cuda
def test_layout_cupy():
    _check_layout(runtime.cupy)
