"""The torch.distributed backend (gloo): hvdrun's collectives on a gloo process group of its own.

The hvdrun rendezvous (authenticated) carries the address of a TCPStore that rank 0 opens
on a free port, so this backend never collides with a script's own ``MASTER_PORT``.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hvdrun.envvars import LaunchInfo
from hvdrun.protocol.sockets import bind_host, listen
from hvdrun.runtime.backends.backend import Backend, World, topology
from hvdrun.runtime.device import TorchGroup
from hvdrun.runtime.peers import Peer
from hvdrun.runtime.reduce import MAX, MIN, PRODUCT, SUM, ReduceFn
from hvdrun.runtime.rendezvous import Rendezvous
from hvdrun.runtime.transport.channels import AbortFlag, Message

_OP_OF: dict[Any, int] = {np.add: SUM, np.minimum: MIN, np.maximum: MAX, np.multiply: PRODUCT}


def open_store(rank: int, size: int, timeout_s: float, addr: str = "", port: int = 0) -> Any:
    """Rank 0 opens a TCPStore on a free port of the interface that reaches ``addr`` (its advertised
    address: loopback for a job on one machine); the others join it at ``addr:port``."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        listener = listen(addr, 0, size)
        port = listener.getsockname()[1]
        # the store takes the socket over and closes it when it is destroyed: Python must not own it too
        return dist.TCPStore(bind_host(addr) or "0.0.0.0", port, size, True, timeout=timeout,
                             wait_for_workers=False, master_listen_fd=listener.detach())
    return dist.TCPStore(addr, port, size, False, timeout=timeout)


class TorchBackend(Backend):
    """Collectives on a torch.distributed gloo process group, on numpy buffers viewed as tensors."""

    name = "gloo"
    wakeable = False

    def __init__(self, world: World, group: TorchGroup, store: Any, peers: Sequence[Peer]) -> None:
        self.world, self.group, self._store, self.peers = world, group, store, peers

    @classmethod
    def connect(cls, launch: LaunchInfo, rendezvous: Rendezvous, timeout_s: float, generation: int,
                store_port: int = 0, abort: AbortFlag | None = None) -> TorchBackend:
        """Open (rank 0) or join the store named in the rendezvous table, then create the group."""
        store = open_store(0, launch.size, timeout_s, rendezvous.addr) if launch.rank == 0 else None
        address = rendezvous.local_address(time.monotonic() + timeout_s)
        me = Peer(launch.rank, launch.hostname, f"{launch.hostname}/{socket.gethostname()}", os.getpid(),
                  address, store.port if store is not None else 0, store_port)
        peers = rendezvous.exchange(me, timeout_s)
        if store is None:
            store = open_store(launch.rank, launch.size, timeout_s, peers[0].data_addr, peers[0].data_port)
        group = TorchGroup.create("gloo", store, f"hvdrun{generation}", launch.rank, launch.size, timeout_s,
                                  (lambda: abort.reason) if abort is not None else None)
        world = topology(launch.rank, peers.layout.rank_host_keys(), peers.layout.rank_hostnames())
        return cls(world, group, store, peers)

    def allgather_messages(self, payload: Message) -> list[Message]:
        sizes = np.zeros(self.world.size, np.int64)
        sizes[self.world.rank] = len(payload)
        self.allreduce(sizes, np.add)
        out = np.zeros(int(sizes.sum()), np.uint8)
        start = int(sizes[:self.world.rank].sum())
        out[start:start + len(payload)] = np.frombuffer(payload, np.uint8)
        self.allgatherv(out.data.cast("B"), sizes.tolist())
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        return [out[offsets[i]:offsets[i + 1]].tobytes() for i in range(self.world.size)]

    def allreduce(self, array: np.ndarray, reduce: ReduceFn) -> None:
        """gloo's allreduce; what it lacks (int16, NaN through Max/Min) is made up by :meth:`TorchGroup.allreduce`."""
        import torch

        if array.size:
            self.group.allreduce(torch.from_numpy(array), _OP_OF[reduce])

    def reducescatter(self, array: np.ndarray, reduce: ReduceFn, bounds: list[tuple[int, int]]) -> None:
        self.allreduce(array, reduce)

    def allgatherv(self, out: memoryview, sizes: Sequence[int]) -> None:
        import torch

        if not max(sizes, default=0):
            return
        data = np.frombuffer(out, np.uint8)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        mine = torch.from_numpy(data[offsets[self.world.rank]:offsets[self.world.rank + 1]].copy())
        data[:] = self.group.allgather(mine, list(sizes)).numpy()

    def broadcast(self, buffer: memoryview, root: int) -> None:
        import torch

        if len(buffer):
            self.group.broadcast(torch.from_numpy(np.frombuffer(buffer, np.uint8)), root)

    def alltoallv(self, send: memoryview, send_sizes: Sequence[int], matrix: Sequence[Sequence[int]],
                  out: memoryview) -> None:
        import torch

        recv_sizes = [matrix[i][self.world.rank] for i in range(self.world.size)]
        send_tensor = torch.from_numpy(np.frombuffer(send, np.uint8) if len(send) else np.empty(0, np.uint8))
        recv_tensor = torch.from_numpy(np.frombuffer(out, np.uint8) if len(out) else np.empty(0, np.uint8))
        self.group.alltoall(recv_tensor, send_tensor, recv_sizes, list(send_sizes))

    def close(self) -> None:
        self.group.close()
        self._store = None
