"""SocketComm: collectives on NumPy arrays over TCP, for ranks that have no MPI.

Used by `gpucore train --nproc N --device cpu` (N CPU ranks on one machine)
and, on GPUs without MPI (`--nproc N`, srun), as the store that hands NCCL's
unique id from rank 0 to the others. Not a fast path: the CPU backend trains
test-sized models, and GPU gradients go through NCCL.

A star through rank 0: rank 0 listens on (addr, port); every other rank
connects and says its rank. A collective is: each rank > 0 sends its array to
rank 0, rank 0 combines them in rank order (0, 1, 2, ...: the same order on
every run, so sums are bitwise reproducible) and sends each rank its result.
Messages are length-prefixed pickles.

Every wait has a timeout: a peer that dies closes its socket (the waiting
rank sees end-of-file at once) and one that hangs is noticed when the timeout
runs out; both raise DistributedError naming the peer.
"""
from __future__ import annotations

import pickle
import socket
import struct
import time

import numpy as np

from .comm import Communicator, DistributedError, check_sizes

_LEN = struct.Struct("<Q")


class SocketComm(Communicator):
    kind = "tcp"

    def __init__(self, rank: int, world_size: int, addr: str, port: int, timeout: float, local_rank: int = 0):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.timeout = float(timeout)
        self._peers: dict[int, socket.socket] = {}       # rank 0: every other rank; others: {0: rank 0}
        if world_size == 1:
            return
        if rank == 0:
            self._accept_all(addr, port)
        else:
            self._connect(addr, port)

    # ------------------------------------------------------------ set up

    def _accept_all(self, addr, port):
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((addr, port))
        except OSError as e:
            raise DistributedError(f"rank 0: cannot listen on {addr}:{port} ({e.strerror}); "
                                   "set GPUCORE_MASTER_PORT to a free port") from None
        server.listen(self.world_size)
        server.settimeout(self.timeout)
        try:
            while len(self._peers) < self.world_size - 1:
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    missing = sorted(set(range(1, self.world_size)) - set(self._peers))
                    raise DistributedError(f"rank 0: ranks {missing} did not connect to {addr}:{port} within "
                                           f"{self.timeout:.0f} s") from None
                conn.settimeout(self.timeout)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peer = self._recv_from(conn, None)
                self._peers[int(peer)] = conn
        finally:
            server.close()

    def _connect(self, addr, port):
        deadline = time.monotonic() + self.timeout
        while True:       # rank 0 may not be listening yet
            try:
                conn = socket.create_connection((addr, port), timeout=self.timeout)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise DistributedError(f"rank {self.rank}: cannot reach rank 0 at {addr}:{port} "
                                           f"({e.strerror or e}) within {self.timeout:.0f} s") from None
                time.sleep(0.05)
        conn.settimeout(self.timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peers[0] = conn
        self._send_to(conn, self.rank, 0)

    # ------------------------------------------------------------ wire

    def _send_to(self, conn, obj, peer):
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            conn.sendall(_LEN.pack(len(data)) + data)
        except socket.timeout:
            raise DistributedError(f"rank {self.rank}: rank {peer} took no data for {self.timeout:.0f} s "
                                   "(it hangs or died)") from None
        except OSError as e:
            raise DistributedError(f"rank {self.rank}: lost the connection to rank {peer} "
                                   f"({e.strerror or e}; it died?)") from None

    def _recv_exact(self, conn, n, peer):
        chunks, got = [], 0
        while got < n:
            try:
                chunk = conn.recv(min(n - got, 1 << 22))
            except socket.timeout:
                who = f"rank {peer}" if peer is not None else "a connecting rank"
                raise DistributedError(f"rank {self.rank}: no data from {who} for {self.timeout:.0f} s "
                                       "(it hangs or died)") from None
            except OSError as e:
                raise DistributedError(f"rank {self.rank}: lost the connection to rank {peer} "
                                       f"({e.strerror or e}; it died?)") from None
            if not chunk:
                raise DistributedError(f"rank {self.rank}: rank {peer} closed its connection "
                                       "(it exited or died)")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _recv_from(self, conn, peer):
        (n,) = _LEN.unpack(self._recv_exact(conn, _LEN.size, peer))
        return pickle.loads(self._recv_exact(conn, n, peer))

    def _star(self, value, combine):
        """Rank 0 gets every rank's value (in rank order), computes combine(values) -> per-rank results."""
        if self.world_size == 1:
            return combine([value])[0]
        if self.rank != 0:
            self._send_to(self._peers[0], value, 0)
            return self._recv_from(self._peers[0], 0)
        values = [value] + [self._recv_from(self._peers[r], r) for r in range(1, self.world_size)]
        results = combine(values)
        for r in range(1, self.world_size):
            self._send_to(self._peers[r], results[r], r)
        return results[0]

    # ------------------------------------------------------------ collectives

    def _sum(self, values):
        total = values[0].copy()
        for v in values[1:]:
            total += v
        return total

    def all_reduce(self, send, recv=None):
        total = self._star(np.ascontiguousarray(send), lambda vs: [self._sum(vs)] * len(vs))
        out = send if recv is None else recv
        out[...] = total
        return out

    def all_reduce_max(self, buf):
        buf[...] = self._star(np.ascontiguousarray(buf), lambda vs: [np.maximum.reduce(vs)] * len(vs))
        return buf

    def reduce_scatter(self, send, recv):
        check_sizes("reduce_scatter", send, recv, self.world_size)
        recv[...] = self._star(np.ascontiguousarray(send), lambda vs: np.split(self._sum(vs), len(vs)))
        return recv

    def all_gather(self, send, recv):
        check_sizes("all_gather", send, recv, self.world_size)
        recv[...] = self._star(np.ascontiguousarray(send), lambda vs: [np.concatenate(vs)] * len(vs))
        return recv

    def all_reduce_host(self, values) -> np.ndarray:
        buf = np.array(values, dtype=np.float64).reshape(-1)
        return self.all_reduce(buf)

    def broadcast_object(self, obj):
        return self._star(obj, lambda vs: [vs[0]] * len(vs))

    def abort(self) -> None:
        self.close()

    def close(self) -> None:
        for conn in self._peers.values():
            try:
                conn.close()
            except OSError:
                pass
        self._peers.clear()
