"""The engine: one background thread that owns all communication of a rank.

Callers :meth:`Engine.submit` a :class:`Request` with its numpy buffer and get a
:class:`Handle`. The thread runs *cycles*: all-gather of new requests, the ready entries of
the (identical) negotiation table, execution batch by batch (fusing small allreduces). An
idle engine sleeps until it has a new request or a peer starts a cycle. Any error that makes
further communication unsafe (dead peer, hard stall) fails every pending and future op and
is relayed to the other ranks through the rendezvous.
"""

from __future__ import annotations

import marshal
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdrun.errors import CollectiveError
from hvdrun.runtime.backends.base import Backend
from hvdrun.runtime.negotiation import AVERAGE, REDUCE_FNS, Entry, Request, Table, plan
from hvdrun.runtime.ring import as_bytes, chunk_bounds

_IDLE_TIMEOUT_S = 0.5
_HANDLE_SPIN_S = 200e-6
_ENGINE_SPIN_S = 200e-6


class Handle:
    """The future of one submitted collective."""

    __slots__ = ("_event", "_result", "_error")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Record the outcome and wake waiters (engine side)."""
        self._result, self._error = result, error
        self._event.set()

    def done(self) -> bool:
        """True once the collective finished (successfully or not)."""
        return self._event.is_set()

    def wait(self, timeout_s: float | None = None) -> Any:
        """Block until finished; return the result or raise the collective's error."""
        event, deadline = self._event, time.perf_counter() + _HANDLE_SPIN_S
        while not event.is_set() and time.perf_counter() < deadline:
            os.sched_yield()
        if not event.wait(timeout_s):
            raise TimeoutError("collective did not finish in time")
        if self._error is not None:
            raise CollectiveError(str(self._error)) from self._error
        return self._result


@dataclass
class LocalOp:
    """A request of this rank and the buffer it works on."""

    request: Request
    array: np.ndarray | None
    handle: Handle


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


class Engine:
    """Runs the collectives of one rank on ``backend``.

    Args:
        backend: executes negotiated collectives.
        fusion_threshold: largest fused allreduce buffer, in bytes.
        stall_warning_s: warn (on rank 0) about ops some ranks have not submitted for this long.
        stall_error_s: fail every rank after this long (0 disables).
        report_failure: tells the other ranks about a fatal error of this rank.
        cycle_time_s: cycle period for backends that cannot wake an idle peer.
    """

    def __init__(self, backend: Backend, fusion_threshold: int, stall_warning_s: float, stall_error_s: float,
                 report_failure: Callable[[str], None], cycle_time_s: float = 0.001) -> None:
        self.backend, self.world = backend, backend.world
        self.fusion_threshold, self.cycle_time_s = fusion_threshold, cycle_time_s
        self.stall_warning_s, self.stall_error_s = stall_warning_s, stall_error_s
        self._report_failure = report_failure
        self.table = Table(self.world.size)
        self._lock = threading.Lock()
        self._new: list[LocalOp] = []
        self._inflight: dict[str, LocalOp] = {}
        self._counters: defaultdict[str, int] = defaultdict(int)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._sleeping = False
        self._failure: str | None = None
        self._stopped = False
        self._fusion: dict[str, np.ndarray] = {}
        self._thread = threading.Thread(target=self._run, name="hvdrun-engine", daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------------------
    def auto_name(self, kind: str) -> str:
        """``allreduce.noname.7``: ranks that submit unnamed ops in the same order agree on names."""
        with self._lock:
            self._counters[kind] += 1
            return f"{kind}.noname.{self._counters[kind]}"

    def submit(self, request: Request, array: np.ndarray | None = None) -> Handle:
        """Queue a collective; raises ValueError for a name already in flight."""
        op = LocalOp(request, array, Handle())
        with self._lock:
            if self._failure is not None:
                raise CollectiveError(self._failure)
            if self._stopped:
                raise CollectiveError("hvdrun has been shut down on this rank")
            if request.name in self._inflight:
                raise ValueError(f"a collective named '{request.name}' is already in progress on this rank; "
                                 "names must be unique among collectives in flight")
            self._inflight[request.name] = op
            self._new.append(op)
            wake = self._sleeping
        if wake:
            os.write(self._wake_write, b"\0")
        return op.handle

    def stop(self, timeout_s: float) -> None:
        """Negotiate a shutdown with every rank (bounded by ``timeout_s``), then stop the thread."""
        try:
            self.submit(Request("__shutdown__", "shutdown")).wait(timeout_s)
        except (CollectiveError, TimeoutError):
            pass
        with self._lock:
            self._stopped = True
        os.write(self._wake_write, b"\0")
        self._thread.join(timeout_s)
        os.close(self._wake_read)
        os.close(self._wake_write)

    # -- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            last_cycle = time.monotonic()
            while not self._stopped:
                with self._lock:
                    new, self._new = self._new, []
                due = not self.backend.wakeable and time.monotonic() - last_cycle >= self.cycle_time_s
                if new or due or self.backend.peer_waiting():
                    self._cycle(new)
                    last_cycle = time.monotonic()
                else:
                    self._idle()
                self._check_stalls()
        except CollectiveError as e:
            self._fail(str(e))
        except Exception as e:  # a bug: still fail every rank cleanly rather than hang them
            self._fail(f"hvdrun engine crashed on rank {self.world.rank}: {e!r}")

    def _idle(self) -> None:
        deadline = time.perf_counter() + _ENGINE_SPIN_S
        while time.perf_counter() < deadline:
            if self._new or self.backend.peer_waiting():
                return
            os.sched_yield()
        with self._lock:
            if self._new or self._stopped:
                return
            self._sleeping = True
        timeout = _IDLE_TIMEOUT_S if self.backend.wakeable else self.cycle_time_s
        try:
            self.backend.wait_for_peer([self._wake_read], timeout)
        finally:
            self._sleeping = False
            try:
                while os.read(self._wake_read, 4096):
                    pass
            except BlockingIOError:
                pass

    def _cycle(self, new: list[LocalOp]) -> None:
        messages = self.backend.allgather_messages(marshal.dumps([op.request.wire() for op in new]))
        for rank, message in enumerate(messages):
            for values in marshal.loads(message):
                self.table.add(rank, Request.from_wire(values))
        self._fail_entries_of_departed_ranks()
        for batch in plan(self.table.pop_ready(), self.fusion_threshold):
            self._execute(batch)

    def _fail_entries_of_departed_ranks(self) -> None:
        departed = self.table.entries.get("__shutdown__")
        if departed is None:
            return
        for entry in list(self.table.entries.values()):
            gone = sorted(set(departed.requests) - set(entry.requests))
            if entry is not departed and gone:
                del self.table.entries[entry.name]
                self._finish_local(entry.name, error=CollectiveError(
                    f"'{entry.name}' can never complete: rank{'s' if len(gone) > 1 else ''} "
                    f"{', '.join(map(str, gone))} shut down without submitting it"))

    def _execute(self, batch: list[Entry]) -> None:
        with self._lock:
            ops = [self._inflight.pop(entry.name) for entry in batch]
        if batch[0].error:
            for op in ops:
                op.handle.finish(error=CollectiveError(batch[0].error))
            return
        kind = batch[0].requests[0].kind
        results = _EXECUTORS[kind](self, batch, ops)
        for op, result in zip(ops, results, strict=True):
            op.handle.finish(result)
        if kind == "shutdown":
            self._stopped = True

    def _finish_local(self, name: str, error: BaseException) -> None:
        with self._lock:
            op = self._inflight.pop(name, None)
        if op is not None:
            op.handle.finish(error=error)

    def _check_stalls(self) -> None:
        if self.stall_error_s and (dead := self.table.stalled(self.stall_error_s)):
            raise CollectiveError("stalled: " + _describe_stall(dead, self.world.size, self.stall_error_s))
        fresh = [entry for entry in self.table.stalled(self.stall_warning_s) if not entry.warned]
        for entry in fresh:
            entry.warned = True
        if fresh and self.world.rank == 0:
            sys.stderr.write(f"hvdrun: warning: {_describe_stall(fresh, self.world.size, self.stall_warning_s)}; "
                             "ranks that submit different tensors or hang cause this\n")

    def _fail(self, reason: str) -> None:
        with self._lock:
            self._failure = reason
            ops, self._inflight, self._new = list(self._inflight.values()), {}, []
        for op in ops:
            op.handle.finish(error=CollectiveError(reason))
        try:
            self._report_failure(reason)
        except OSError:
            pass

    def fusion_buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A reusable flat buffer of at least ``count`` elements of ``dtype``."""
        buffer = self._fusion.get(dtype.str)
        if buffer is None or buffer.size < count:
            buffer = self._fusion[dtype.str] = np.empty(count, dtype)
        return buffer[:count]


def _describe_stall(entries: list[Entry], size: int, seconds: float) -> str:
    parts = [f"'{e.name}' missing rank{'s' if len(e.missing(size)) > 1 else ''} "
             f"{', '.join(map(str, e.missing(size)))}" for e in entries]
    return f"{len(entries)} collective(s) waited more than {seconds:g} s for some ranks: {'; '.join(parts)}"


# -- executors: (engine, batch, ops) -> one result per op ---------------------------------------

def _allreduce(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    request = batch[0].requests[0]
    arrays = [op.array for op in ops]
    if len(arrays) == 1:
        buffer = arrays[0].reshape(-1)
    else:
        buffer = engine.fusion_buffer(arrays[0].dtype, sum(a.size for a in arrays))
        offset = 0
        for array in arrays:
            buffer[offset:offset + array.size] = array.reshape(-1)
            offset += array.size
    scale(buffer, request.prescale)
    engine.backend.allreduce(buffer, REDUCE_FNS[request.op])
    scale(buffer, request.postscale / engine.world.size if request.op == AVERAGE else request.postscale)
    if len(arrays) > 1:
        offset = 0
        for array in arrays:
            array.reshape(-1)[...] = buffer[offset:offset + array.size]
            offset += array.size
    return arrays


def _allgather(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    requests, mine = batch[0].requests, ops[0].array
    row_bytes = int(np.prod(mine.shape[1:], dtype=np.int64)) * mine.itemsize
    rows = [requests[rank].shape[0] for rank in range(engine.world.size)]
    out = np.empty((sum(rows),) + mine.shape[1:], mine.dtype)
    start = sum(rows[:engine.world.rank])
    out[start:start + rows[engine.world.rank]] = mine
    engine.backend.allgatherv(as_bytes(out), [r * row_bytes for r in rows])
    return [out]


def _broadcast(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    engine.backend.broadcast(as_bytes(ops[0].array), batch[0].requests[0].root)
    return [ops[0].array]


def _alltoall(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    size, rank, mine = engine.world.size, engine.world.rank, ops[0].array
    row_bytes = int(np.prod(mine.shape[1:], dtype=np.int64)) * mine.itemsize
    splits = [batch[0].requests[r].splits or (batch[0].requests[r].shape[0] // size,) * size for r in range(size)]
    matrix = [[rows * row_bytes for rows in splits[r]] for r in range(size)]
    received = [splits[r][rank] for r in range(size)]
    out = np.empty((sum(received),) + mine.shape[1:], mine.dtype)
    send = as_bytes(mine)[:sum(matrix[rank])]
    engine.backend.alltoallv(send, matrix[rank], matrix, as_bytes(out))
    return [(out, np.array(received, dtype=np.int32))]


def _reducescatter(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    request, size, rank = batch[0].requests[0], engine.world.size, engine.world.rank
    mine = ops[0].array
    buffer = mine.reshape(-1).copy()
    row_elements = int(np.prod(mine.shape[1:], dtype=np.int64))
    row_bounds = chunk_bounds(mine.shape[0], size)
    scale(buffer, request.prescale)
    engine.backend.reducescatter(buffer, REDUCE_FNS[request.op], [(a * row_elements, b * row_elements)
                                                                  for a, b in row_bounds])
    first, last = row_bounds[rank]
    out = buffer[first * row_elements:last * row_elements].reshape((last - first,) + mine.shape[1:]).copy()
    scale(out, request.postscale / size if request.op == AVERAGE else request.postscale)
    return [out]


def _nothing(engine: Engine, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
    return [None] * len(ops)


_EXECUTORS: dict[str, Callable[[Engine, list[Entry], list[LocalOp]], list[Any]]] = {
    "allreduce": _allreduce, "allgather": _allgather, "broadcast": _broadcast, "alltoall": _alltoall,
    "reducescatter": _reducescatter, "barrier": _nothing, "shutdown": _nothing,
}
