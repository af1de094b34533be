"""The torch.distributed backend (gloo): collectives through a process group of its own.

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
from hvdrun.runtime.backends.base import Backend, World, topology
from hvdrun.runtime.rendezvous import Peer, Rendezvous
from hvdrun.runtime.ring import ReduceFn


class TorchBackend(Backend):
    """Collectives on a torch.distributed gloo process group."""

    name = "gloo"
    wakeable = False

    def __init__(self, world: World, group: object) -> None:
        import torch.distributed as dist

        self.world, self.group, self.dist = world, group, dist
        self._ops: dict[Any, Any] = {np.add: dist.ReduceOp.SUM, np.minimum: dist.ReduceOp.MIN,
                                     np.maximum: dist.ReduceOp.MAX, np.multiply: dist.ReduceOp.PRODUCT}

    @classmethod
    def connect(cls, launch: LaunchInfo, rendezvous: Rendezvous, timeout_s: float, generation: int) -> TorchBackend:
        """Open (rank 0) or join the store named in the rendezvous table, then create the group."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store: Any = dist.TCPStore("0.0.0.0", 0, launch.size, True, timeout=timeout,
                                                    wait_for_workers=False) if launch.rank == 0 else None
        address = rendezvous.local_address(time.monotonic() + timeout_s)
        me = Peer(launch.rank, launch.hostname, f"{launch.hostname}/{socket.gethostname()}", os.getpid(),
                  address, store.port if store is not None else 0)
        peers = rendezvous.exchange(me, timeout_s)
        if store is None:
            store = dist.TCPStore(peers[0].data_addr, peers[0].data_port, launch.size, False, timeout=timeout)
        group = dist.ProcessGroupGloo(dist.PrefixStore(f"hvdrun{generation}", store), launch.rank, launch.size,
                                      timeout)
        world = topology(launch.rank, [p.host_key for p in peers], [p.hostname for p in peers])
        backend = cls(world, group)
        backend._store = store
        return backend

    def _wait(self, work: object) -> None:
        work.wait()  # type: ignore[attr-defined]

    def _tensor(self, array: np.ndarray):  # noqa: ANN202
        import torch

        return torch.from_numpy(array)

    def allgather_messages(self, payload: bytes) -> list[bytes]:
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
        if array.size:
            options = self.dist.AllreduceOptions()
            options.reduceOp = self._ops[reduce]
            self._wait(self.group.allreduce([self._tensor(array)], options))  # type: ignore[attr-defined]

    def reducescatter(self, array: np.ndarray, reduce: ReduceFn, bounds: list[tuple[int, int]]) -> None:
        self.allreduce(array, reduce)

    def allgatherv(self, out: memoryview, sizes: Sequence[int]) -> None:
        width = max(sizes) if len(sizes) else 0
        if not width:
            return
        data = np.frombuffer(out, np.uint8)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        mine = np.zeros(width, np.uint8)
        mine[:sizes[self.world.rank]] = data[offsets[self.world.rank]:offsets[self.world.rank + 1]]
        gathered = [self._tensor(np.empty(width, np.uint8)) for _ in sizes]
        self._wait(self.group.allgather([gathered], [self._tensor(mine)]))  # type: ignore[attr-defined]
        for rank, tensor in enumerate(gathered):
            data[offsets[rank]:offsets[rank + 1]] = tensor.numpy()[:sizes[rank]]

    def broadcast(self, buffer: memoryview, root: int) -> None:
        if len(buffer):
            options = self.dist.BroadcastOptions()
            options.rootRank = root
            tensor = self._tensor(np.frombuffer(buffer, np.uint8))
            self._wait(self.group.broadcast([tensor], options))  # type: ignore[attr-defined]

    def alltoallv(self, send: memoryview, send_sizes: Sequence[int], matrix: Sequence[Sequence[int]],
                  out: memoryview) -> None:
        recv_sizes = [matrix[i][self.world.rank] for i in range(self.world.size)]
        send_tensor = self._tensor(np.frombuffer(send, np.uint8) if len(send) else np.empty(0, np.uint8))
        recv_tensor = self._tensor(np.frombuffer(out, np.uint8) if len(out) else np.empty(0, np.uint8))
        self._wait(self.group.alltoall_base(recv_tensor, send_tensor, recv_sizes, list(send_sizes),  # type: ignore
                                            self.dist.AllToAllOptions()))

    def close(self) -> None:
        self.group = None
        self._store = None
