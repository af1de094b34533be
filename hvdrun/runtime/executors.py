"""Execution of negotiated collectives on numpy buffers, one function per kind.

Each executor takes the engine (its world, backend and fusion buffers), the batch of ready
entries and this rank's ops, and returns one result per op. Also home of the handle and op
records the engine hands out, and of Horovod's scaling rules.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hvdrun.errors import CollectiveError
from hvdrun.runtime.backends.base import Backend, World
from hvdrun.runtime.negotiation import AVERAGE, MIN, PRODUCT, REDUCE_FNS, SUM, Entry, Request, Table
from hvdrun.runtime.ring import as_bytes, chunk_bounds


class Engine(Protocol):
    """What handles and executors need of the engine (``hvdrun.runtime.engine.Engine`` provides it)."""

    world: World
    backend: Backend
    table: Table

    def fusion_buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A reusable flat buffer of at least ``count`` elements of ``dtype``."""
        ...

    def drive_until(self, handle: Handle, timeout_s: float | None) -> None:
        """Run cycles on the caller's thread until ``handle`` is done."""
        ...

    def release_name(self, name: str) -> None:
        """The handle of ``name`` was synchronized: its name is free again."""
        ...


class Handle:
    """The future of one submitted collective."""

    __slots__ = ("_done", "_gate", "_result", "_error", "_engine", "_name")

    def __init__(self, engine: Engine | None = None, name: str | None = None) -> None:
        self._engine, self._name = engine, name
        self._done = False
        self._gate = threading.Lock()  # held until finish(): waiters block on it
        self._gate.acquire()
        self._result: Any = None
        self._error: BaseException | None = None

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Record the outcome and wake waiters (engine side)."""
        if self._done:
            return
        self._result, self._error, self._done = result, error, True
        self._gate.release()

    def done(self) -> bool:
        """True once the collective finished (successfully or not)."""
        return self._done

    @property
    def name(self) -> str | None:
        """The name of the collective (None for handles the engine makes for itself)."""
        return self._name

    def block(self, timeout_s: float) -> None:
        """Sleep until finished or ``timeout_s`` passed, without driving communication."""
        if not self._done and self._gate.acquire(timeout=timeout_s):
            self._gate.release()

    def wait(self, timeout_s: float | None = None) -> Any:
        """Block until finished (driving communication meanwhile); return the result or raise its error.

        Once it has finished, its name is free again on this rank (Horovod's rule: a name is taken from
        submission until the handle is synchronized).
        """
        if not self._done and self._engine is not None:
            self._engine.drive_until(self, timeout_s)
        if not self._done:
            self.block(-1 if timeout_s is None else timeout_s)
        if not self._done:
            raise TimeoutError("collective did not finish in time")
        if self._engine is not None and self._name is not None:
            self._engine.release_name(self._name)
        if self._error is not None:
            raise CollectiveError(str(self._error)) from self._error
        return self._result


@dataclass
class LocalOp:
    """A request of this rank and the buffer it works on."""

    request: Request
    array: Any  # a numpy array (empty for barriers), or a torch tensor for device ops
    handle: Handle
    payload: bytes | None = None


def scale(buffer: np.ndarray, factor: float) -> None:
    """Multiply in place: integers through float64, float16 through float32 (Horovod's rules)."""
    if factor == 1.0 or buffer.size == 0:
        return
    if buffer.dtype in (np.float32, np.float64):
        np.multiply(buffer, factor, out=buffer)
    elif buffer.dtype == np.float16:
        buffer[...] = (buffer.astype(np.float32) * factor).astype(np.float16)
    else:
        buffer[...] = (buffer.astype(np.float64) * factor).astype(buffer.dtype)


def identity_of(request: Request) -> float | int:
    """The element that leaves ``request``'s reduction unchanged (what a rank outside its set contributes)."""
    dtype = np.dtype(request.dtype or np.uint8)
    if request.kind not in ("allreduce", "reducescatter") or request.op in (AVERAGE, SUM):
        return 0
    if request.op == PRODUCT:
        return 1
    limits = np.finfo(dtype) if dtype.kind == "f" else np.iinfo(dtype)
    return limits.max if request.op == MIN else limits.min


def stand_in(entry: Entry, rank: int) -> LocalOp:
    """The op of a rank that takes part without a request: zeros if it joined, else the identity (no rows)."""
    request = entry.first
    shape = (0,) + request.shape[1:] if request.kind in ("allgather", "alltoall") else request.shape
    value = 0 if rank in entry.members else identity_of(request)
    return LocalOp(request, np.full(shape, value, dtype=request.dtype or np.uint8), Handle())


def _postscale(request: Request, set_size: int) -> float:
    """Average divides by the number of ranks in the op's set."""
    return request.postscale / set_size if request.op == AVERAGE else request.postscale


# -- executors: (engine, batch, ops) -> one result per op ---------------------------------------


def _eager_allreduce(engine: Engine, entry: Entry, array: np.ndarray) -> np.ndarray:
    """An allreduce whose data every rank sent with its announcement."""
    payloads = [entry.payloads[r] if r in entry.payloads else stand_in(entry, r).array.tobytes()
                for r in range(engine.world.size)]
    return reduce_contributions(len(entry.members), entry.first, payloads, array)


def reduce_contributions(set_size: int, request: Request, payloads: list[bytes], array: np.ndarray) -> np.ndarray:
    """Reduce every rank's contribution locally, in rank order, so all ranks get identical bits."""
    reduce, dtype = REDUCE_FNS[request.op], array.dtype
    flat = array.reshape(-1)
    reduce(np.frombuffer(payloads[0], dtype), np.frombuffer(payloads[1], dtype), flat)
    for rank in range(2, len(payloads)):
        reduce(flat, np.frombuffer(payloads[rank], dtype), flat)
    scale(flat, _postscale(request, set_size))
    return array


def _allreduce(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    if batch[0].payloads:
        return [_eager_allreduce(engine, batch[0], ops[0].array)]
    request = batch[0].first
    arrays = [op.array for op in ops]
    if len(arrays) == 1:
        buffer = arrays[0].reshape(-1)
    else:
        buffer = engine.fusion_buffer(arrays[0].dtype, sum(int(a.size) for a in arrays))
        offset = 0
        for array in arrays:
            buffer[offset:offset + array.size] = array.reshape(-1)
            offset += array.size
    scale(buffer, request.prescale)
    engine.backend.allreduce(buffer, REDUCE_FNS[request.op])
    scale(buffer, _postscale(request, len(batch[0].members)))
    if len(arrays) > 1:
        offset = 0
        for array in arrays:
            array.reshape(-1)[...] = buffer[offset:offset + array.size]
            offset += array.size
    return arrays


def _allgather(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    requests, mine = batch[0].requests, ops[0].array
    row_bytes = int(np.prod(mine.shape[1:], dtype=np.int64)) * mine.itemsize
    rows = [requests[rank].shape[0] if rank in requests else 0 for rank in range(engine.world.size)]
    out = np.empty((sum(rows),) + mine.shape[1:], mine.dtype)
    start = sum(rows[:engine.world.rank])
    out[start:start + rows[engine.world.rank]] = mine
    engine.backend.allgatherv(as_bytes(out), [r * row_bytes for r in rows])
    return [out]


def _broadcast(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    engine.backend.broadcast(as_bytes(ops[0].array), batch[0].first.root)
    return [ops[0].array]


def _global_splits(entry: Entry, rank: int, size: int) -> list[int]:
    """Rows ``rank`` sends to every global rank (its splits are per rank of the op's set)."""
    members, request = entry.members, entry.requests.get(rank)
    if request is None:
        return [0] * size
    per_member = request.splits or (request.shape[0] // len(members),) * len(members)
    rows = dict(zip(members, per_member, strict=True))
    return [rows.get(r, 0) for r in range(size)]


def _alltoall(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    size, rank, mine, entry = engine.world.size, engine.world.rank, ops[0].array, batch[0]
    row_bytes = int(np.prod(mine.shape[1:], dtype=np.int64)) * mine.itemsize
    splits = [_global_splits(entry, r, size) for r in range(size)]
    matrix = [[rows * row_bytes for rows in splits[r]] for r in range(size)]
    received = [splits[r][rank] for r in entry.members]
    out = np.empty((sum(received),) + mine.shape[1:], mine.dtype)
    send = as_bytes(mine)[:sum(matrix[rank])]
    engine.backend.alltoallv(send, matrix[rank], matrix, as_bytes(out))
    return [(out, np.array(received, dtype=np.int32))]


def _reducescatter(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    request, entry, rank = batch[0].first, batch[0], engine.world.rank
    mine = ops[0].array
    buffer = mine.reshape(-1).copy()
    row_elements = int(np.prod(mine.shape[1:], dtype=np.int64))
    by_member = dict(zip(entry.members, chunk_bounds(mine.shape[0], len(entry.members)), strict=True))
    row_bounds = [by_member.get(r, (0, 0)) for r in range(engine.world.size)]  # outside the set: no chunk
    scale(buffer, request.prescale)
    engine.backend.reducescatter(buffer, REDUCE_FNS[request.op], [(a * row_elements, b * row_elements)
                                                                  for a, b in row_bounds])
    first, last = row_bounds[rank]
    out = buffer[first * row_elements:last * row_elements].reshape((last - first,) + mine.shape[1:]).copy()
    scale(out, _postscale(request, len(entry.members)))
    return [out]


def _join(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    """Every rank joined: each gets the rank that joined last."""
    return [batch[0].order[-1]] * len(ops)


def _add_set(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    """Register a process set on every rank at the same point; its id is the next free one."""
    sets = engine.table.sets
    new_id = max(sets) + 1
    sets[new_id] = tuple(batch[0].first.splits)
    return [new_id] * len(ops)


def _remove_set(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    removed = engine.table.sets.pop(batch[0].first.root, None) is not None
    return [removed] * len(ops)


def _nothing(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    return [None] * len(ops)


EXECUTORS: dict[str, Callable[[Engine, list[Entry], list[LocalOp]], list[Any]]] = {
    "allreduce": _allreduce, "allgather": _allgather, "broadcast": _broadcast, "alltoall": _alltoall,
    "reducescatter": _reducescatter, "barrier": _nothing, "shutdown": _nothing, "join": _join,
    "add_set": _add_set, "remove_set": _remove_set,
}
