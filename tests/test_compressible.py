"""gpucore.compressible: compressible device memory for the thinned LM head's dlogits.

CPU: the driver structures' layout (ctypes mirrors of cuda.h) and the fallback when there is no
driver. GPU (pytest -m cuda, our Hopper test machines grant compression): the arrays are real,
writable, compressed memory, freed when the last view dies; the model's logits chunk and FP8
dlogits8 live there, and a training step gives the same bits with and without it.
"""
import ctypes
import gc

import numpy as np
import pytest

from gpucore import compressible, runtime, settings
from gpucore.model import GPT2, GPT2Config
from conftest import to_cpu


def test_driver_structures_match_cuda_h():
    """CUmemAllocationProp is 32 bytes (allocFlags at offset 24, after an 8-byte aligned pointer),
    CUmemAccessDesc 12, CUmemLocation 8: what the driver reads through the pointers we pass."""
    assert ctypes.sizeof(compressible._Location) == 8
    assert ctypes.sizeof(compressible._Prop) == 32
    assert compressible._Prop.allocFlags.offset == 24 and compressible._Prop.location.offset == 8
    assert ctypes.sizeof(compressible._Access) == 12


def test_no_driver_means_not_supported(monkeypatch):
    monkeypatch.setattr(compressible, "_driver", lambda: None)
    compressible.supported.cache_clear()
    try:
        assert compressible.supported(0) is False
    finally:
        compressible.supported.cache_clear()


def test_numpy_model_never_asks_for_it():
    """On the CPU the logits chunk stays in the activations' flat buffer."""
    m = GPT2(GPT2Config.from_preset("micro"), xp=np, dtype="bfloat16", seed=1, fp8="adaptive")
    m.allocate_activations(2, 16)
    assert m._logits is None and not m._compressible_logits()


@pytest.mark.cuda
def test_gpu_compressible_arrays_are_memory():
    cp = runtime.cupy
    assert compressible.supported(), "the Hopper test GPUs offer generic compression"
    gc.collect()
    before = compressible.held_bytes()
    rng = np.random.default_rng(0)
    host = np.where(rng.random((4096, 3000)) < 0.03, rng.integers(0, 256, (4096, 3000)), 0).astype(np.uint8)
    a = compressible.empty(host.shape, np.uint8)
    assert compressible.is_compressed(a) and compressible.is_compressed(a[100:200, 7:])
    assert compressible.held_bytes() - before >= host.nbytes
    a[...] = cp.asarray(host)
    assert np.array_equal(to_cpu(a), host)
    assert int(a.astype(cp.int64).sum()) == int(host.astype(np.int64).sum())
    f = compressible.empty((1000, 77), np.float32)                 # not a multiple of the granularity
    f[...] = 1.5
    assert float(f.sum()) == 1.5 * 77000
    del a, f
    gc.collect()
    assert compressible.held_bytes() == before
    assert not compressible.is_compressed(compressible.empty((0,), np.uint8))
    assert not compressible.is_compressed(cp.empty(16, np.uint8))


@pytest.mark.cuda
def test_gpu_unsupported_gpu_gets_plain_memory(monkeypatch):
    monkeypatch.setattr(compressible, "supported", lambda device_id=None: False)
    a = compressible.empty((64, 64), np.uint8)
    assert not compressible.is_compressed(a) and a.shape == (64, 64)


def _steps(cfg, x, y, fp8, **s):
    with settings.using(**s):
        m = GPT2(cfg, xp=runtime.cupy, dtype="bfloat16", seed=4, fp8=fp8)
        out = []
        for _ in range(2):
            m.zero_grad()
            loss = float(m.forward(x, y, for_backward=True))
            m.backward()
            out.append((loss, to_cpu(m.grads.flat()).tobytes()))
            p = m.params.flat()
            p -= (1e-2 * m.grads.flat().astype(np.float32)).astype(p.dtype)
            m.end_step()
        return out, m


@pytest.mark.cuda
@pytest.mark.parametrize("fp8,thin", [("adaptive", "fp8_lm_head_sparse"), (None, "bf16_lm_head_sparse")])
def test_gpu_model_compressible_dlogits_change_no_bit(fp8, thin):
    """With the head's dlogits thinned, the logits chunk (and FP8's dlogits8) are compressible
    allocations; two training steps give the same losses and gradients bit for bit as without."""
    cp = runtime.cupy
    cfg = GPT2Config.from_preset("tiny")
    r = np.random.default_rng(1)
    x, y = (cp.asarray(r.integers(0, cfg.vocab_size, (4, 64), dtype=np.int32)) for _ in range(2))
    tau = {thin: 2.0 ** -13}
    on, m_on = _steps(cfg, x, y, fp8, compressible_dlogits=True, **tau)
    off, m_off = _steps(cfg, x, y, fp8, compressible_dlogits=False, **tau)
    assert on == off
    assert compressible.is_compressed(m_on.acts.logits) and not compressible.is_compressed(m_off.acts.logits)
    assert any(b is m_on._logits for b in m_on.step_buffers())
    if fp8:
        assert compressible.is_compressed(m_on.fp8._head[1][3])
    # not thinned: nothing to compress, the chunk stays in the flat buffer
    _, m_dense = _steps(cfg, x, y, fp8, compressible_dlogits=True, **{thin: 0.0})
    assert m_dense._logits is None and not compressible.is_compressed(m_dense.acts.logits)
