"""Shared test fixtures: the `cuda` marker (skipped without a GPU) and helpers.

GPU tests are marked `@pytest.mark.cuda` and run with `pytest -m cuda` on a
machine with an NVIDIA GPU (tools/gpu_check.sh). Without a GPU they are
skipped, never silently passed.
"""
import zlib

import numpy as np
import pytest

from gpucore import runtime

HAS_GPU = runtime.gpu_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run pytest -m cuda on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """Tiny Shakespeare as llm.c shards, <dir>/tinyshakespeare_{train,val}.bin, made once per session
    (tests only read them)."""
    from gpucore import data
    out = tmp_path_factory.mktemp("tinyshakespeare")
    data.prepro(None, out)
    return out


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's node id (CRC-32 of e.g.
    "tests/test_gelu.py::test_x[float32]"): each test, and each parametrization of one, gets its
    own stream, the same on every run, whatever other tests run or in what order."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if out has a NaN)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


def to_cpu(x):
    return x.get() if runtime.is_gpu_array(x) else np.asarray(x)


def poison(shape, dtype):
    """A GPU array filled with NaN, to prove every output element is written."""
    cupy = runtime.cupy
    return cupy.full(shape, np.nan, dtype=np.float32).astype(dtype)
