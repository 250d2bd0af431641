"""Gradient reduction across ranks: after the backward (the default), or in buckets beside it.

By default (settings.dp_overlap off) finish() reduces everything once the backward is done:
without ZeRO one all-reduce over the whole flat gradient buffer, with ZeRO-1 each tensor's
reduce-scatter. Nothing then runs on the host during the backward, so the step is CUDA-graphed
(gpucore/step_graph.py). On 2 GPUs that was faster at d12 and level at d48 than the overlap
(tools/notes/distributed.md, thirty-fourth session). With dp_overlap on:

The flat parameter buffer is laid out by tensor kind (llm.c's order: wte, wpe,
ln1w[L], ln1b[L], qkvw[L], ...), so one layer's gradients are not one
contiguous range: they are 12 slices, one per per-layer tensor. The backward
pass finishes layer l's gradients when it finishes layer l (GPT2.backward
calls on_layer_done(l); the bias gradient of fcproj[l] is written by layer
l+1's kernels, before that), so bucket l = those 12 slices, reduced as one
NCCL group on a side stream while the backward of layer l-1 runs. The last
bucket (wte, wpe, lnfw, lnfb) follows the encoder backward. The main stream
waits for the side stream only before the optimizer (finish()).

Without ZeRO each slice is all-reduced in place: every rank then holds the
summed gradient and runs the same AdamW update. With ZeRO-1 each slice is
reduce-scattered into this rank's compact shard of the gradients
(gpucore.distributed.zero.ShardLayout); the sharded optimizer updates it.

Each rank's loss was scaled by 1/(its tokens * world size), so the sum over
ranks is the mean over the global batch, exactly as gradient accumulation on
one rank computes it. Gradients are reduced only after the last micro-batch.
"""
from __future__ import annotations

import numpy as np

from .. import runtime
from ..model import parameter_specs


def parameter_slices(model) -> list[tuple[str, int | None, int, int, bool]]:
    """[(name, layer or None, flat offset, size, decays)] in flat-buffer order; per-layer tensors split by layer."""
    cfg, item = model.config, model.dtype.itemsize
    out = []
    for name, shape, decay in parameter_specs(cfg):
        start = model.layout.offsets[name] // item
        size = int(np.prod(shape))
        if len(shape) >= 2 and shape[0] == cfg.num_layers and name not in ("wte", "wpe"):
            per = size // cfg.num_layers
            out += [(name, l, start + l * per, per, decay) for l in range(cfg.num_layers)]
        else:
            out.append((name, None, start, size, decay))
    return out


class GradientReducer:
    """Reduces model.grads across comm's ranks in per-layer buckets (see the module docstring).

    reducer.layer_done(l)   queue bucket l (GPT2.backward's on_layer_done; only with overlap)
    reducer.finish()        queue the rest (and an FP8 model's amax max-reduce); the current
                            stream then waits for all of them
    With `shard` (a ShardLayout), gradients are reduce-scattered into reducer.shard_grads.
    overlap=False (settings.dp_overlap): layer_done does nothing and finish() reduces everything
    after the backward: without ZeRO as one all-reduce over the whole flat buffer (one NCCL call
    instead of ~150 in 13 groups), with ZeRO every bucket's reduce-scatters in turn.
    """

    def __init__(self, comm, model, shard=None, overlap: bool = False):
        self.comm, self.model, self.shard, self.overlap = comm, model, shard, bool(overlap)
        self.slices = parameter_slices(model)
        self.buckets: dict[int | None, list[int]] = {}
        for i, (_, layer, _, _, _) in enumerate(self.slices):
            self.buckets.setdefault(layer, []).append(i)
        xp = model.xp
        self.shard_grads = xp.zeros(shard.size, dtype=model.dtype) if shard is not None else None
        self._gpu = xp is not np
        if self._gpu:
            cp = runtime.cupy
            self.stream = cp.cuda.Stream(non_blocking=True)
            self._ready = cp.cuda.Event(disable_timing=True)
            self._done = cp.cuda.Event(disable_timing=True)

    def layer_done(self, layer: int) -> None:
        if self.overlap:
            self._reduce(self.buckets[layer])

    def finish(self) -> None:
        if self.overlap:
            self._reduce(self.buckets[None])
        elif self.shard is None:   # the whole buffer at once: padding between tensors is zero on every rank
            self._on_stream(lambda: self.comm.all_reduce(self.model.grads.flat()))
        else:                      # every bucket now, in the backward's order
            for layer in sorted((k for k in self.buckets if k is not None), reverse=True):
                self._reduce(self.buckets[layer])
            self._reduce(self.buckets[None])
        scaling = getattr(getattr(self.model, "fp8", None), "scaling", None)
        if scaling is not None:    # FP8: every rank's next scales from the max of all ranks' amaxes
            self._on_stream(lambda: self.comm.all_reduce_max(scaling.amax_slots))
        fch = getattr(getattr(self.model, "fp8", None), "fch_scaling", None)
        if fch is not None:        # fch kept as E4M3: its delayed scales alike
            self._on_stream(lambda: self.comm.all_reduce_max(fch.amax_slots))
        if self._gpu:
            self._done.record(self.stream)
            runtime.cupy.cuda.get_current_stream().wait_event(self._done)

    def _reduce(self, indices) -> None:
        self._on_stream(lambda: self._issue(indices))

    def _on_stream(self, issue) -> None:
        """issue() on the side stream, after what the current stream has queued (this bucket's grads)."""
        if not self._gpu:
            issue()
            return
        self._ready.record(runtime.cupy.cuda.get_current_stream())
        self.stream.wait_event(self._ready)
        with self.stream:
            issue()

    def _issue(self, indices) -> None:
        g = self.model.grads.flat()
        comm, shard = self.comm, self.shard
        with comm.group():
            for i in indices:
                _, _, off, size, _ = self.slices[i]
                if shard is None:
                    comm.all_reduce(g[off:off + size])
                    continue
                piece, tail = shard.piece[i], shard.tail[i]
                if piece:
                    comm.reduce_scatter(g[off:off + comm.world_size * piece],
                                        self.shard_grads[shard.piece_at[i]:shard.piece_at[i] + piece])
                if tail:
                    t0 = off + comm.world_size * piece
                    comm.all_reduce(g[t0:t0 + tail], self.shard_grads[shard.tail_at[i]:shard.tail_at[i] + tail])
