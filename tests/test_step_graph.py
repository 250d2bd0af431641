"""gpucore.step_graph: the training step's forward + backward replayed from a CUDA graph.

CPU tests check the decision (`--cuda-graph auto|on|off`) and its errors. GPU tests (pytest -m
cuda) check that graphed training gives the eager run's bits -- losses, gradient norms and
final weights -- for bf16 and FP8 models, with gradient accumulation, and across a batch-shape
change that makes the model reallocate (the graph is then captured again).
"""
import numpy as np
import pytest

from gpucore import runtime, step_graph
from gpucore.model import GPT2, GPT2Config
from gpucore.optim import AdamW
from gpucore.step_graph import StepGraph
from gpucore.train import TrainArgs, TrainError, run, train_step


# ------------------------------------------------------------------ CPU ----

def test_resolve_auto_uses_a_graph_on_a_gpu_unless_the_reduction_overlaps_the_backward():
    assert step_graph.resolve("auto", "cuda") == (True, "on")
    use, why = step_graph.resolve("auto", "cpu")
    assert not use and "CPU backend" in why
    assert step_graph.resolve("auto", "cuda", data_parallel=True) == (True, "on")   # reduced after the backward
    use, why = step_graph.resolve("auto", "cuda", data_parallel=True, dp_overlap=True)
    assert not use and "dp_overlap" in why
    assert step_graph.resolve("off", "cuda") == (False, "off")
    assert step_graph.resolve("on", "cuda") == (True, "on")


def test_resolve_on_where_it_cannot_run_is_one_clear_error():
    with pytest.raises(ValueError, match=r"--cuda-graph on: not available here \(the CPU backend"):
        step_graph.resolve("on", "cpu")
    with pytest.raises(ValueError, match="dp_overlap issues gradient buckets from host hooks"):
        step_graph.resolve("on", "cuda", data_parallel=True, dp_overlap=True)
    with pytest.raises(ValueError, match="expected one of auto, on, off"):
        step_graph.resolve("sometimes", "cuda")


def test_step_graph_refuses_a_numpy_model():
    m = GPT2(GPT2Config.from_preset("micro"), xp=np, dtype="float32", seed=1)
    with pytest.raises(ValueError, match="NumPy"):
        StepGraph(m)


class _FakeModel:
    """Stands for a GPU model: records the calls StepGraph makes."""
    xp = object()                      # not NumPy

    def __init__(self):
        self.calls = []
        self._acts_full = self._backward_ready = self._encoder_plan = None

    def forward(self, x, y, **kw):
        self.calls.append("forward")
        return "loss"

    def backward(self):
        self.calls.append("backward")


def _no_capture(self, *args):
    raise RuntimeError("no capture here")


def test_step_graph_falls_back_to_eager_with_one_line_when_the_capture_fails(monkeypatch):
    monkeypatch.setattr(StepGraph, "_capture", _no_capture)
    x = np.zeros((2, 4), np.int32)
    lines, m = [], _FakeModel()
    g = StepGraph(m, echo=lines.append)
    for _ in range(3):
        assert g.forward_backward(x, x, 0.1) == "loss"
    assert m.calls == ["forward", "backward"] * 3            # every call ran, eagerly
    assert g.failed == "RuntimeError: no capture here" and g.captures == 0
    assert lines == ["CUDA graph: the step could not be captured (RuntimeError: no capture here); training eagerly"]
    strict = StepGraph(_FakeModel(), strict=True, echo=lines.append)
    strict.forward_backward(x, x, 0.1)                        # call 1 is eager in any mode
    with pytest.raises(step_graph.GraphCaptureError, match="--cuda-graph on: the step could not be captured"):
        strict.forward_backward(x, x, 0.1)


def test_train_step_refuses_a_graph_with_an_overlapping_reducer():
    from types import SimpleNamespace
    m = GPT2(GPT2Config.from_preset("micro"), xp=np, dtype="float32", seed=1)
    opt = AdamW(m)
    with pytest.raises(ValueError, match="per-layer host hooks"):
        train_step(m, opt, lambda: None, 1, 1e-3, reducer=SimpleNamespace(overlap=True), graph=object())


def test_train_step_reduces_after_the_graphed_backward():
    """With a reducer that does not overlap (the default), every micro-batch runs through the graph and
    the reduction follows the last one, before the optimizer: the same step as without the graph."""
    from types import SimpleNamespace
    cfg = GPT2Config.from_preset("micro")
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, cfg.vocab_size, size=(2, 17), dtype=np.int32) for _ in range(2)]
    results = []
    for graphed in (False, True):
        m = GPT2(cfg, xp=np, dtype="float32", seed=1)
        opt, calls, it = AdamW(m), [], iter(batches)

        def fb(x, y, s, m=m, calls=calls):
            calls.append("graph")
            loss = m.forward(x, y, for_backward=True, grad_scale=s, check_tokens=False)
            m.backward()
            return loss
        graph = SimpleNamespace(forward_backward=fb) if graphed else None
        reducer = SimpleNamespace(overlap=False, comm=SimpleNamespace(rank=0),
                                  layer_done=lambda l: calls.append("layer"),
                                  finish=lambda calls=calls, m=m: calls.append(("finish", float(abs(m.grads.flat()).sum()))))
        loss, norm = train_step(m, opt, lambda: (lambda b: (b[:, :-1].copy(), b[:, 1:].copy()))(next(it)), 2, 1e-3,
                                reducer=reducer, graph=graph)
        kinds = [c if isinstance(c, str) else c[0] for c in calls]
        assert kinds == (["graph", "graph", "finish"] if graphed else ["layer"] * cfg.num_layers + ["finish"]), kinds
        results.append((float(loss), float(norm), calls[-1][1], m.params.flat().copy()))
    (l0, n0, g0, p0), (l1, n1, g1, p1) = results
    assert (l0, n0, g0) == (l1, n1, g1) and g0 > 0 and np.array_equal(p0, p1)


def test_train_cuda_graph_on_cpu_is_a_train_error(shards, tmp_path):
    args = TrainArgs(model="tiny", device="cpu", batch_size=2, seq_len=32, steps=1, val_every=0, sample_every=0,
                     data=str(shards), out_dir=str(tmp_path), cuda_graph="on")
    with pytest.raises(TrainError, match="--cuda-graph on: not available here"):
        run(args, echo=lambda s: None)


def test_train_header_says_whether_the_step_is_graphed(shards, tmp_path):
    lines = []
    args = TrainArgs(model="tiny", device="cpu", batch_size=2, seq_len=32, steps=1, val_every=0, sample_every=0,
                     data=str(shards), out_dir=str(tmp_path), checkpoint=False)
    run(args, echo=lines.append)
    assert any("CUDA graph off (the CPU backend runs NumPy, no CUDA)" in line for line in lines)


# ------------------------------------------------------------------ GPU ----

# hd 64: the attention runs its production kernels (v3 on Hopper), as in GPT-2
_CFG = dict(num_layers=2, num_heads=2, channels=128, max_seq_len=64)


def _batches(cfg, n, B, T, seed=0):
    r = np.random.default_rng(seed)
    return [(r.integers(0, cfg.vocab_size, (B, T), dtype=np.int32),
             r.integers(0, cfg.vocab_size, (B, T), dtype=np.int32)) for _ in range(n)]


def _train(graphed, *, fp8=None, steps=5, accum=1, B=4, T=64, eval_at=None, eval_B=8):
    """Losses, norms and final weights of `steps` AdamW steps; eval_at: after that step, an eager
    forward of an eval_B batch (eval_B > B makes the model reallocate its activations)."""
    cp = runtime.cupy
    cfg = GPT2Config(**_CFG)
    m = GPT2(cfg, xp=cp, dtype="bfloat16", seed=5, fp8=fp8)
    opt = AdamW(m, weight_decay=0.1, max_grad_norm=1.0)
    feed = iter([(cp.asarray(x), cp.asarray(y)) for x, y in _batches(cfg, steps * accum, B, T)])
    graph = StepGraph(m, strict=True) if graphed else None
    losses, norms = [], []
    for s in range(steps):
        loss, norm = train_step(m, opt, lambda: next(feed), accum, 1e-3, graph=graph)
        losses.append(float(loss))
        norms.append(float(norm))
        if eval_at == s:
            x, y = _batches(cfg, 1, eval_B, T, seed=9)[0]
            losses.append(float(m.forward(cp.asarray(x), cp.asarray(y))))
    return losses, norms, m.params.flat().get().tobytes(), graph


def _need_fp8():
    from gpucore.ops.fp8 import fp8_supported
    ok, why = fp8_supported()
    if not ok:
        pytest.fail(why)      # the cuda marker says there is a GPU; our test GPUs are Hopper


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [None, "adaptive", "delayed", "current"])
@pytest.mark.parametrize("accum", [1, 2])
def test_gpu_graphed_training_is_bitwise_the_eager_one(fp8, accum):
    if fp8:
        _need_fp8()
    eager = _train(False, fp8=fp8, accum=accum)
    graphed = _train(True, fp8=fp8, accum=accum)
    assert graphed[0] == eager[0]           # losses
    assert graphed[1] == eager[1]           # gradient norms
    assert graphed[2] == eager[2]           # final weights, byte for byte
    g = graphed[3]
    assert g.calls == 5 * accum and g.captures == 1 and g.failed is None
    # each step saw its own batch (a graph replaying stale inputs would repeat a loss)
    assert np.isfinite(eager[0]).all() and len(set(eager[0])) == len(eager[0])


@pytest.mark.cuda
def test_gpu_graph_is_captured_again_after_the_model_reallocates():
    """An eval batch larger than the training one makes the model allocate new activations; the
    graph notices, captures again, and training goes on with the eager run's bits."""
    eager = _train(False, eval_at=2)
    graphed = _train(True, eval_at=2)
    assert graphed[:3] == eager[:3]
    assert graphed[3].captures == 2


@pytest.mark.cuda
def test_gpu_eval_between_graphed_steps_changes_nothing():
    """A smaller eval batch runs in the training buffers (no reallocation): one capture."""
    eager = _train(False, eval_at=1, eval_B=2)
    graphed = _train(True, eval_at=1, eval_B=2)
    assert graphed[:3] == eager[:3]
    assert graphed[3].captures == 1


@pytest.mark.cuda
def test_gpu_train_command_with_and_without_graph_agree(shards, tmp_path):
    """Whole `gpucore train` runs (validation every 2 steps, checkpoint at the end)."""
    res = {}
    for mode in ("off", "on"):
        lines = []
        args = TrainArgs(model="tiny", device="cuda", batch_size=4, seq_len=64, steps=6, val_every=2, val_steps=2,
                         sample_every=0, data=str(shards), out_dir=str(tmp_path / mode), cuda_graph=mode)
        res[mode] = run(args, echo=lines.append)
        assert any(f"CUDA graph {mode}" in line for line in lines)
    assert res["on"]["losses"] == res["off"]["losses"]
    assert res["on"]["val_losses"] == res["off"]["val_losses"]


@pytest.mark.cuda
def test_gpu_graphed_training_with_the_fp8_lm_head_is_bitwise_the_eager_one():
    from gpucore import settings
    _need_fp8()
    with settings.using(fp8_lm_head=True):
        eager = _train(False, fp8="adaptive")
        graphed = _train(True, fp8="adaptive")
    assert graphed[:3] == eager[:3]
    assert graphed[3].captures == 1


def test_step_buffers_name_everything_a_graphed_step_writes():
    """GPT2.step_buffers: activations, backward scratch, gradients and (FP8) the linears' and the
    LM head's scratch, the same objects the step used (the graph keeps exactly these alive)."""
    from gpucore import settings
    cfg = GPT2Config.from_preset("micro")
    r = np.random.default_rng(0)
    x, y = (r.integers(0, cfg.vocab_size, (2, 16), dtype=np.int32) for _ in range(2))
    with settings.using(fp8_lm_head=True):
        m = GPT2(cfg, xp=np, dtype="bfloat16", seed=1, fp8="adaptive")
    m.zero_grad()
    m.forward(x, y, for_backward=True)
    m.backward()
    got = m.step_buffers()
    assert got[:3] == (m._acts_full, m._grad_full, m.grads)
    assert len(got) == 3 + 6 + 4                      # x8, x8T, g8, g8T, W8, W8T; lnf8, wte8, wte8T, dlogits8
    assert all(a is b for a, b in zip(got[3:9], m.fp8._scratch)) and all(a is b for a, b in zip(got[9:], m.fp8._head[1]))
    assert GPT2(cfg, xp=np, dtype="bfloat16", seed=1).step_buffers() == (None, None, None)
