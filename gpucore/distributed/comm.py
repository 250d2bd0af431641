"""Communicators: the one small interface data-parallel training talks to.

Every collective the trainer needs, on 1-D contiguous arrays (views into the
flat gradient / parameter buffers):

    all_reduce(send, recv=None)   recv = sum over ranks of send (in place when recv is None)
    all_reduce_max(buf)           buf = elementwise max over ranks, in place (FP8 amaxes)
    reduce_scatter(send, recv)    send.size == world * recv.size; rank r gets the sum of send's r-th block
    all_gather(send, recv)        recv.size == world * send.size; rank r's send lands in recv's r-th block
    group()                       a context: the collectives inside are issued as one (NCCL group)
    all_reduce_host(values)       sum of a small float64 vector, returned on the host (loss, flags)
    broadcast_object(obj)         rank 0's picklable object on every rank
    abort()                       tear the communicator down without waiting for the peers

Implementations:
    NcclComm    GPU arrays, through NCCL (cupy.cuda.nccl) on the current CUDA stream
    MpiComm     NumPy arrays, through MPI (mpi4py): CPU ranks under mpirun / srun
    SocketComm  NumPy arrays over TCP, in gpucore.distributed.hostcomm: CPU ranks of
                `gpucore train --nproc N`, and the store that hands out NCCL's id when
                there is no MPI
The training code (gpucore.distributed.reducer / zero) is the same for all
three, so the CPU tests exercise the GPU's bucketing and sharding logic.

Sums run in a fixed order for a fixed world size (NCCL's ring/tree choice is
fixed for a given size and topology; MPI's and ours by rank), so a run is
bitwise reproducible with the same number of ranks.
"""
from __future__ import annotations

import contextlib
import pickle

import numpy as np


class DistributedError(RuntimeError):
    """A peer died, hung past the timeout, or the ranks could not connect; one line naming the rank."""


class Communicator:
    """The interface (see the module docstring); rank, world_size and local_rank are ints."""
    rank = 0
    world_size = 1
    local_rank = 0
    kind = "none"

    def all_reduce(self, send, recv=None):
        raise NotImplementedError

    def all_reduce_max(self, buf):
        raise NotImplementedError

    def reduce_scatter(self, send, recv):
        raise NotImplementedError

    def all_gather(self, send, recv):
        raise NotImplementedError

    @contextlib.contextmanager
    def group(self):
        yield

    def all_reduce_host(self, values) -> np.ndarray:
        raise NotImplementedError

    def broadcast_object(self, obj):
        raise NotImplementedError

    def barrier(self) -> None:
        self.all_reduce_host(np.zeros(1))

    def abort(self) -> None:
        """Stop without waiting for the peers (a dead or hung rank): unblocks pending collectives."""

    def close(self) -> None:
        """Orderly shutdown (every rank calls it)."""

    def describe(self) -> str:
        return f"{self.kind}, rank {self.rank} of {self.world_size}"


def check_sizes(op: str, send, recv, world: int) -> None:
    """The size rules of reduce_scatter / all_gather (a wrong view would corrupt a neighbour's data)."""
    if op == "reduce_scatter" and send.size != world * recv.size:
        raise ValueError(f"reduce_scatter: send has {send.size} elements, expected {world} x {recv.size}")
    if op == "all_gather" and recv.size != world * send.size:
        raise ValueError(f"all_gather: recv has {recv.size} elements, expected {world} x {send.size}")


# --------------------------------------------------------------------- NCCL ----

class NcclComm(Communicator):
    """NCCL on the GPU this process uses; collectives go on the current CUDA stream."""
    kind = "nccl"

    def __init__(self, unique_id, rank: int, world_size: int, local_rank: int):
        from cupy.cuda import nccl
        self._nccl = nccl
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self._comm = nccl.NcclCommunicator(world_size, unique_id, rank)
        self._closed = False

    @staticmethod
    def new_unique_id():
        from cupy.cuda import nccl
        return nccl.get_unique_id()

    def _dtype(self, a):
        from .. import dtypes
        n = self._nccl
        table = {np.dtype(np.float32): n.NCCL_FLOAT32, np.dtype(np.float64): n.NCCL_FLOAT64,
                 dtypes.bfloat16: n.NCCL_BFLOAT16, np.dtype(np.int32): n.NCCL_INT32}
        try:
            return table[a.dtype]
        except KeyError:
            raise TypeError(f"NCCL: unsupported dtype {a.dtype}") from None

    @staticmethod
    def _stream():
        from .. import runtime
        return runtime.cupy.cuda.get_current_stream().ptr

    def all_reduce(self, send, recv=None):
        recv = send if recv is None else recv
        self._comm.allReduce(send.data.ptr, recv.data.ptr, send.size, self._dtype(send),
                             self._nccl.NCCL_SUM, self._stream())
        return recv

    def all_reduce_max(self, buf):
        self._comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._dtype(buf), self._nccl.NCCL_MAX,
                             self._stream())
        return buf

    def reduce_scatter(self, send, recv):
        check_sizes("reduce_scatter", send, recv, self.world_size)
        self._comm.reduceScatter(send.data.ptr, recv.data.ptr, recv.size, self._dtype(send),
                                 self._nccl.NCCL_SUM, self._stream())
        return recv

    def all_gather(self, send, recv):
        check_sizes("all_gather", send, recv, self.world_size)
        self._comm.allGather(send.data.ptr, recv.data.ptr, send.size, self._dtype(send), self._stream())
        return recv

    @contextlib.contextmanager
    def group(self):
        self._nccl.groupStart()
        try:
            yield
        finally:
            self._nccl.groupEnd()

    def all_reduce_host(self, values) -> np.ndarray:
        from .. import runtime
        buf = runtime.cupy.asarray(np.asarray(values, dtype=np.float64).reshape(-1))
        self.all_reduce(buf)
        return buf.get()

    def broadcast_object(self, obj):
        from .. import runtime
        cp = runtime.cupy
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if self.rank == 0 else np.zeros(0, np.uint8)
        size = int(self.all_reduce_host([data.size])[0])
        buf = cp.zeros(size, dtype=np.int32)
        if self.rank == 0:
            buf[...] = cp.asarray(data.astype(np.int32))
        self.all_reduce(buf)         # only rank 0 contributes: a broadcast through the sum
        return pickle.loads(buf.get().astype(np.uint8).tobytes())

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self._comm.abort()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._comm.destroy()


# ---------------------------------------------------------------------- MPI ----

def mpi_world():
    """mpi4py's COMM_WORLD, or DistributedError with the install line when mpi4py is missing."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise DistributedError("launched by MPI (mpirun/srun set the rank variables) but mpi4py is not "
                               "installed: pip install 'gpucore[mpi]'") from None
    return MPI


class MpiComm(Communicator):
    """MPI through mpi4py on NumPy arrays (CPU ranks); also NCCL's bootstrap under mpirun."""
    kind = "mpi"

    def __init__(self):
        MPI = mpi_world()
        self._MPI = MPI
        self._comm = MPI.COMM_WORLD
        self.rank, self.world_size = self._comm.Get_rank(), self._comm.Get_size()
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = local.Get_rank()
        local.Free()

    def _host(self, a, name):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"MPI communicator: {name} must be a NumPy array (GPU ranks use NCCL)")
        return a

    @staticmethod
    def _is_bf16(a) -> bool:
        from .. import dtypes
        return a.dtype == dtypes.bfloat16

    def all_reduce(self, send, recv=None):
        recv = send if recv is None else recv
        if self._is_bf16(send):   # MPI has no bfloat16: sum in fp32, round once (as NCCL does for 2 ranks)
            wide = self._host(send, "send").astype(np.float32)
            self._comm.Allreduce(self._MPI.IN_PLACE, wide, op=self._MPI.SUM)
            recv[...] = wide.astype(recv.dtype)
        elif recv is send:
            self._comm.Allreduce(self._MPI.IN_PLACE, self._host(send, "send"), op=self._MPI.SUM)
        else:
            self._comm.Allreduce(self._host(send, "send"), self._host(recv, "recv"), op=self._MPI.SUM)
        return recv

    def all_reduce_max(self, buf):
        self._comm.Allreduce(self._MPI.IN_PLACE, self._host(buf, "buf"), op=self._MPI.MAX)
        return buf

    def reduce_scatter(self, send, recv):
        check_sizes("reduce_scatter", send, recv, self.world_size)
        if self._is_bf16(send):   # in fp32, as all_reduce
            out = np.empty(recv.size, np.float32)
            self._comm.Reduce_scatter_block(self._host(send, "send").astype(np.float32), out, op=self._MPI.SUM)
            recv[...] = out.astype(recv.dtype)
            return recv
        self._comm.Reduce_scatter_block(self._host(send, "send"), self._host(recv, "recv"), op=self._MPI.SUM)
        return recv

    def all_gather(self, send, recv):
        check_sizes("all_gather", send, recv, self.world_size)
        bits = (lambda a: a.view(np.uint16)) if self._is_bf16(send) else (lambda a: a)   # a copy: any 2-byte type
        self._comm.Allgather(bits(self._host(send, "send")), bits(self._host(recv, "recv")))
        return recv

    def all_reduce_host(self, values) -> np.ndarray:
        buf = np.array(values, dtype=np.float64).reshape(-1)
        self._comm.Allreduce(self._MPI.IN_PLACE, buf, op=self._MPI.SUM)
        return buf

    def broadcast_object(self, obj):
        return self._comm.bcast(obj, root=0)

    def barrier(self) -> None:
        self._comm.Barrier()

    def abort(self) -> None:
        self._comm.Abort(1)
