"""gpucore.runtime: compiling without a GPU, compile errors naming file:line, the cache key."""
import shutil

import pytest

from gpucore import runtime
from gpucore.runtime import KernelCompileError

needs_nvrtc = pytest.mark.skipif(runtime.cupy is None, reason="needs CuPy + NVRTC (installed in CI)")


@needs_nvrtc
def test_every_kernel_compiles_for_sm80_and_sm90_without_spills():
    rows = runtime.check_kernels(("80", "90"))
    assert rows, "no kernels found"
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert {"add_forward_kernel_f32", "reduce_sum_all_stage1_kernel_bf16", "cast_f32_to_bf16_kernel"} <= {
        r["kernel"] for r in rows}
    assert all(r["registers"] and r["registers"] > 0 for r in rows)


@needs_nvrtc
def test_compile_error_names_file_and_line(tmp_path):
    bad = tmp_path / "broken.cu"
    bad.write_text('#include "common.cuh"\n\nextern "C" __global__ void k(float* y) {\n'
                   '    y[0] = 1.0f   // missing semicolon\n}\n')
    with pytest.raises(KernelCompileError) as info:
        runtime.compile_cubin(bad, "90")
    err = info.value
    assert err.file.endswith("broken.cu")
    assert err.line == 5 or err.line == 4
    assert f"broken.cu:{err.line}" in str(err)
    assert "error" in err.log


@needs_nvrtc
def test_cache_key_covers_included_headers(tmp_path, monkeypatch):
    kdir = tmp_path / "kernels_cu"
    shutil.copytree(runtime.KERNEL_DIR, kdir)
    monkeypatch.setattr(runtime, "KERNEL_DIR", kdir)
    src = kdir / "add.cu"
    k1 = runtime.cache_key(src, "90", ())
    assert runtime.cache_key(src, "90", ()) == k1
    assert runtime.cache_key(src, "80", ()) != k1
    assert runtime.cache_key(src, "90", ("-DFOO",)) != k1
    (kdir / "common.cuh").write_text((kdir / "common.cuh").read_text() + "\n// edited\n")
    assert runtime.cache_key(src, "90", ()) != k1


def test_ptxas_report_parses_spills():
    log = ("ptxas info    : Compiling entry function 'foo' for 'sm_90'\n"
           "ptxas info    : Function properties for foo\n"
           "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 0 barriers\n")
    (row,) = runtime.ptxas_report(log)
    assert row == {"kernel": "foo", "registers": 255, "stack": 8, "spill_stores": 4, "spill_loads": 4}


def test_array_module_rejects_non_arrays():
    import numpy as np
    assert runtime.array_module(np.zeros(1)) is np


@pytest.mark.cuda
def test_kernel_attributes_on_gpu():
    k = runtime.get_kernel("reduce", "reduce_sum_all_stage1_kernel_f32")
    attrs = runtime.kernel_attributes(k)
    assert attrs["registers"] > 0 and attrs["local_bytes"] == 0
    assert attrs["shared_bytes"] >= 32 * 4


@pytest.mark.cuda
def test_load_module_is_cached_in_memory():
    assert runtime.load_module("add") is runtime.load_module("add")


@pytest.mark.cuda
def test_launch_opts_in_when_static_plus_dynamic_shared_memory_passes_48k():
    """A kernel with 16 KB of static shared memory launched with 40 KB of dynamic: under 48 KB each,
    over it together, which CUDA refuses without the opt-in (CUDA_ERROR_INVALID_VALUE). launch opts
    in; the kernel (which ignores the extra memory) writes the same bits as without it."""
    import numpy as np
    cp = runtime.cupy
    k = runtime.get_kernel("layernorm", "layernorm_backward_colsum_kernel_v2_n3_bf16")
    static = runtime.kernel_attributes(k)["shared_bytes"]
    dynamic = 40 * 1024
    assert static < 48 * 1024 < static + dynamic
    rows, C = 8, 768
    rng = np.random.default_rng(0)
    # bf16 arrays as their raw bits (uint16): finite values below 1 in magnitude
    dout, x = (cp.asarray(rng.integers(0x3000, 0x3f00, (rows, C)).astype(np.uint16)) for _ in range(2))
    weight = cp.asarray(rng.integers(0x3000, 0x3f00, C).astype(np.uint16))
    mean, rstd = cp.zeros(rows, np.float32), cp.ones(rows, np.float32)
    outs = []
    for smem in (0, dynamic):
        scratch, dx = cp.zeros((1, 3, C), np.float32), cp.zeros((rows, C), np.uint16)
        runtime.launch(k, 1, 128, (scratch, dx, dout, x, weight, mean, rstd, np.int32(rows), np.int32(C)),
                       shared_mem=smem)
        outs.append((cp.asnumpy(dx), cp.asnumpy(scratch)))
    assert outs[0][0].tobytes() == outs[1][0].tobytes() and outs[0][1].tobytes() == outs[1][1].tobytes()
    assert np.abs(outs[0][1]).sum() > 0          # the kernel did write its partial sums


def test_resident_blocks_keeps_apart_kernels_whose_ids_could_be_reused(monkeypatch):
    """resident_blocks caches by id(kernel): a kernel object freed after its entry was made (a
    RawModule's get_function makes a new one each call) must not hand its id, and so its figure,
    to the next kernel (a probe of another tree's module once read a 4-block grid for a 5-block
    kernel that way, and ran a second wave)."""
    class FakeKernel:
        def __init__(self, registers):
            self.attributes = {"registers": registers, "shared_bytes": 0}

    monkeypatch.setattr(runtime, "_RESIDENT", {})
    monkeypatch.setattr(runtime, "kernel_attributes", lambda k: k.attributes)
    monkeypatch.setattr(runtime, "device_attribute", lambda name: {"MaxThreadsPerMultiProcessor": 2048}[name])
    for _ in range(20):                      # CPython reuses a freed object's memory, hence its id
        assert runtime.resident_blocks(FakeKernel(255), 128, sm_shared_bytes=227 * 1024) == 2
        assert runtime.resident_blocks(FakeKernel(32), 128, sm_shared_bytes=227 * 1024) == 16
