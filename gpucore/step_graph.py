"""One micro-batch's forward + backward as a CUDA graph, replayed every step (`--cuda-graph`).

Why: a GPT-2 step launches ~1,000 kernels (d12; ~4,000 at d48, more with FP8's casts and
guards), each costing the Python host 5-20 us of op checks, views and the launch itself. When
the GPU finishes a kernel faster than the host issues the next one (small batches, FP8, deep
models) the GPU waits. A CUDA graph records the launches once and replays them with one call:
the same kernels with the same arguments in the same order, so the same bits.

How (llm.c has no equivalent; PyTorch's torch.cuda.graphs is the model):
  call 1      eager, as without a graph: kernels compile, cuBLASLt races its algorithms, the
              model allocates its buffers, FP8 scales leave their first-step path.
  call 2      capture: the inputs are copied into buffers the graph owns; forward + backward are
              recorded on a private stream, every allocation they make comes from a private
              CuPy memory pool that nothing else uses (so the graph's temporaries are never
              handed to anyone else), then the graph is launched on the caller's stream.
  call 3...   copy the inputs, launch: two host calls.
The loss array returned is the graph's own: it is overwritten by the next replay (copy it to
keep it). The optimizer step, FP8 scale updates, evaluation and checkpoints stay eager.

What the graph bakes in, and so re-captures on: the batch shape, grad_scale, and the model's
activation buffers (a larger evaluation batch makes the model allocate new ones; the graph
holds the old ones until it is re-captured, so it never writes freed memory).

The graph is launched as captured. Edits of its nodes were measured and removed: cuBLASLt's
4-byte workspace memsets moved beside our kernels (twenty-fifth session), then taken off the chain
altogether on GEMM workspaces of their own (thirty-first): whole steps ran as fast as the captured
graph or slower (the moves' joins: d12 B=64 FP8 0.3-2.7% slower). tools/notes/step_graph.md.

Not graphed: the NumPy backend, data-parallel runs with settings.dp_overlap (the reducer's
per-layer hooks are host code; by default the gradients are reduced after the graph), forward-only
calls. `mode="auto"` falls back to eager for good, with one line saying
why, when a capture fails; `mode="on"` raises instead.
"""
from __future__ import annotations

import numpy as np

from . import runtime

MODES = ("auto", "on", "off")


class GraphCaptureError(RuntimeError):
    """The step could not be captured (mode "on")."""


def resolve(mode: str, device: str, data_parallel: bool = False, dp_overlap: bool = False) -> tuple[bool, str]:
    """(use a graph?, why) for `--cuda-graph mode` on `device`. Pure: no GPU needed. A data-parallel
    run is graphed unless it overlaps the reduction with the backward (settings.dp_overlap), whose
    per-layer buckets are issued from host hooks in the middle of the backward."""
    if mode not in MODES:
        raise ValueError(f"--cuda-graph {mode}: expected one of {', '.join(MODES)}")
    if mode == "off":
        return False, "off"
    why_not = ("the CPU backend runs NumPy, no CUDA" if device != "cuda" else
               "dp_overlap issues gradient buckets from host hooks during the backward" if data_parallel and dp_overlap else
               None)
    if why_not is None:
        return True, "on"
    if mode == "on":
        raise ValueError(f"--cuda-graph on: not available here ({why_not})")
    return False, f"off ({why_not})"


class StepGraph:
    """forward_backward(x, y, grad_scale) == model.forward(..., for_backward=True) + model.backward(),
    replayed from a CUDA graph after the first call (module docstring)."""

    def __init__(self, model, *, strict: bool = False, echo=print):
        if model.xp is np:
            raise ValueError("StepGraph: the model runs on NumPy; CUDA graphs need the cuda backend")
        self.model, self.strict, self.echo = model, strict, echo
        self.graph = None
        self.key = None               # (B, T, grad_scale, id of the activation buffers) of the graph
        self.calls = 0
        self.captures = 0
        self.failed = None            # why capturing failed (auto mode: eager from then on)
        self._keep = ()               # what the graph reads and writes: alive as long as it is

    def forward_backward(self, x, y, grad_scale: float):
        """The mean loss (0-d fp32 on the device; the graph's own array once graphed: copy it to
        keep it past the next call); gradients accumulate into model.grads as backward() does."""
        self.calls += 1
        if self.calls == 1 or self.failed is not None:
            return self._eager(x, y, grad_scale)
        key = (tuple(x.shape), float(grad_scale), id(self.model._acts_full))
        if key != self.key:
            try:
                self._capture(x, y, grad_scale, key)
            except Exception as e:  # noqa: BLE001 - any capture failure: say it once, then eager
                self.graph, self.key, self._keep = None, None, ()
                self.model._backward_ready = self.model._encoder_plan = None
                if self.strict:
                    raise GraphCaptureError(f"--cuda-graph on: the step could not be captured: {e}") from e
                self.failed = f"{type(e).__name__}: {e}"
                self.echo(f"CUDA graph: the step could not be captured ({self.failed}); training eagerly")
                return self._eager(x, y, grad_scale)
        tokens, targets, loss = self._keep[:3]
        tokens[...] = x
        targets[...] = y
        self.graph.launch(stream=runtime.cupy.cuda.get_current_stream())
        return loss

    def _eager(self, x, y, grad_scale):
        loss = self.model.forward(x, y, for_backward=True, grad_scale=grad_scale, check_tokens=False)
        self.model.backward()
        return loss

    def _capture(self, x, y, grad_scale, key):
        cp = runtime.cupy
        model = self.model
        main = cp.cuda.get_current_stream()
        tokens, targets = x.copy(), y.copy()       # the graph's inputs, on the caller's stream
        main.synchronize()                         # capture records only; nothing may be in flight on them,
        self.graph, self._keep = None, ()          # and the old graph's replays are done: drop it and what it held
        pool = cp.cuda.MemoryPool()                # the graph's temporaries: nobody else allocates here
        stream = cp.cuda.Stream(non_blocking=True)
        with cp.cuda.using_allocator(pool.malloc), stream:
            stream.begin_capture()
            try:
                loss = model.forward(tokens, targets, for_backward=True, grad_scale=grad_scale,
                                     check_tokens=False)
                model.backward()
            except BaseException:
                try:
                    stream.end_capture()
                except Exception:  # noqa: BLE001 - the capture is already broken; report the first error
                    pass
                raise
            graph = stream.end_capture()
        self.graph, self.key = graph, key
        self._keep = (tokens, targets, loss, pool, stream) + model.step_buffers()
        self.captures += 1
