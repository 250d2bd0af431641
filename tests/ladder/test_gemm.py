"""The GEMM ladder (gpucore/ladder/gemm.py, kernels_cu/ladder/gemm/): our own C = A @ B, v1..v8.

CPU: the reference and the version table. GPU (pytest -m cuda): every version against float64
on odd shapes, and structured inputs (identity-like, index-coded) that name the first wrong
(row, col) when a fragment, swizzle or tile offset is off.
"""
import numpy as np
import pytest

import gpucore
from gpucore import runtime
from gpucore.ladder import gemm as lg
from conftest import poison, to_cpu
from matmul_checks import check_close, rand

BF16 = gpucore.bfloat16


def test_gemm_bad_version(rng):
    a = rand(rng, (6, 4), np.float32)
    with pytest.raises(ValueError, match="version"):
        gpucore.gemm(a, a.T.copy(), version=9)
    with pytest.raises(ValueError, match="version"):
        gpucore.gemm(a, a.T.copy(), version="4w")      # removed: measured slower than v4


def test_gemm_reference(rng):
    a, b = rand(rng, (5, 7), np.float32), rand(rng, (7, 3), np.float32)
    np.testing.assert_array_equal(gpucore.gemm(a, b), (a.astype(np.float64) @ b).astype(np.float32))


def test_gemm_default_bf16_is_a_tensor_core_version():
    assert lg.GEMM_DEFAULT_BF16 in lg.TC_VERSIONS
    assert {lg.GEMM_DEFAULT_BF16_SM90, lg.GEMM_DEFAULT_BF16_SM90_SHORT_K} <= set(lg.TC_VERSIONS)
    for v in lg.TC_VERSIONS:
        family, dt, (BM, BN), threads, smem = lg.GEMM_VERSIONS[v]
        assert dt == BF16 and smem <= 227 * 1024 and threads % 32 == 0, v




SIMT_SHAPES = [(1, 1, 1), (7, 5, 3), (33, 17, 65), (128, 128, 128), (129, 257, 131), (300, 64, 1000),
               (512, 1024, 256)]
TC_SHAPES = [(1, 8, 8), (7, 16, 24), (129, 40, 136), (256, 256, 256), (300, 1000, 520), (128, 8, 128),
             (1024, 768, 2304),
             (65, 128, 264),       # K = 2 tiles of 64 = STAGES - 1 of v4b/v4c: the main loop loads nothing
             (1100, 200, 1288),    # 9 block-rows: a second, ragged GROUP_M raster group; ragged K, N
             (2200, 72, 2056)]     # 162 tiles of 128 x 256: persistent blocks (v6, v7) take a second
                                   # tile on a 132-SM GPU, and v7 reuses its C staging buffer


def _skip_unless_supported(version):
    arch = lg.VERSION_ARCH.get(version)
    if arch is not None and runtime.device_arch() != arch[:-1]:
        pytest.skip(f"gemm version {version} needs sm_{arch[:-1]}")


def _check_gemm(version, a, b, out_dtype):
    cp = runtime.cupy
    _skip_unless_supported(version)
    out = poison((a.shape[0], b.shape[1]), out_dtype)
    gpucore.gemm(cp.asarray(a), cp.asarray(b), out=out, version=version)
    check_close(out, a.astype(np.float64) @ b.astype(np.float64), out_dtype,
                 f"gemm v{version} M,K,N={a.shape[0]},{a.shape[1]},{b.shape[1]}")


@pytest.mark.cuda
@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("M,K,N", SIMT_SHAPES)
def test_gpu_gemm_simt(rng, version, M, K, N):
    _check_gemm(version, rand(rng, (M, K), np.float32), rand(rng, (K, N), np.float32), np.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("version", [4, "4b", "4c", 5, 6, 7, 8])
@pytest.mark.parametrize("out_dtype", [np.float32, BF16])
@pytest.mark.parametrize("M,K,N", TC_SHAPES)
def test_gpu_gemm_tc(rng, version, out_dtype, M, K, N):
    _check_gemm(version, rand(rng, (M, K), BF16), rand(rng, (K, N), BF16), out_dtype)


def test_v7_block_width_takes_fewer_waves():
    # 132 SMs (H100/H200): 192-wide blocks only where they finish in fewer (waves x width)
    assert lg._v7_block_n(8192, 768, 132) == 192          # LM head dx: 2 waves of 192, not 2 of 256
    assert lg._v7_block_n(4096, 4096, 132) == 256         # 4 waves of 256 against 6 of 192
    assert lg._v7_block_n(65536, 3072, 132) == 256        # a tie (12 x 256 = 16 x 192): 256
    assert lg._v7_block_n(1, 8, 132) == 192               # one tile either way: the narrower


@pytest.mark.cuda
def test_gpu_gemm_default_takes_ping_pong_for_short_k():
    want = (8, 7) if runtime.device_arch() == "90" else (lg.GEMM_DEFAULT_BF16,) * 2
    assert (lg._default_bf16_version(768), lg._default_bf16_version(3072)) == want


@pytest.mark.cuda
@pytest.mark.parametrize("block_n", [256, 192])
@pytest.mark.parametrize("out_dtype", [np.float32, BF16])
@pytest.mark.parametrize("M,K,N", [(1, 8, 8), (129, 40, 136), (300, 1000, 520), (1100, 200, 1288), (2200, 72, 2056)])
def test_gpu_gemm_v7_each_block_width(rng, block_n, out_dtype, M, K, N):
    """gemm() picks v7's width by shape; each width on odd shapes, persistent wraps and edges."""
    cp = runtime.cupy
    _skip_unless_supported(7)
    a, b = rand(rng, (M, K), BF16), rand(rng, (K, N), BF16)
    out = poison((M, N), out_dtype)
    lg._gemm_v7(cp.asarray(a), cp.asarray(b), out, block_n)
    check_close(out, a.astype(np.float64) @ b.astype(np.float64), out_dtype,
                f"gemm v7 block_n={block_n} M,K,N={M},{K},{N}")


def _assert_exact(out, want, what):
    bad = np.argwhere(out != want)
    assert len(bad) == 0, (f"{what}: {len(bad)} of {out.size} wrong, first (row, col) {tuple(bad[0])}: "
                           f"got {out[tuple(bad[0])]}, want {want[tuple(bad[0])]}")


@pytest.mark.cuda
@pytest.mark.parametrize("version,out_dtype", [(v, np.float32) for v in (1, 2, 3, 4, "4b", "4c", 5, 6, 7, 8)]
                         + [(7, BF16), (8, BF16)])   # v7, v8 store bf16 C through shared memory and TMA
def test_gpu_gemm_structured(version, out_dtype):
    """Identity-like and index-coded inputs (small integers: exact in bf16 and fp32),
    so a wrong fragment, swizzle or tile offset shows up as a named (row, col)."""
    cp = runtime.cupy
    _skip_unless_supported(version)
    dt = BF16 if version in lg.TC_VERSIONS else np.float32
    M, K, N = 200, 136, 264          # several tiles, ragged in M (and K, N for the 128-wide tiles)
    rows, cols = np.arange(M), np.arange(N)

    def run(a, b):
        out = poison((M, N), out_dtype) if dt == BF16 else None
        return to_cpu(gpucore.gemm(cp.asarray(a.astype(dt)), cp.asarray(b.astype(dt)), out=out,
                                   version=version)).astype(np.float32)

    # A = stacked identities: C row r = B row (r % K)
    a = np.zeros((M, K), np.float32)
    a[rows, rows % K] = 1.0
    b = ((cols[None, :] % 97) - 48 + (np.arange(K)[:, None] % 7)).astype(np.float32)
    _assert_exact(run(a, b), b[rows % K], f"gemm v{version}, A = stacked identities")
    # B = ones at k == n % K: C column c = A column (c % K)
    a2 = ((rows[:, None] % 13) - 6 + (np.arange(K)[None, :] % 5)).astype(np.float32)
    b2 = np.zeros((K, N), np.float32)
    b2[cols % K, cols] = 1.0
    _assert_exact(run(a2, b2), a2[:, cols % K], f"gemm v{version}, B = identity columns")


@pytest.mark.cuda
def test_gpu_gemm_v4_rejects_ragged_k():
    cp = runtime.cupy
    a = cp.zeros((16, 12), dtype=BF16)
    with pytest.raises(ValueError, match="multiples of 8"):
        gpucore.gemm(a, cp.zeros((12, 16), dtype=BF16), version=4)
    with pytest.raises(TypeError, match="gemm version 3 takes float32"):
        gpucore.gemm(a, cp.zeros((12, 16), dtype=BF16), version=3)
