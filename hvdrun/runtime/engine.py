"""The engine: a background thread and a progress lock that own all communication of a rank.

Callers :meth:`Engine.submit` a :class:`Request` with its numpy buffer and get a
:class:`Handle`. Communication happens in *cycles*: all-gather of new requests, the ready
entries of the (identical) negotiation table, execution batch by batch (fusing small
allreduces). Only the holder of the progress lock runs cycles. The background thread runs
them for asynchronous work (gradient hooks during backward); a caller blocked in
:meth:`Handle.wait` runs them itself instead of sleeping, as MPI progress works, because a
hand-off to another thread and back costs tens of microseconds. An idle engine sleeps until it
has a new request or a peer starts a cycle. Any error that makes further communication unsafe
(dead peer, hard stall) fails every pending and future op and is relayed to the other ranks
through the rendezvous.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import select
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from hvdrun.errors import CollectiveError
from hvdrun.runtime.backends.base import Backend
from hvdrun.runtime.device import DeviceCollectives
from hvdrun.runtime.executors import EXECUTORS, Handle, LocalOp, reduce_contributions, scale, stand_in
from hvdrun.runtime.lane import CAPACITY as LANE_CAPACITY
from hvdrun.runtime.lane import LANE_OPS, FastLane
from hvdrun.runtime.negotiation import JOIN, Entry, Request, Table, plan
from hvdrun.runtime.timeline import Timeline

_IDLE_TIMEOUT_S = 0.5
_STALL_CHECK_PERIOD_S = 0.25
_NO_DATA = np.empty(0, np.uint8)
# After a caller stopped driving, the background thread waits this long before taking over,
# so a loop of blocking collectives keeps the progress on its own thread.
_TAKEOVER_GRACE_S = 0.002
# A rank blocked this long starts a cycle (at most one per period) in which every rank says what it waits
# for: if every rank of a wait-for cycle is blocked, they all learn it together and fail those ops.
DEADLOCK_PROBE_S = 1.0
# A rank counts as blocked only after waiting this long: a rank that just began to wait may have another
# thread about to submit what its peers wait for. Each rank measures its own wait and announces only
# the waits past this age, so every rank still decides from the same data.
DEADLOCK_CONFIRM_S = 0.5
_SHUTDOWN = "__shutdown__"


class Engine:
    """Runs the collectives of one rank on ``backend``.

    Args:
        backend: executes negotiated collectives.
        fusion_threshold: largest fused allreduce buffer, in bytes.
        stall_warning_s: warn (on rank 0) about ops some ranks have not submitted for this long.
        stall_error_s: fail every rank after this long (0 disables).
        report_failure: tells the other ranks about a fatal error of this rank.
        cycle_time_s: cycle period for backends that cannot wake an idle peer.
        eager_bytes: allreduces up to this size travel inside the negotiation message.
        device: executes ops on device tensors (None: no device path).
    """

    def __init__(self, backend: Backend, fusion_threshold: int, stall_warning_s: float, stall_error_s: float,
                 report_failure: Callable[[str], None], cycle_time_s: float = 0.001,
                 eager_bytes: int = 0, device: DeviceCollectives | None = None, lane: FastLane | None = None) -> None:
        self.backend, self.world, self.device, self.lane = backend, backend.world, device, lane
        self.cycles = 0  # negotiation cycles run on this rank (the fast lane watches it for engine traffic)
        if lane is not None:
            lane.configure(stall_warning_s, stall_error_s)
        self.timeline: Timeline | None = None
        self.fusion_threshold, self.cycle_time_s, self.eager_bytes = fusion_threshold, cycle_time_s, eager_bytes
        self.stall_warning_s, self.stall_error_s = stall_warning_s, stall_error_s
        self._report_failure = report_failure
        self.table = Table(self.world.size)
        self._lock = threading.Lock()
        self._new: list[LocalOp] = []
        self._inflight: dict[str, LocalOp] = {}
        self._taken: set[str] = set()  # names submitted and not yet synchronized (a superset of _inflight's)
        self._waiting: list[tuple[str, float]] = []  # (name, since) that threads of this rank are blocked on
        self._counters: defaultdict[str, int] = defaultdict(int)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._idle_fds = [self._wake_read] + ([lane.bell_fd] if lane is not None and self.world.rank == 0 else [])
        self._sleeping = False
        self._progress = threading.Lock()
        self._waiters = 0  # threads inside drive_until: the background thread stands down
        self._holds = 0  # paused() sections: the background thread starts no cycle
        self._last_driven = 0.0
        self._async_new = False
        self._failure: str | None = None
        self._stopped = False
        self._fusion: dict[str, np.ndarray] = {}
        self._last_cycle = time.monotonic()
        self._last_stall_check = 0.0
        self._thread = threading.Thread(target=self._run, name="hvdrun-engine", daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------------------
    def auto_name(self, kind: str) -> str:
        """``allreduce.noname.7``: ranks that submit unnamed ops in the same order agree on names."""
        with self._lock:
            self._counters[kind] += 1
            return f"{kind}.noname.{self._counters[kind]}"

    def submit(self, request: Request, array: np.ndarray | None = None, wake: bool = True) -> Handle:
        """Queue a collective; raises ValueError for a name submitted and not yet synchronized on this rank.

        Args:
            request: what to run.
            array: its buffer.
            wake: wake the background thread; False when the caller waits on the handle at once.
        """
        return self.submit_many([(request, array)], wake)[0]

    def submit_many(self, items: Sequence[tuple[Request, np.ndarray | None]], wake: bool = True) -> list[Handle]:
        """Queue several collectives at once: they reach the other ranks in the same announcement
        (a grouped op's tensors are negotiated together). Nothing is queued if one name is in flight."""
        buffers = [(request, _NO_DATA if array is None else array) for request, array in items]
        ops = [LocalOp(request, array, Handle(self, request.name), self._eager_payload(request, array))
               for request, array in buffers]
        with self._lock:
            if self._failure is not None:
                raise CollectiveError(self._failure)
            if self._stopped:
                raise CollectiveError("hvdrun has been shut down on this rank")
            names = [op.request.name for op in ops]
            taken = next((name for name in names if name in self._taken), None)
            if taken is not None or len(set(names)) < len(names):
                taken = taken or next(name for name in names if names.count(name) > 1)
                raise ValueError(f"a collective named '{taken}' is already in progress on this rank; "
                                 "names must be unique among collectives in flight")
            for op in ops:
                self._inflight[op.request.name] = op
                self._taken.add(op.request.name)
                self._new.append(op)
                if self.timeline is not None and op.request.kind != "shutdown":
                    self.timeline.negotiate_start(op.request.name, op.request.kind)
            self._async_new = self._async_new or wake
            wake = wake and self._sleeping
        if wake:
            os.write(self._wake_write, b"\0")
        return [op.handle for op in ops]

    def release_name(self, name: str) -> None:
        """The handle of ``name`` was synchronized: the name may be used again on this rank."""
        with self._lock:
            self._taken.discard(name)

    def _eager_payload(self, request: Request, array: np.ndarray) -> bytes | None:
        """The prescaled data of a small allreduce, sent with its announcement."""
        if (request.kind != "allreduce" or request.device != "cpu" or array.nbytes > self.eager_bytes
                or self.world.size == 1 or request.group_size > 1):  # a group goes fused through the ring
            return None
        if request.prescale == 1.0:
            return array.tobytes()
        copy = array.reshape(-1).copy()
        scale(copy, request.prescale)
        return copy.tobytes()

    @contextlib.contextmanager
    def paused(self) -> Iterator[Backend]:
        """A collective: yield the backend for direct calls (byte counts, benchmarks) on every rank.

        The background thread stops starting cycles before the barrier, so once any rank is
        past it, no rank can mistake direct traffic for negotiation.
        """
        with self._lock:
            self._holds += 1
        try:
            self.run(Request(self.auto_name("pause"), "barrier"))
            with self._progress:
                yield self.backend
        finally:
            with self._lock:
                self._holds -= 1

    def run(self, request: Request, array: np.ndarray | None = None) -> Any:
        """Submit and wait on the calling thread: the blocking collectives."""
        return self.submit(request, array, wake=False).wait()

    def lane_allreduce(self, array: np.ndarray, name: str, op: int, prescale: float, postscale: float) -> bool:
        """A blocking allreduce of the whole job on the fast lane (see :mod:`hvdrun.runtime.lane`), in place;
        False when it did not happen there (no lane, too big, something else in flight on this rank, another
        thread in the lane, or the ranks did not all come): the caller then takes the engine's path under the
        same ``name``."""
        lane = self.lane
        # nothing of this rank's in flight or unsynchronized (read without the lock: the lane's verdict, not
        # this check, keeps ranks in step), and no other thread of this rank in the lane
        if (lane is None or not 0 < array.nbytes <= LANE_CAPACITY or op not in LANE_OPS or self._taken
                or self._holds or self._failure is not None or self._stopped or self.timeline is not None
                or JOIN in self.table.entries or not lane.enter()):
            return False
        cycles = self.cycles
        try:
            return lane.allreduce(array, name, op, float(prescale), float(postscale), lambda: self.cycles != cycles)
        except CollectiveError as e:  # a dead peer or a stall: every rank hears of it, as in the engine
            self.fail(str(e))
            raise
        finally:
            lane.leave()

    def stop(self, timeout_s: float) -> None:
        """Negotiate a shutdown with every rank (bounded by ``timeout_s``), then stop the thread."""
        try:
            self.submit(Request(_SHUTDOWN, "shutdown")).wait(timeout_s)
        except (CollectiveError, TimeoutError):
            pass
        with self._lock:
            self._stopped = True
        os.write(self._wake_write, b"\0")
        self._thread.join(timeout_s)
        os.close(self._wake_read)
        os.close(self._wake_write)

    # -- progress: whoever holds self._progress runs cycles ----------------------------------
    def _has_work(self) -> bool:
        return bool(self._new) or self.backend.peer_waiting() or (
            not self.backend.wakeable and time.monotonic() - self._last_cycle >= self.cycle_time_s)

    def _cycle_once(self) -> None:
        self.cycles += 1
        with self._lock:
            new, self._new, self._async_new = self._new, [], False
            now = time.monotonic()
            waiting = [name for name, since in self._waiting if now - since >= DEADLOCK_CONFIRM_S]
        self._cycle(new, waiting)
        self._last_cycle = time.monotonic()

    def drive_until(self, handle: Handle, timeout_s: float | None) -> None:
        """Run cycles on the caller's thread until ``handle`` is done; the background thread stands down."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        started = time.monotonic()
        awaited = (handle.name, started) if handle.name is not None and handle.name != _SHUTDOWN else None
        with self._lock:
            self._waiters += 1
            if awaited is not None:
                self._waiting.append(awaited)
        try:
            while not handle.done() and (deadline is None or time.monotonic() < deadline):
                if not (self._progress.acquire(blocking=False) or self._progress.acquire(timeout=0.001)):
                    continue  # the background thread is finishing a cycle
                try:
                    self._drive_locked(handle, deadline, started)
                finally:
                    self._progress.release()
        finally:
            with self._lock:
                self._waiters -= 1
                self._last_driven = time.monotonic()
                if awaited is not None:
                    self._waiting.remove(awaited)

    def _drive_locked(self, handle: Handle, deadline: float | None, started: float) -> None:
        if self.lane is not None:
            self.lane.engine_wait(True)
        try:
            while not handle.done() and not self._stopped and (deadline is None or time.monotonic() < deadline):
                if self.lane is not None:
                    self.lane.service()  # rank 0 in this path aborts fast-lane attempts peers wait on
                if self._has_work() or self._probe_due(started):
                    self._cycle_once()
                    self.backend.progressed()
                else:
                    self.backend.idle_wait(self._idle_fds)
                    self._check_stalls()
        except CollectiveError as e:
            self.fail(str(e))
        except Exception as e:  # the backend's own error (gloo: a peer closed its connection): every op fails
            self.fail(f"the {self.backend.name} backend failed on rank {self.world.rank}: {e}")
        finally:
            if self.lane is not None:
                self.lane.engine_wait(False)

    def _probe_due(self, waiting_since: float) -> bool:
        """Blocked for a while, and no cycle for as long: ask every rank what it waits for."""
        now = time.monotonic()
        return now - waiting_since >= DEADLOCK_PROBE_S and now - self._last_cycle >= DEADLOCK_PROBE_S

    def _run(self) -> None:
        try:
            while not self._stopped:
                grace = self._last_driven + _TAKEOVER_GRACE_S - time.monotonic()
                if self._holds or ((self._waiters or grace > 0) and not self._async_new):
                    self._sleep_on_wake_pipe(max(grace, _TAKEOVER_GRACE_S))  # a caller drives
                    continue
                if self._has_work():
                    if self._progress.acquire(timeout=_TAKEOVER_GRACE_S):
                        try:  # re-check: a paused() section may have begun while we waited for the lock
                            if not self._holds and self._has_work():
                                self._cycle_once()
                        finally:
                            self._progress.release()
                else:
                    self._idle()
                if self._progress.acquire(blocking=False):
                    try:
                        self._check_stalls()
                    finally:
                        self._progress.release()
        except CollectiveError as e:
            self.fail(str(e))
        except Exception as e:  # a bug: still fail every rank cleanly rather than hang them
            self.fail(f"hvdrun engine crashed on rank {self.world.rank}: {e!r}")

    def _sleep_on_wake_pipe(self, timeout_s: float) -> None:
        with self._lock:
            if self._async_new or self._stopped:
                return
            self._sleeping = True
        try:
            select.select([self._wake_read], [], [], timeout_s)
        finally:
            self._sleeping = False
            self._drain_wake_pipe()

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass

    def _idle(self) -> None:
        with self._lock:
            if self._new or self._stopped:
                return
            self._sleeping = True
        timeout = _IDLE_TIMEOUT_S if self.backend.wakeable else self.cycle_time_s
        try:
            self.backend.wait_for_peer([self._wake_read], timeout)
        finally:
            self._sleeping = False
            self._drain_wake_pipe()

    def _cycle(self, new: list[LocalOp], waiting: list[str]) -> None:
        """One round: every rank's new requests and the names it is blocked on, then whatever became ready."""
        announcement = ([(op.request.wire(), op.payload) for op in new], waiting)
        decoded = [marshal.loads(m) for m in self.backend.allgather_messages(marshal.dumps(announcement))]
        if self.timeline is not None:
            self.timeline.cycle()
        if self._fast_path(new, decoded):
            return
        for rank, (items, _) in enumerate(decoded):
            for values, payload in items:
                self.table.add(rank, Request.from_wire(values), payload)
        self._fail_entries_of_departed_ranks()
        for batch in plan(self.table.pop_ready(), self.fusion_threshold):
            self._execute(batch)
        blocked = {rank: names for rank, (_, names) in enumerate(decoded) if names}
        if blocked:
            self._fail_deadlock(blocked)

    def _fail_deadlock(self, blocked: dict[int, list[str]]) -> None:
        """Fail, on every rank alike, the ops that ranks wait for in a wait-for cycle (identical tables and
        announcements give every rank the same verdict); the next collective works again."""
        stuck = self.table.deadlocked(blocked)
        if not stuck:
            return
        parts = []
        for rank, entries in stuck.items():
            submitted = sorted(e.name for e in self.table.entries.values() if rank in e.requests)
            waits = ", ".join(f"'{e.name}' (which rank{'s' if len(self.table.awaited_ranks(e)) > 1 else ''} "
                              f"{', '.join(map(str, sorted(self.table.awaited_ranks(e))))} never submitted)"
                              for e in entries)
            parts.append(f"rank {rank} waits for {waits} and has submitted {', '.join(submitted) or 'nothing'}")
        error = CollectiveError("deadlock: every rank involved is blocked waiting for a collective that another "
                                "of them has not submitted, so none can complete: " + "; ".join(parts))
        for entries in stuck.values():
            for entry in entries:
                if self.table.entries.pop(entry.name, None) is not None and self.world.rank in entry.requests:
                    self._finish_local(entry.name, error)
                    self._give_back_auto_name(entry.name)

    def _give_back_auto_name(self, name: str) -> None:
        """An unnamed op that the other ranks never submitted fails: its number was never used by them, so
        this rank's next unnamed op of that kind takes it again and the ranks' names stay in step."""
        kind, sep, number = name.rpartition(".noname.")
        with self._lock:
            if sep and number.isdigit() and self._counters.get(kind) == int(number):
                self._counters[kind] -= 1

    def _fast_path(self, new: list[LocalOp], decoded: list[Any]) -> bool:
        """Every rank announced the same single eager allreduce and nothing else is pending: run it now.

        The condition depends only on data every rank has (identical tables and messages), so
        all ranks take this path together; the result is the same as through the table.
        """
        if self.table.entries or len(new) != 1 or new[0].payload is None:
            return False
        mine = new[0].request.wire()
        if any(len(items) != 1 or items[0][0] != mine or items[0][1] is None for items, _ in decoded):
            return False
        op, timeline = new[0], self.timeline
        with self._lock:
            del self._inflight[op.request.name]
        if timeline is not None:
            timeline.execute_start(op.request.name, "allreduce")
        op.handle.finish(reduce_contributions(self.world.size, op.request, [items[0][1] for items, _ in decoded],
                                              op.array))
        if timeline is not None:
            timeline.execute_end(op.request.name, "allreduce")
        return True

    def _fail_entries_of_departed_ranks(self) -> None:
        departed = self.table.entries.get(_SHUTDOWN)
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
        rank = self.world.rank
        with self._lock:  # a joined rank takes part in others' allreduces with zeros
            found = [stand_in(entry, rank) if rank in entry.absent else self._inflight.pop(entry.name, None)
                     for entry in batch]
        if any(op is None for op in found):  # fail() ran on another thread meanwhile: its reason stands
            raise CollectiveError(self._failure or f"'{batch[0].name}' was cancelled on rank {rank}")
        ops = [op for op in found if op is not None]
        if batch[0].error:
            for op in ops:
                op.handle.finish(error=CollectiveError(batch[0].error))
            return
        kind = batch[0].first.kind
        timeline = self.timeline if kind != "shutdown" else None
        if timeline is not None:
            for entry in batch:
                timeline.execute_start(entry.name, kind)
        try:
            results = self._run_executor(kind, batch, ops)
        except BaseException as e:  # the ops left _inflight: finish them here, then fail the engine
            error = e if isinstance(e, CollectiveError) else CollectiveError(f"{kind} '{batch[0].name}' failed: {e!r}")
            for op in ops:
                op.handle.finish(error=error)
            raise error from e
        for op, result in zip(ops, results, strict=True):
            op.handle.finish(result)
            if timeline is not None:
                timeline.execute_end(op.request.name, kind)
        if kind == "shutdown":
            self._stopped = True

    def _run_executor(self, kind: str, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
        if batch[0].first.device == "cpu":
            return EXECUTORS[kind](self, batch, ops)
        if self.device is None:
            raise CollectiveError(f"'{batch[0].name}' is on {batch[0].first.device} but this job has no "
                                  "device backend (torch.distributed nccl)")
        return self.device.execute(kind, batch, [op.array for op in ops])

    def _finish_local(self, name: str, error: BaseException) -> None:
        with self._lock:
            op = self._inflight.pop(name, None)
        if op is not None:
            op.handle.finish(error=error)

    def _check_stalls(self) -> None:
        now = time.monotonic()
        if now - self._last_stall_check < _STALL_CHECK_PERIOD_S:
            return
        self._last_stall_check = now
        if self.stall_error_s and (dead := self.table.stalled(self.stall_error_s)):
            raise CollectiveError("stalled: " + _describe_stall(dead, self.world.size, self.stall_error_s))
        fresh = [entry for entry in self.table.stalled(self.stall_warning_s) if not entry.warned]
        for entry in fresh:
            entry.warned = True
        if fresh and self.world.rank == 0:
            sys.stderr.write(f"hvdrun: warning: {_describe_stall(fresh, self.world.size, self.stall_warning_s)}; "
                             "ranks that submit different tensors or hang cause this\n")

    def fail(self, reason: str) -> None:
        """Fail this rank's engine: every pending op ends with ``reason`` and the other ranks are told."""
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
