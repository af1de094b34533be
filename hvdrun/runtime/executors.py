"""Execution of negotiated collectives on numpy buffers, one function per kind.

Each executor takes the engine's cycle (its world, backend, table and fusion buffers), the batch of
ready entries and this rank's ops, and returns one result per op. The reduction rules they apply
live in :mod:`hvdrun.runtime.reduce`; the algorithms, in the backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from hvdrun.runtime.backends.backend import Backend, World
from hvdrun.runtime.handles import Handle, LocalOp
from hvdrun.runtime.negotiation import Entry, Request, Table
from hvdrun.runtime.reduce import (
    REDUCE_FNS,
    as_bytes,
    chunk_bounds,
    default_splits,
    final_factor,
    identity,
    reduce_in_rank_order,
    scale,
)
from hvdrun.runtime.transport.channels import Message


class ExecutorHost(Protocol):
    """What executors need of the engine's cycle (``hvdrun.runtime.cycle.Cycle`` provides it)."""

    world: World
    backend: Backend
    table: Table

    def fusion_buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A reusable flat buffer of at least ``count`` elements of ``dtype``."""
        ...


def identity_of(request: Request) -> float | int:
    """The element that leaves ``request``'s reduction unchanged (what a rank outside its set contributes)."""
    if request.kind not in ("allreduce", "reducescatter"):
        return 0
    return identity(request.op, np.dtype(request.dtype or np.uint8))


def stand_in(entry: Entry, rank: int) -> LocalOp:
    """The op of a rank that takes part without a request: zeros if it joined, else the identity (no rows). A device
    op gets an empty placeholder: the device path runs nothing for a rank outside the op's set, and joined ranks
    never reach it (the negotiation refuses device ops with joined ranks); its dtype may be one numpy lacks."""
    request = entry.first
    if request.device != "cpu":
        return LocalOp(request, np.empty(0, np.uint8), Handle())
    shape = (0,) + request.shape[1:] if request.kind in ("allgather", "alltoall") else request.shape
    value = 0 if rank in entry.members else identity_of(request)
    return LocalOp(request, np.full(shape, value, dtype=request.dtype or np.uint8), Handle())


def _postscale(request: Request, set_size: int) -> float:
    return final_factor(request.op, request.postscale, set_size)


# -- executors: (engine, batch, ops) -> one result per op ---------------------------------------


def _eager_allreduce(engine: ExecutorHost, entry: Entry, array: np.ndarray) -> np.ndarray:
    """An allreduce whose data every rank sent with its announcement."""
    payloads = [entry.payloads[r] if r in entry.payloads else stand_in(entry, r).array.tobytes()
                for r in range(engine.world.size)]
    return reduce_contributions(len(entry.members), entry.first, payloads, array)


def reduce_contributions(set_size: int, request: Request, payloads: Sequence[Message], array: np.ndarray) -> np.ndarray:
    """Reduce every rank's contribution locally, in rank order, so all ranks get identical bits."""
    flat = array.reshape(-1)
    reduce_in_rank_order([np.frombuffer(payload, array.dtype) for payload in payloads], flat, request.op)
    scale(flat, _postscale(request, set_size))
    return array


def _allreduce(engine: ExecutorHost, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
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
    allreduce_flat(engine.backend, request, buffer, len(batch[0].members))
    if len(arrays) > 1:
        offset = 0
        for array in arrays:
            array.reshape(-1)[...] = buffer[offset:offset + array.size]
            offset += array.size
    return arrays


def allreduce_flat(backend: Backend, request: Request, flat: np.ndarray, set_size: int) -> None:
    """Allreduce the 1-D ``flat`` in place by ``request``'s op and scale factors."""
    scale(flat, request.prescale)
    backend.allreduce(flat, REDUCE_FNS[request.op])
    scale(flat, _postscale(request, set_size))


def _allgather(engine: ExecutorHost, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    requests, mine = batch[0].requests, ops[0].array
    row_bytes = int(np.prod(mine.shape[1:], dtype=np.int64)) * mine.itemsize
    rows = [requests[rank].shape[0] if rank in requests else 0 for rank in range(engine.world.size)]
    out = np.empty((sum(rows),) + mine.shape[1:], mine.dtype)
    start = sum(rows[:engine.world.rank])
    out[start:start + rows[engine.world.rank]] = mine
    engine.backend.allgatherv(as_bytes(out), [r * row_bytes for r in rows])
    return [out]


def _broadcast(engine: ExecutorHost, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    engine.backend.broadcast(as_bytes(ops[0].array), batch[0].first.root)
    return [ops[0].array]


def _global_splits(entry: Entry, rank: int, size: int) -> list[int]:
    """Rows ``rank`` sends to every global rank (its splits are per rank of the op's set)."""
    members, request = entry.members, entry.requests.get(rank)
    if request is None:
        return [0] * size
    per_member = request.splits or default_splits(request.shape[0], len(members))
    rows = dict(zip(members, per_member, strict=True))
    return [rows.get(r, 0) for r in range(size)]


def _alltoall(engine: ExecutorHost, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    size, rank, mine, entry = engine.world.size, engine.world.rank, ops[0].array, batch[0]
    row_bytes = int(np.prod(mine.shape[1:], dtype=np.int64)) * mine.itemsize
    splits = [_global_splits(entry, r, size) for r in range(size)]
    matrix = [[rows * row_bytes for rows in splits[r]] for r in range(size)]
    received = [splits[r][rank] for r in entry.members]
    out = np.empty((sum(received),) + mine.shape[1:], mine.dtype)
    send = as_bytes(mine)[:sum(matrix[rank])]
    engine.backend.alltoallv(send, matrix[rank], matrix, as_bytes(out))
    return [(out, np.array(received, dtype=np.int32))]


def _reducescatter(engine: ExecutorHost, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
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


def _join(engine: ExecutorHost, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    """Every rank joined: each gets the rank that joined last."""
    return [batch[0].order[-1]] * len(ops)


def _add_set(engine: ExecutorHost, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    """Register a process set on every rank at the same point; its id is the next free one."""
    sets = engine.table.sets
    new_id = max(sets) + 1
    sets[new_id] = tuple(batch[0].first.splits)
    return [new_id] * len(ops)


def _remove_set(engine: ExecutorHost, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    removed = engine.table.sets.pop(batch[0].first.root, None) is not None
    return [removed] * len(ops)


def _nothing(engine: ExecutorHost, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    return [None] * len(ops)


EXECUTORS: dict[str, Callable[[ExecutorHost, list[Entry], list[LocalOp]], list[Any]]] = {
    "allreduce": _allreduce, "allgather": _allgather, "broadcast": _broadcast, "alltoall": _alltoall,
    "reducescatter": _reducescatter, "barrier": _nothing, "shutdown": _nothing, "join": _join,
    "add_set": _add_set, "remove_set": _remove_set,
}
