"""DataParallel: what the training loop (gpucore.train) needs to run as one of several ranks.

    dp = DataParallel.start(device, zero=1, timeout=900)  # None for a plain one-process run
    dp.rank, dp.world_size, dp.is_main
    opt = dp.optimizer(model, betas=..., ...)              # AdamW, or ShardedAdamW with --zero 1
    model.backward(on_layer_done=dp.reducer.layer_done)    # the last micro-batch (hooks act with dp_overlap)
    dp.reducer.finish()                                    # before the optimizer: gradients, FP8 amaxes
    loss, stop = dp.agree(loss, stop)                      # mean loss over ranks; stop if any rank stops

Every rank builds the same model from the same seed (no broadcast needed:
the initialisation runs on the host from the seed) and reads its own slice
of each batch. Only rank 0 prints, writes metrics and writes checkpoints.
"""
from __future__ import annotations

from .. import settings
from .launch import Watchdog, connect, detect
from .reducer import GradientReducer, parameter_slices
from .zero import ShardedAdamW, ShardLayout


class DataParallel:
    def __init__(self, info, comm, zero: int, timeout: float):
        self.info, self.comm, self.zero = info, comm, int(zero)
        self.rank, self.world_size = comm.rank, comm.world_size
        self.is_main = self.rank == 0
        self.reducer = None
        self.watchdog = Watchdog(comm, timeout)

    @classmethod
    def start(cls, device: str, zero: int = 0, timeout: float = 900.0, info=None):
        """Connect this rank to its peers, or None when this process was not started as a rank."""
        info = detect() if info is None else info
        if not info.distributed:
            return None
        return cls(info, connect(info, device, timeout), zero, timeout)

    def describe(self) -> str:
        how = {"gpucore": "gpucore --nproc", "mpi": "MPI", "slurm": "SLURM"}.get(self.info.launcher, "?")
        return (f"data parallel: {self.world_size} ranks ({how}; {self.comm.kind}), "
                + ("ZeRO-1 (optimizer state sharded)" if self.zero else "gradients all-reduced"))

    def optimizer(self, model, make, **kw):
        """The run's optimizer (make(), or a ShardedAdamW with `kw` under --zero 1); builds the gradient
        reducer (sharded with --zero 1)."""
        shard = ShardLayout(parameter_slices(model), self.world_size, self.rank) if self.zero else None
        self.reducer = GradientReducer(self.comm, model, shard, overlap=settings.current().dp_overlap)
        if self.zero:
            return ShardedAdamW(model, self.reducer, self.comm, **kw)
        return make()

    def agree(self, loss: float, stop: bool) -> tuple[float, bool]:
        """(mean of the ranks' losses, whether any rank wants to stop): one small all-reduce."""
        total = self.comm.all_reduce_host([loss, 1.0 if stop else 0.0])
        return float(total[0]) / self.world_size, bool(total[1] > 0)

    def mean(self, value: float) -> float:
        return float(self.comm.all_reduce_host([value])[0]) / self.world_size

    def close(self) -> None:
        self.watchdog.stop()
        self.comm.close()


def plan_for(plan: dict, world_size: int, zero: int) -> dict:
    """The memory plan of one rank: with ZeRO-1 master, m and v are sharded and the
    gradients get a compact shard copy (see gpucore.distributed.zero)."""
    if not zero:
        return plan
    out = dict(plan)
    for name in ("master", "m", "v"):
        out[name] = -(-plan[name] // world_size)
    n_bytes = -(-plan["grads"] // world_size)
    out["grad shard"] = n_bytes
    if plan.get("master"):
        out["param shard"] = n_bytes
    else:                         # fp32: the params are the master; ZeRO keeps a master shard
        out["master"] = -(-plan["params"] // world_size)
    return out

