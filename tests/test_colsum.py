"""Column sums (gpucore/ops/colsum.py, kernels_cu/colsum.cu): the bias gradient's deterministic
two-stage reduction, and its stage 2 that the fused gelu / layernorm bias gradients share.

GPU only (the ops have no NumPy path: the reference is dout.sum(0)); the fused callers are
tested in tests/test_gelu.py and tests/test_layernorm.py.
"""
import re
from pathlib import Path

import numpy as np
import pytest

import gpucore
from gpucore import runtime
from gpucore.ops.colsum import COLSUM_ROWS_PER_CHUNK, STAGE2_WARPS, colsum, reduce_partials, stage2_order_sum
from conftest import to_cpu
from matmul_checks import check_close, rand

BF16 = gpucore.bfloat16


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("N,M", [(1, 1), (5, 3), (256, 768), (257, 769), (4097, 2304), (70000, 24)])
def test_gpu_colsum(rng, dtype, N, M):
    """Both the 16-byte and the scalar path, against float64; same bits on a second call."""
    cp = runtime.cupy
    dout = rand(rng, (N, M), dtype)
    db = cp.zeros(M, np.float32)
    colsum(db, cp.asarray(dout))
    check_close(db, dout.astype(np.float64).sum(0), np.float32, "dbias", tol=1e-5)
    db2 = cp.zeros(M, np.float32)
    colsum(db2, cp.asarray(dout))
    assert to_cpu(db).tobytes() == to_cpu(db2).tobytes()


@pytest.mark.cuda
def test_gpu_colsum_accumulates_into_bf16(rng):
    """dbias += (not =), rounded once into a bf16 gradient."""
    cp = runtime.cupy
    N, M = 1000, 136
    dout, db0 = rand(rng, (N, M), BF16), rand(rng, (M,), BF16)
    db = cp.asarray(db0)
    colsum(db, cp.asarray(dout))
    check_close(db, db0.astype(np.float64) + dout.astype(np.float64).sum(0), BF16, "bf16 dbias +=")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("chunks", [1, 37, 512])
def test_gpu_reduce_partials_adds_chunks_in_stage2_order(rng, dtype, chunks):
    """Stage 2 adds the float32 partials in its fixed order (warp w: chunks w, w + 32, ...; then the
    32 warps' sums in order), then dbias += sum, rounded once: exactly stage2_order_sum, bit for bit.
    M = 300 leaves the last block's columns part empty."""
    cp = runtime.cupy
    M = 300
    partials = (rng.standard_normal((chunks, M)) * np.exp(rng.uniform(-8, 8, (chunks, 1)))).astype(np.float32)
    db0 = rand(rng, (M,), dtype)
    want = (db0.astype(np.float32) + stage2_order_sum(partials)).astype(dtype)
    db = cp.asarray(db0)
    reduce_partials(db, cp.asarray(partials))
    assert to_cpu(db).tobytes() == want.tobytes()


def test_stage2_order_sum_adds_each_warps_chunks_first():
    """stage2_order_sum's order, checked where it shows: with 33 partials, warp 0 holds partials 0 and
    32 (1e8 and -1e8: they cancel exactly) before the 31 ones are added, so the sum is 31; in chunk
    order 0, 1, ..., 32 the ones would vanish in 1e8's rounding and the sum would be 0."""
    p = np.ones((STAGE2_WARPS + 1, 1), np.float32)
    p[0], p[STAGE2_WARPS] = 1e8, -1e8
    assert stage2_order_sum(p)[0] == np.float32(STAGE2_WARPS - 1)
    serial = np.float32(0)
    for v in p[:, 0]:
        serial = np.float32(serial + v)
    assert serial == 0


def test_stage2_warps_is_the_kernels():
    """The Python constant the launches and the emulation use is common.cuh's STAGE2_WARPS."""
    header = (Path(runtime.KERNEL_DIR) / "common.cuh").read_text()
    assert int(re.search(r"#define STAGE2_WARPS (\d+)", header).group(1)) == STAGE2_WARPS


def test_chunking_depends_on_the_shape_only():
    """The reduction order is fixed by COLSUM_ROWS_PER_CHUNK: changing it changes the bits of every
    bias gradient, so it is a deliberate constant (a power of two that divides B*T = 65536)."""
    assert COLSUM_ROWS_PER_CHUNK > 0 and 65536 % COLSUM_ROWS_PER_CHUNK == 0
