"""ZeRO-1: each rank keeps and updates only its shard of the fp32 master weights and AdamW state.

Sharding (ShardLayout): every parameter slice (a tensor, or one layer's part
of a per-layer tensor; see reducer.parameter_slices) of s elements is cut
into world_size equal pieces of p = s // world_size; rank r owns elements
[r*p, (r+1)*p) of it, which is exactly the block NCCL's reduce-scatter hands
rank r and where all-gather puts rank r's data. The s - world*p leftover
elements of a slice (its tail, fewer than world_size) are replicated: every
rank all-reduces them and applies the same update, so no size constraint is
placed on the model. A rank's shard is one contiguous ("compact") buffer:

    [ piece of slice 0 | piece of slice 1 | ... | tail of slice 0 | tail of slice 1 | ... ]

With one rank the compact buffer is the flat buffer itself (same order).

One step of ShardedAdamW:
  1. the reducer has reduce-scattered the gradients into the compact shard;
  2. global gradient norm: each rank's sum of squares of its pieces (rank 0
     also counts the tails, once), all-reduced, square root;
  3. the fused AdamW kernel updates the shard (master, m, v) and writes its
     bf16 copy (or, in fp32, the master shard is the copy);
  4. all-gather per slice writes every rank's pieces into the full
     parameter buffer; the tails are written from the compact copy.
Checkpoints hold the whole state: state_arrays() all-gathers master, m and
v into full flat host arrays (the same file a one-rank run writes), and
load_state() takes this rank's shard from full arrays, so a run saved on N
ranks resumes on M.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes
from ..ops.adamw import adamw_update, grad_norm


class ShardLayout:
    """Which elements of the flat buffer rank `rank` of `world` owns (see the module docstring).

    piece[i], piece_at[i]: slice i's piece length and its offset in the compact buffer;
    tail[i], tail_at[i]: the same for its replicated tail. sharded_size: the pieces' total
    (the compact prefix); size: pieces + tails. tail_index: flat position of each tail element
    (fewer than world a slice). No index of the whole shard is kept: at 8 bytes an element it
    would cost, on 2 ranks, all the memory ZeRO-1 saves (d48: 6.2 GB); take() copies the pieces
    as the contiguous ranges they are.
    """

    def __init__(self, slices, world: int, rank: int):
        self.world, self.rank = int(world), int(rank)
        self.offsets = [off for _, _, off, _, _ in slices]
        self.piece = [size // world for _, _, _, size, _ in slices]
        self.tail = [size - world * p for (_, _, _, size, _), p in zip(slices, self.piece)]
        self.piece_at = list(np.cumsum([0] + self.piece[:-1]).astype(int))
        self.sharded_size = int(sum(self.piece))
        self.tail_at = list(self.sharded_size + np.cumsum([0] + self.tail[:-1]).astype(int))
        self.size = self.sharded_size + int(sum(self.tail))
        tails, spans = [], []
        for (_, _, off, _, decay), p, t, pa, ta in zip(slices, self.piece, self.tail, self.piece_at, self.tail_at):
            tails.append(np.arange(off + world * p, off + world * p + t, dtype=np.int64))
            if decay:
                spans += [(pa, pa + p), (ta, ta + t)]
        self.tail_index = np.concatenate(tails) if slices else np.zeros(0, np.int64)
        self.decay_spans = spans

    def ranges(self):
        """(compact offset, flat offset, length) of every piece and tail, in compact order."""
        w, r = self.world, self.rank
        out = [(pa, off + r * p, p) for off, p, pa in zip(self.offsets, self.piece, self.piece_at) if p]
        return out + [(ta, off + w * p, t) for off, p, t, ta in zip(self.offsets, self.piece, self.tail, self.tail_at)
                      if t]

    def index(self) -> np.ndarray:
        """Flat position of each compact element (int64, `size` of them: for tests and small checks)."""
        parts = [np.arange(f, f + n, dtype=np.int64) for _, f, n in self.ranges()]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def take(self, full, out=None, convert=None):
        """This rank's compact shard of a full flat array: into `out` (any dtype: the values are cast),
        or a new array of full's dtype on the host. convert: applied to each range before it is stored
        (cupy.asarray: a host array into a device `out`, one range at a time, with no shard-sized
        temporary); without it, `out` must be of full's module."""
        if out is None:
            full = np.asarray(full)
            out = np.empty(self.size, dtype=full.dtype)
        for at, f, n in self.ranges():
            out[at:at + n] = full[f:f + n] if convert is None else convert(full[f:f + n])
        return out


class ShardedAdamW:
    """AdamW with ZeRO-1 sharding; the interface of gpucore.optim.AdamW (step, state_*, step_count)."""

    def __init__(self, model, reducer, comm, *, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 max_grad_norm: float | None = 1.0):
        if reducer.shard is None:
            raise ValueError("ShardedAdamW needs a GradientReducer built with a ShardLayout")
        self.model, self.reducer, self.comm, self.shard = model, reducer, comm, reducer.shard
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self.max_grad_norm = float(max_grad_norm) if max_grad_norm else None
        xp, n = model.xp, self.shard.size
        self._tail_index = xp.asarray(self.shard.tail_index)
        self.master = self.shard.take(model.params.flat(), out=xp.empty(n, dtype=np.float32))
        self.m = xp.zeros(n, dtype=np.float32)
        self.v = xp.zeros(n, dtype=np.float32)
        # the updated shard in the parameters' dtype (fp32: the master shard itself)
        self.lowp = None if model.dtype == dtypes.float32 else xp.empty(n, dtype=model.dtype)
        self.step_count = 0

    @property
    def master_params(self):
        """This rank's shard of the fp32 weights (compact order)."""
        return self.master

    def global_grad_norm(self):
        """sqrt of the sum over ranks of each rank's squared shard norm (tails counted on rank 0 only)."""
        g = self.reducer.shard_grads
        mine = g if self.comm.rank == 0 else g[:self.shard.sharded_size]
        local = grad_norm(mine)
        squared = (local * local).reshape(1).astype(np.float32)
        self.comm.all_reduce(squared)
        return self.model.xp.sqrt(squared).reshape(())

    def step(self, lr: float):
        """One sharded AdamW update from the reducer's shard gradients; returns the global norm (pre-clip)."""
        norm = self.global_grad_norm()
        self.step_count += 1
        adamw_update(self.master, self.reducer.shard_grads, self.m, self.v, lr=float(lr), step=self.step_count,
                     beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay,
                     decay_spans=self.shard.decay_spans, grad_norm=norm if self.max_grad_norm else None,
                     max_grad_norm=self.max_grad_norm, params_lowp=self.lowp)
        self.gather(self.lowp if self.lowp is not None else self.master, self.model.params.flat())
        return norm

    def gather(self, compact, full) -> None:
        """Every rank's compact shard -> the full flat buffer `full` (same dtype), on every rank."""
        shard, world = self.shard, self.comm.world_size
        with self.comm.group():
            for i, (_, _, off, _, _) in enumerate(self.reducer.slices):
                p = shard.piece[i]
                if p:
                    self.comm.all_gather(compact[shard.piece_at[i]:shard.piece_at[i] + p],
                                         full[off:off + world * p])
        if shard.size > shard.sharded_size:
            full[self._tail_index] = compact[shard.sharded_size:]

    # ------------------------------------------------------------ state (whole, for checkpoints)

    def _full_host(self, compact) -> np.ndarray:
        """The whole flat host array of a compact shard (collective). On a GPU the pieces are gathered a
        few slices at a time through one buffer of the largest slice's size: a whole flat buffer (d48:
        6.2 GB in fp32) would stay in CuPy's pool after the first checkpoint, as much as ZeRO-1 saves."""
        shard, world, slices = self.shard, self.comm.world_size, self.reducer.slices
        host = np.empty(self.model.num_parameters, dtype=compact.dtype)
        if self.model.xp is np:
            self.gather(compact, host)
            return host
        cap = max([world * p for p in shard.piece] + [1])
        buf = self.model.xp.empty(cap, dtype=compact.dtype)
        i = 0
        while i < len(slices):
            placed, used = [], 0                    # (flat offset, buffer offset, length) of this round
            with self.comm.group():
                while i < len(slices) and used + world * shard.piece[i] <= cap:
                    p = shard.piece[i]
                    if p:
                        self.comm.all_gather(compact[shard.piece_at[i]:shard.piece_at[i] + p],
                                             buf[used:used + world * p])
                        placed.append((slices[i][2], used, world * p))
                    used += world * p
                    i += 1
            got = buf[:used].get()
            for off, at, n in placed:
                host[off:off + n] = got[at:at + n]
        if shard.size > shard.sharded_size:
            host[shard.tail_index] = compact[shard.sharded_size:].get()
        return host

    def state_arrays(self) -> dict:
        """Full flat m, v (and master with low-precision params) as host arrays; collective: every rank calls it."""
        out = {"m": self._full_host(self.m), "v": self._full_host(self.v)}
        if self.lowp is not None:
            out["master"] = self._full_host(self.master)
        return out

    def state_meta(self) -> dict:
        return {"step": self.step_count, "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps,
                "weight_decay": self.weight_decay, "max_grad_norm": self.max_grad_norm}

    def load_state(self, arrays: dict, meta: dict):
        """This rank's shard of a whole optimizer state (a checkpoint written by any number of ranks)."""
        xp, n = self.model.xp, self.model.num_parameters
        names = ("m", "v") + (("master",) if self.lowp is not None else ())
        for name in names:
            if name not in arrays:
                raise ValueError(f"optimizer state: {name!r} missing from the checkpoint")
            src = arrays[name]
            if tuple(src.shape) != (n,):
                raise ValueError(f"optimizer state: {name!r} has shape {tuple(src.shape)}, expected ({n},)")
            host = src.get() if hasattr(src, "get") else np.asarray(src, dtype=np.float32)
            self.shard.take(host, out=getattr(self, name), convert=xp.asarray)
        if self.lowp is None:        # fp32: the parameters are the master weights
            self.shard.take(self.model.params.flat(), out=self.master)
        self.step_count = int(meta["step"])
