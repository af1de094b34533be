"""The MPI backend: collectives through mpi4py, for jobs started by ``mpiexec``/``mpirun``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hvdrun.envvars import BACKEND
from hvdrun.errors import UsageError
from hvdrun.runtime.backends.backend import Backend, World
from hvdrun.runtime.reduce import ReduceFn
from hvdrun.runtime.transport.channels import Message


def _mpi():  # noqa: ANN202 - imported lazily: mpi4py initialises MPI on import
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise UsageError(f"{BACKEND}=mpi needs mpi4py: pip install 'hvdrun[mpi]'") from e
    return MPI


class MpiBackend(Backend):
    """Collectives on ``MPI.COMM_WORLD``; float16 reductions go through float32 (MPI has no half type)."""

    name = "mpi"
    wakeable = False

    def __init__(self, comm: object, world: World) -> None:
        self.comm, self.world = comm, world
        MPI = _mpi()
        self._ops: dict[Any, Any] = {np.add: MPI.SUM, np.minimum: MPI.MIN, np.maximum: MPI.MAX, np.multiply: MPI.PROD}

    @classmethod
    def connect(cls) -> MpiBackend:
        """Topology from MPI itself: local ranks from a shared-memory split, cross ranks by local rank."""
        MPI = _mpi()
        comm = MPI.COMM_WORLD
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        cross = comm.Split(local.rank, comm.rank)
        hostnames = tuple(comm.allgather(MPI.Get_processor_name()))
        world = World(rank=comm.rank, size=comm.size, local_rank=local.rank, local_size=local.size,
                      cross_rank=cross.rank, cross_size=cross.size, hostnames=hostnames)
        local.Free()
        cross.Free()
        return cls(comm, world)

    def allgather_messages(self, payload: Message) -> list[Message]:
        return self.comm.allgather(payload)  # type: ignore[attr-defined]

    def allreduce(self, array: np.ndarray, reduce: ReduceFn) -> None:
        if array.size:
            _allreduce_keeping_nan(array, reduce, self._allreduce)

    def _allreduce(self, array: np.ndarray, reduce: ReduceFn) -> None:
        MPI = _mpi()
        target = array.astype(np.float32) if array.dtype == np.float16 else array
        self.comm.Allreduce(MPI.IN_PLACE, target, op=self._ops[reduce])  # type: ignore[attr-defined]
        if target is not array:
            array[...] = target

    def reducescatter(self, array: np.ndarray, reduce: ReduceFn, bounds: list[tuple[int, int]]) -> None:
        self.allreduce(array, reduce)

    def allgatherv(self, out: memoryview, sizes: Sequence[int]) -> None:
        MPI = _mpi()
        displacements = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
        buffer = np.frombuffer(out, dtype=np.uint8)
        self.comm.Allgatherv(MPI.IN_PLACE, [buffer, list(sizes), displacements, MPI.BYTE])  # type: ignore

    def broadcast(self, buffer: memoryview, root: int) -> None:
        MPI = _mpi()
        if len(buffer):
            self.comm.Bcast([np.frombuffer(buffer, dtype=np.uint8), MPI.BYTE], root=root)  # type: ignore

    def alltoallv(self, send: memoryview, send_sizes: Sequence[int], matrix: Sequence[Sequence[int]],
                  out: memoryview) -> None:
        MPI = _mpi()
        recv_sizes = [matrix[i][self.world.rank] for i in range(self.world.size)]

        def displacements(sizes: Sequence[int]) -> list[int]:
            return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()

        send_buf = np.frombuffer(send, dtype=np.uint8) if len(send) else np.empty(0, np.uint8)
        recv_buf = np.frombuffer(out, dtype=np.uint8) if len(out) else np.empty(0, np.uint8)
        self.comm.Alltoallv([send_buf, list(send_sizes), displacements(send_sizes), MPI.BYTE],  # type: ignore
                            [recv_buf, recv_sizes, displacements(recv_sizes), MPI.BYTE])


def _allreduce_keeping_nan(array: np.ndarray, reduce: ReduceFn,
                          allreduce: Callable[[np.ndarray, ReduceFn], None]) -> None:
    """``allreduce`` through MPI, whose Max/Min drop NaN at some positions: NaN propagates as
    numpy's and hvdrun's own reductions do, at the cost of one more allreduce of a byte mask, for floating Max/Min
    only."""
    if reduce not in (np.maximum, np.minimum) or array.dtype.kind != "f":
        allreduce(array, reduce)
        return
    nan = np.isnan(array).astype(np.uint8)
    allreduce(nan, np.maximum)
    allreduce(array, reduce)
    if nan.any():
        array[nan.astype(bool)] = np.nan
