"""The cuBLAS / cuBLASLt binding (gpucore/cublas.py): the autotune choice, the tune cache on disk,
and on the GPU every algorithm the race may pick, checked against the float64 reference.

The training matmul built on it is tests/test_matmul.py.
"""
import numpy as np
import pytest

import gpucore
from gpucore import cublas, lt_search, runtime, settings
from gpucore.ops import matmul as mm
from conftest import poison, to_cpu
from matmul_checks import check_close, rand

BF16 = gpucore.bfloat16


# ------------------------------------------------------------------ CPU ----

def test_pick_fastest_keeps_the_heuristic_first_choice_unless_clearly_faster():
    assert cublas.pick_fastest([1.0, 0.99, 1.2], margin=0.02) == 0      # 1% faster: not worth a different algorithm
    assert cublas.pick_fastest([1.0, 0.97, 0.95], margin=0.02) == 2     # the fastest, when clearly faster
    assert cublas.pick_fastest([1.0, 0.90, 0.90], margin=0.02) == 1     # ties: the earlier candidate
    assert cublas.pick_fastest([0.5], margin=0.02) == 0


def test_tune_cache_roundtrip(tmp_path):
    """Choices persist across processes (the next process reads the file) and merge with other writers."""
    path = tmp_path / "sub" / "algos.json"
    cache = cublas.TuneCache(path)
    cache.put("gpu|key1", "ab" * 64)
    path.write_text(path.read_text().replace("}", ', "gpu|other": "gemmex"}'))   # another process's entry
    cache.put("gpu|key2", cublas.GEMMEX)
    fresh = cublas.TuneCache(path)                                   # a fresh process
    assert fresh.entries() == {"gpu|key1": "ab" * 64, "gpu|key2": "gemmex", "gpu|other": "gemmex"}
    assert fresh.get("gpu|key1") == "ab" * 64 and fresh.get("gpu|missing") is None


def test_tune_cache_unwritable_keeps_the_choice_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = cublas.TuneCache(blocker / "algos.json")                 # its parent is a file: every write fails
    cache.put("gpu|key", "cd" * 64)
    assert cache.get("gpu|key") == "cd" * 64


def test_cublaslt_off_declines_without_touching_the_library():
    with settings.using(cublaslt=False):
        assert cublas.lt_binding() is None
        assert cublas.lt_gemm(None, None, None, 1, 1, 1) is False


def test_plan_algorithms_beyond_the_heuristic_results():
    """Added (searched or restored) algorithms get indices after the heuristic's slots, their own
    bytes and the label "searched"; the heuristic's keep theirs."""
    import ctypes
    results = (ctypes.c_ubyte * (cublas.LT_ALGO_CANDIDATES * 96))()
    results[96:96 + 64] = bytes(range(64))                            # candidate 1's algorithm bytes
    plan = cublas.Plan(None, None, None, None, results, [0, 1])
    extra = (ctypes.c_ubyte * 96)()
    extra[:64] = bytes([7] * 64)
    i = plan.add(extra)
    assert i == cublas.LT_ALGO_CANDIDATES
    assert plan.algo_hex(i) == "07" * 64 and plan.algo_hex(1) == bytes(range(64)).hex()
    assert plan.algo_ptr(i) == ctypes.addressof(extra)
    assert plan.label(1) == "lt#2/2" and plan.label(i) == "searched"


def test_mixed_radix_walks_every_configuration_once():
    radices = [3, 1, 4, 2]
    seen = {tuple(lt_search.mixed_radix(k, radices)) for k in range(24)}
    assert len(seen) == 24 and all(all(0 <= d < r for d, r in zip(t, radices)) for t in seen)
    assert lt_search.mixed_radix(0, radices) == [0, 0, 0, 0]
    assert lt_search.mixed_radix(23, radices) == [2, 0, 3, 1]
    assert lt_search.mixed_radix(2, radices) == [0, 0, 1, 0]            # the last radix varies fastest


def test_lt_search_setting_parses_from_the_environment():
    assert settings.Settings().lt_search == 0
    assert settings.from_env({"GPUCORE_SETTINGS": "lt_search=1500"}).lt_search == 1500
    with pytest.raises(ValueError, match="lt_search"):
        settings.from_env({"GPUCORE_SETTINGS": "lt_search=many"})


# ------------------------------------------------------------------ GPU ----

@pytest.mark.cuda
def test_gpu_cublaslt_is_used(rng):
    """The fast path must not silently fall back: Lt loads and has plans for the GPT-2 layer shapes."""
    cp = runtime.cupy
    x, w, b = (cp.asarray(rand(rng, s, BF16)) for s in ((256, 768), (2304, 768), (2304,)))
    gpucore.matmul_forward(x, w, b)
    assert cublas.lt_status() == "ok", cublas.lt_status()
    out = cp.empty((256, 2304), BF16)
    assert cublas.lt_gemm(x, w, out, 256, 2304, 768, transpose_b=True, bias=b), "no Lt algorithm"
    check_close(out, mm.matmul_forward_reference(to_cpu(x), to_cpu(w), to_cpu(b), np.float64), BF16, "Lt")


@pytest.fixture
def fresh_lt(tmp_path):
    """cuBLASLt on, the timing race on for every size, no plans and a private tune cache file."""
    with settings.using(cublaslt=True, lt_autotune=True, lt_try_gemmex=True, lt_autotune_min_flops=0,
                        lt_tune_cache=str(tmp_path / "algos.json")):
        lt = cublas.lt_binding()
        assert lt is not None, cublas.lt_status()
        lt.forget()
        yield lt
        lt.forget()                     # the next test starts from the default tune cache again


def _gemm_checker(rng, case, N, K, M):
    """run_and_check(label) for one GEMM of the training path ("forward", "forward_bias": matmul_forward
    into a NaN-poisoned out; "dweight": the backward's dW GEMM, dweight +=), checked against float64;
    returns the output array (on the GPU)."""
    cp = runtime.cupy
    x, w, b = rand(rng, (N, K), BF16), rand(rng, (M, K), BF16, 0.05), rand(rng, (M,), BF16)
    dout, dw0 = rand(rng, (N, M), BF16), rand(rng, (M, K), np.float32)
    gx, gw, gb, gd = (cp.asarray(a) for a in (x, w, b, dout))
    x64, d64 = x.astype(np.float64), dout.astype(np.float64)

    def run_and_check(label):
        if case == "dweight":
            dw = cp.asarray(dw0)
            gpucore.matmul_backward(gd, gx, gw, dweight=dw, need_dx=False, need_dbias=False)
            check_close(dw, dw0 + d64.T @ x64, np.float32, f"dweight +=, {label}", tol=1e-5)
            return dw
        bias = gb if case == "forward_bias" else None
        out = poison((N, M), BF16)
        gpucore.matmul_forward(gx, gw, bias, out=out)
        check_close(out, mm.matmul_forward_reference(x, w, b if bias is not None else None, np.float64),
                    BF16, f"matmul_forward, {label}")
        return out
    return run_and_check


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["forward", "forward_bias", "dweight"])
def test_gpu_lt_every_candidate_algorithm(rng, tmp_path, fresh_lt, case):
    """The timing race runs, remembers its winner on disk, and every algorithm it may pick
    (each heuristic candidate, and gemmEx for epilogue-free GEMMs) is forced in turn and checked.
    "dweight" is the backward's dW GEMM with beta = 1 (dweight +=): raced on a scratch output."""
    lt = fresh_lt
    with_gemmex = case in ("forward", "dweight")                      # no epilogue: gemmEx races too
    run_and_check = _gemm_checker(rng, case, 300, 256, 136)

    run_and_check("after the race")
    plans = [p for p in lt.plans.values() if p is not None]
    assert len(plans) == 1, f"expected one plan, got {len(plans)}"
    plan = plans[0]
    assert plan.choice is not None
    raced = len(plan.candidates) > 1 or with_gemmex
    if raced:
        assert plan.times is not None and len(plan.times) == len(plan.candidates) + with_gemmex
        assert len(lt.tune_cache().entries()) == 1 and (tmp_path / "algos.json").is_file()
    choices = list(plan.candidates) + ([cublas.GEMMEX] if with_gemmex else [])
    for c in choices:
        plan.choice = c
        run_and_check(f"algorithm {c} of {choices}")
    # A new process (no plans, no tune choices in memory) reads the winner from disk and times nothing.
    if raced:
        winner = dict(lt.tune_cache().entries())
        lt.forget()
        run_and_check("choice read from disk")
        plan2 = [p for p in lt.plans.values() if p is not None][0]
        assert plan2.times is None, "timed again instead of reading the tune cache"
        saved = list(winner.values())[0]
        assert (plan2.choice == cublas.GEMMEX) if saved == cublas.GEMMEX else (plan2.algo_hex(plan2.choice) == saved)


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["forward_bias", "dweight"])
def test_gpu_lt_search_every_raced_configuration(rng, tmp_path, fresh_lt, case):
    """With lt_search, configurations beyond the heuristic's join the race; each one raced is
    forced in turn and checked against the reference, and a searched winner saved on disk is
    restored by its bytes in a fresh process (no timing) and gives the same bits."""
    lt = fresh_lt
    run_and_check = _gemm_checker(rng, case, 512, 256, 384)

    with settings.using(lt_search=200):
        run_and_check("after the race")
    plan = [p for p in lt.plans.values() if p is not None][0]
    searched = [i for i in plan.raced if i not in plan.candidates]
    assert searched, "the search found no configuration beyond the heuristic's"
    assert len(plan.times) == len(plan.raced) + (case == "dweight")       # gemmEx races for dW (no epilogue)
    for i in plan.raced:
        plan.choice = i
        run_and_check(f"{plan.label(i)} {lt_search.describe(lt.lib, plan.algo_ptr(i))}")
    # Save a searched configuration as the winner; a fresh process restores it from its bytes.
    key = list(lt.tune_cache().entries())[0]
    lt.tune_cache().put(key, plan.algo_hex(searched[0]))
    plan.choice = searched[0]
    expected = to_cpu(run_and_check("searched, before"))
    lt.forget()
    got = to_cpu(run_and_check("searched, restored"))
    plan2 = [p for p in lt.plans.values() if p is not None][0]
    assert plan2.times is None and plan2.choice not in plan2.candidates
    assert plan2.algo_hex(plan2.choice) == plan.algo_hex(searched[0])
    assert np.array_equal(got.view(np.uint8), expected.view(np.uint8)), "restored configuration gave other bits"


@pytest.mark.cuda
def test_gpu_lt_no_timing_during_graph_capture(rng, fresh_lt):
    """A plan first seen inside a CUDA-graph capture runs the heuristic's first choice untimed
    (events and synchronisation are illegal there) and is timed on the first call outside."""
    cp = runtime.cupy
    lt = fresh_lt
    x, w = cp.asarray(rand(rng, (256, 128), BF16)), cp.asarray(rand(rng, (192, 128), BF16))
    b = cp.asarray(rand(rng, (192,), BF16))
    out = cp.empty((256, 192), BF16)
    lt.device_state()                                   # handle + workspace exist before the capture
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        gpucore.matmul_forward(x, w, b, out=out)      # bias: an Lt-only GEMM, capturable
        graph = s.end_capture()
        graph.launch(stream=s)
        s.synchronize()
    plan = [p for p in lt.plans.values() if p is not None][0]
    assert plan.times is None
    check_close(out, mm.matmul_forward_reference(to_cpu(x), to_cpu(w), to_cpu(b), np.float64), BF16, "captured")
    gpucore.matmul_forward(x, w, b, out=out)
    assert plan.choice is not None and (plan.times is not None or len(plan.candidates) == 1)
