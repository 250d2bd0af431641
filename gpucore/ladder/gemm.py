"""The GEMM ladder: our own C = A @ B kernels, from a naive loop to warp-specialized Hopper wgmma.

    gemm(a, b, out=None, version=N)   C (M, N) = A (M, K) @ B (K, N), all row-major
    gemm_reference(a, b)              float64, rounded once

A lesson, not the training path (training multiplies in cuBLAS/cuBLASLt,
gpucore/ops/matmul.py): each rung fixes what limited the one before, and
`gpucore bench matmul --version all` measures them against cuBLAS on the
same layout (figures in the README and tools/notes/matmul.md). Kernels in
kernels_cu/ladder/gemm/:

    simt.cu    v1 one thread per output, v2 shared-memory tiles, v3 register blocking (fp32)
    tc.cu      v4 mma.sync m16n8k16 bf16, ldmatrix, 4-stage cp.async, swizzled smem
    tc2.cu     v4b / v4c 64x64 warp tiles, fragments double-buffered in registers
    wgmma.cu   v5 Hopper wgmma from 128B-swizzled smem; v6 v5 warp-specialized and persistent
    tma.cu     v7 v6 with TMA: one thread loads each stage, C stored through shared memory
               (tensor maps from gpucore/ladder/tma.py)
    pingpong.cu v8 v7 with ping-pong consumers: one warpgroup's epilogue under the other's math
"""
from __future__ import annotations

import numpy as np

from .. import dtypes, runtime
from ..ops._common import check_array, check_same_dtype, output
from ..ops.matmul import out_dtypes

F32, BF16 = dtypes.float32, dtypes.bfloat16


def gemm_reference(a, b, out_dtype=None):
    return (np.asarray(a, np.float64) @ np.asarray(b, np.float64)).astype(out_dtype or a.dtype)


# version -> (kernel file, input dtype, block tile (BM, BN), threads per block, dynamic smem bytes)
# v1 naive: one thread per C element, straight from global memory.
# v2 shared-memory tiles: 32x32 tiles of A and B staged in smem, one C element per thread.
# v3 register blocking: 128x128x8 block tile, 256 threads each own an 8x8 C tile, float4 loads.
# v4 tensor cores: 128x128x32 block tile, 8 warps of 64x32, mma.sync m16n8k16 bf16, ldmatrix,
#    4-stage cp.async pipeline, XOR-swizzled smem. (v4w, the same kernel with a 128x256 block of
#    64x64 warps, measured slower -- 312 vs 334 TFLOP/s on an H200 -- and was removed.)
# v4b/v4c (ladder/gemm/tc2.cu): 64x64 warp tiles, fragments double-buffered in registers, BK = 64,
#    3 stages; v4b a 128x256 block of 8 warps (1 block/SM), v4c a 128x128 block of 4 warps
#    (2 blocks/SM). See the header of ladder/gemm/tc2.cu for why.
# v5 (ladder/gemm/wgmma.cu): Hopper warpgroup MMA; see its header.
# v7's block width -> dynamic shared memory: stages x (A 16 KB + B 64 x BN bf16) + 2 staging buffers
# of 64 rows x (128 or 64) columns + 1 KB of alignment (kernels_cu/ladder/gemm/tma.cu, V7Config).
V7_SMEM = {256: 4 * (128 * 64 + 64 * 256) * 2 + 2 * 64 * 128 * 2 + 1024,
           192: 5 * (128 * 64 + 64 * 192) * 2 + 2 * 64 * 64 * 2 + 1024}
GEMM_VERSIONS = {
    1: ("ladder/gemm/simt", F32, (16, 16), 256, 0),
    2: ("ladder/gemm/simt", F32, (32, 32), 1024, 0),
    3: ("ladder/gemm/simt", F32, (128, 128), 256, 0),
    4: ("ladder/gemm/tc", BF16, (128, 128), 256, 4 * (128 * 32 + 32 * 128) * 2),
    "4b": ("ladder/gemm/tc2", BF16, (128, 256), 256, 3 * (128 * 64 + 64 * 256) * 2),
    "4c": ("ladder/gemm/tc2", BF16, (128, 128), 128, 3 * (128 * 64 + 64 * 128) * 2),
    # v5 (ladder/gemm/wgmma.cu, sm_90 only): wgmma.m64n256k16 from 128B-swizzled shared memory, 2
    # warpgroups on a 128x256x64 block, 4 cp.async stages (+1 KB to align the base to 1024).
    5: ("ladder/gemm/wgmma", BF16, (128, 256), 256, 4 * (128 * 64 + 64 * 256) * 2 + 1024),
    # v6 (ladder/gemm/wgmma.cu): v5's tiles and stages, warp-specialized -- a producer warpgroup copies,
    # 2 consumer warpgroups only multiply; stages handed over by mbarriers (no __syncthreads);
    # persistent (a grid of min(tiles, SMs) blocks).
    6: ("ladder/gemm/wgmma", BF16, (128, 256), 384, 4 * (128 * 64 + 64 * 256) * 2 + 1024),
    # v7 (ladder/gemm/tma.cu): v6's stages loaded by TMA, C leaving through a staging buffer by TMA
    # stores (bf16 C; float32 C is stored as in v6); 128 x 256 blocks, or 128 x 192 where they take
    # fewer waves (_v7_block_n; block width and shared memory per width in V7_SMEM).
    7: ("ladder/gemm/tma", BF16, (128, 256), 384, V7_SMEM[256]),
    # v8 (ladder/gemm/pingpong.cu): v7's TMA pipeline, but each consumer warpgroup owns whole 128 x 128
    # tiles and the two take turns, so one writes C while the other multiplies; 6 stages of 32 KB.
    8: ("ladder/gemm/pingpong", BF16, (128, 128), 384, 6 * (128 * 64 + 64 * 128) * 2 + 2 * 128 * 64 * 2 + 1024),
}
VERSION_ARCH = {5: "90a", 6: "90a", 7: "90a", 8: "90a"}  # compiled for sm_90a (wgmma); runs on sm_90 devices only
PERSISTENT_VERSIONS = (6, 7, 8)
TMA_VERSIONS = (7, 8)
TC_VERSIONS = tuple(v for v, spec in GEMM_VERSIONS.items() if spec[1] == BF16)
# The bf16 default: the fastest measured. On sm_90 (H200, 2026-11-27, C rounded by cvt.rn.bf16x2) it
# depends on K: where a tile has few k-tiles its epilogue weighs, and v8's ping-pong hides it (K = 768:
# 106-114% of gemmEx against v7's 97-104%); with long K, v7's 128 x 256 tiles move fewer bytes per
# FLOP (K >= 3072: 97-101% against v8's 93-94%). Before them: v6, v5 (wgmma) 545 TFLOP/s; elsewhere v4b
# (mma.sync) 418 TFLOP/s; v4 309, v4w 317, v4c 375.
GEMM_DEFAULT_BF16 = "4b"
GEMM_DEFAULT_BF16_SM90_SHORT_K, GEMM_DEFAULT_BF16_SM90 = 8, 7
SHORT_K = 1024                 # K up to this takes v8 on sm_90
_CARVEOUT_SET = set()


def _default_bf16_version(K: int):
    if runtime.gpu_available() and runtime.device_arch() == "90":
        return GEMM_DEFAULT_BF16_SM90_SHORT_K if K <= SHORT_K else GEMM_DEFAULT_BF16_SM90
    return GEMM_DEFAULT_BF16


def gemm(a, b, out=None, version=None):
    """C (M, N) = A (M, K) @ B (K, N), all row-major, with our own kernels.

    version 1-3: float32 in and out (SIMT). version 4, "4b", "4c", 5-8 (tensor
    cores, see GEMM_VERSIONS; 5-8 = wgmma, Hopper only): bfloat16 in, bfloat16
    (default) or float32 out; need N and K multiples of 8 (16-byte rows for
    cp.async), M any.
    Default: for bfloat16 on sm_90 v8 where K <= 1024, else v7 (elsewhere GEMM_DEFAULT_BF16);
    3 for float32.
    NumPy inputs run the float64 reference (any version).
    """
    check_array("a", a, ndim=2, max_elements=None)
    check_array("b", b, ndim=2, max_elements=None)
    check_same_dtype(a=a, b=b)
    if version is None:
        version = _default_bf16_version(a.shape[1]) if a.dtype == BF16 else 3
    if version not in GEMM_VERSIONS:
        raise ValueError(f"version: must be one of {list(GEMM_VERSIONS)}, got {version!r}")
    in_dt = GEMM_VERSIONS[version][1]
    M, K = a.shape
    if b.shape[0] != K:
        raise ValueError(f"b: inner dimension {b.shape[0]} differs from a's {K} (shapes {a.shape} @ {b.shape})")
    N = b.shape[1]
    xp = runtime.array_module(a, b, out)
    if xp is not np and a.dtype != in_dt:
        raise TypeError(f"a: gemm version {version} takes {dtypes.name(in_dt)}, got {dtypes.name(a.dtype)}")
    tc = version in TC_VERSIONS
    if xp is not np and tc and (K % 8 or N % 8):
        raise ValueError(f"b: gemm version {version} needs K and N multiples of 8 (16-byte rows), got K={K}, N={N}")
    out = output("out", out, xp, (M, N), a.dtype, allowed=out_dtypes(a.dtype), max_elements=None)
    if xp is np:
        out[...] = gemm_reference(a, b, out.dtype)
        return out
    for name, arr in (("a", a), ("b", b), ("out", out)):
        if arr.size >= 2**31:
            raise ValueError(f"{name}: {arr.size} elements is more than the kernels' 32-bit indexing allows")
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.fill(0)
        return out
    if version == 3 or tc:
        # 128-bit / cp.async loads and vector stores need 16-byte aligned bases
        # (the kernels check row lengths, not base pointers).
        for name, arr in (("a", a), ("b", b), ("out", out)):
            if arr.data.ptr % 16:
                raise ValueError(f"{name}: gemm version {version} needs a 16-byte aligned array")
    arch = VERSION_ARCH.get(version)
    if arch is not None and runtime.device_arch() != arch[:-1]:
        raise ValueError(f"version: gemm version {version} needs an sm_{arch[:-1]} GPU (Hopper), "
                         f"this one is sm_{runtime.device_arch()}")
    return _launch(version, a, b, out)


def _launch(version, a, b, out, block_n=None):
    """Launch gemm `version` on checked inputs. v7's block width is block_n, else _v7_block_n's pick."""
    family, _, (BM, BN), threads, smem = GEMM_VERSIONS[version]
    (M, K), N = a.shape, b.shape[1]
    tc = version in TC_VERSIONS
    suf = f"bf16_{dtypes.kernel_suffix(out.dtype)}" if tc else dtypes.kernel_suffix(a.dtype)
    name = f"v{version}"
    if version == 7:
        BN = block_n or _v7_block_n(M, N, runtime.sm_count())
        smem, name = V7_SMEM[BN], ("v7" if BN == 256 else f"v7n{BN}")
    kernel = runtime.get_kernel(family, f"gemm_forward_kernel_{name}_{suf}", arch=VERSION_ARCH.get(version))
    tiles_m, tiles_n = -(-M // BM), -(-N // BN)
    # v4 rasterises its own 1-D grid (grouped along M for L2 reuse); the others are 2-D.
    grid = (tiles_m * tiles_n,) if tc else (tiles_n, tiles_m)
    if version in PERSISTENT_VERSIONS:      # one block per SM walks the tiles
        grid = (min(tiles_m * tiles_n, runtime.sm_count()),)
    block = (threads,) if version != 1 else (BN, BM)
    if tc and kernel not in _CARVEOUT_SET:
        # Ask for the largest shared-memory carveout once per kernel: v4c's two 96 KB blocks
        # per SM need 192 KB of the 228 KB unified L1/shared array, v7's one block up to 225 KB.
        kernel.preferred_shared_memory_carveout = 100
        _CARVEOUT_SET.add(kernel)
    operands = (_tma_maps(a, b, out),) if version in TMA_VERSIONS else (a, b)
    runtime.launch(kernel, grid, block, (out, *operands, np.int32(M), np.int32(N), np.int32(K)), shared_mem=smem)
    return out


def _v7_block_n(M: int, N: int, sms: int) -> int:
    """v7's block width: 192 where 128 x 192 blocks take fewer (waves x width) than 128 x 256, else
    256. Each block is persistent, so a wave is `sms` tiles and the last one is paid whole: at the
    LM head's dx (8192 x 50304 @ 50304 x 768), 192 tiles of 256 are 2 waves of 256 columns and 256
    tiles of 192 are 2 waves of 192 (77% -> 104% of cuBLAS on an H200)."""
    tiles_m = -(-M // 128)
    cost = {bn: -(-(tiles_m * -(-N // bn)) // sms) * bn for bn in (256, 192)}
    return 192 if cost[192] < cost[256] else 256


def _gemm_v7(a, b, out, block_n: int):
    """v7 with 128 x block_n blocks (checked inputs; gemm() picks block_n, tests force each)."""
    return _launch(7, a, b, out, block_n)


# (a, b, out pointers and shapes, out dtype) -> the three maps in device memory. A map depends on
# nothing else, so a hit is always right; the cache spares the host-to-device copy per call (a
# pageable copy waits for the GPU, which would leave gaps between timed calls).
_TMA_MAP_CACHE: dict[tuple, object] = {}
_TMA_MAP_CACHE_SIZE = 64


def _tma_maps(a, b, out):
    """v7's and v8's tensor maps: A (M, K) in boxes of 128 rows x 64 k, B (K, N) in boxes of 64 k x 64 n,
    C (M, N) in boxes of 64 rows x 64 n (bf16 C only; float32 C gets A's map as a placeholder), all
    with the 128-byte swizzle the kernel's wgmma descriptors and stmatrix addresses assume."""
    from . import tma
    (M, K), N = a.shape, b.shape[1]
    key = (runtime.cupy.cuda.runtime.getDevice(), a.data.ptr, b.data.ptr, out.data.ptr, M, N, K, out.dtype.str)
    maps = _TMA_MAP_CACHE.get(key)
    if maps is None:
        map_a = tma.encode_2d(a.data.ptr, BF16, M, K, 128, 64)
        map_b = tma.encode_2d(b.data.ptr, BF16, K, N, 64, 64)
        map_c = tma.encode_2d(out.data.ptr, BF16, M, N, 64, 64) if out.dtype == BF16 else map_a
        if len(_TMA_MAP_CACHE) >= _TMA_MAP_CACHE_SIZE:
            _TMA_MAP_CACHE.clear()
        maps = _TMA_MAP_CACHE[key] = runtime.cupy.asarray(np.frombuffer(map_a + map_b + map_c, np.uint8))
    return maps
