"""The engine: the door to all communication of a rank.

Callers :meth:`Engine.submit` a :class:`Request` with its numpy buffer and get a
:class:`Handle`. Communication happens in *cycles*: all-gather of new requests, the ready
entries of the (identical) negotiation table, execution batch by batch (fusing small
allreduces). Only the holder of the progress lock runs cycles: the background thread for
asynchronous work (gradient hooks during backward), or a caller blocked in :meth:`Handle.wait`,
which runs them itself instead of sleeping, as MPI progress works. An idle engine sleeps until it
has a new request or a peer starts a cycle. Any error that makes further communication unsafe
(dead peer, hard stall) fails every pending and future op and is relayed to the other ranks
through the rendezvous.

Five homes: this module is the caller's side (submission, the blocking paths, the rank's failure);
:mod:`hvdrun.runtime.progress` decides when cycles run and on which thread;
:mod:`hvdrun.runtime.submissions` keeps this rank's ops from submission until they finish;
:mod:`hvdrun.runtime.cycle` is what one cycle does; :mod:`hvdrun.runtime.verdicts` judges the ops
that can never complete (deadlocks, stalls, departed ranks).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from hvdrun.errors import CollectiveError, PeerLostError
from hvdrun.runtime.backends.backend import Backend
from hvdrun.runtime.compiled import UniformSteps
from hvdrun.runtime.cycle import Cycle
from hvdrun.runtime.device import DeviceCollectives
from hvdrun.runtime.forensics import FlightRecorder
from hvdrun.runtime.handles import Handle, LocalOp
from hvdrun.runtime.lane import lane_enabled
from hvdrun.runtime.negotiation import DEFAULT_CACHE_CAPACITY, JOIN, Request, Table
from hvdrun.runtime.progress import ProgressLoop
from hvdrun.runtime.stragglers import StragglerWatch
from hvdrun.runtime.submissions import Submissions
from hvdrun.runtime.timeline import Timeline
from hvdrun.runtime.verdicts import SHUTDOWN, StallWatch

PEER_LOST_GRACE_S = 0.5  # how long a rank that lost a peer's connection waits for the job's root cause


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
        cache_capacity: requests the negotiation remembers and sends as numbers (0: none).

    ``recorder`` keeps this rank's recent collectives; ``on_stall`` (set by the runtime on rank 0) is called
    with the stall check's text when it warns (``fatal`` False) and a second before it fails every rank (True).
    """

    def __init__(self, backend: Backend, fusion_threshold: int, stall_warning_s: float, stall_error_s: float,
                 report_failure: Callable[[str], None], cycle_time_s: float = 0.001,
                 eager_bytes: int = 0, device: DeviceCollectives | None = None,
                 cache_capacity: int = DEFAULT_CACHE_CAPACITY,
                 root_cause: Callable[[], str | None] = lambda: None) -> None:
        self.backend, self.world, self.lane = backend, backend.world, backend.lane
        self.express = lane_enabled()  # blocking allreduces the fast lane does not take: see express_allreduce
        self.express_used = 0  # express cycles that went through at once (tests read it)
        if self.lane is not None:
            self.lane.configure(stall_warning_s, stall_error_s)
        self.cycle_time_s = cycle_time_s
        self._stalls = StallWatch(stall_warning_s, stall_error_s)
        self.recorder = FlightRecorder()
        self.on_stall: Callable[[str, bool], None] | None = None
        self._report_failure = report_failure
        self._root_cause = root_cause
        self.ledger = Submissions(self, self.world.size, eager_bytes,
                                  self.world.local_size if backend.merges else self.world.size)
        self._cycle = Cycle(backend, self.ledger, fusion_threshold, device, cache_capacity)
        self._loop = ProgressLoop(backend, self.ledger, self._cycle, cycle_time_s, self.fail, self._fail_from,
                                  self._check_stalls)
        self._loop.start()

    @property
    def cycles(self) -> int:
        """Negotiation cycles run on this rank (the fast lane watches it for engine traffic)."""
        return self._loop.cycles

    @property
    def fusion_threshold(self) -> int:
        """Largest fused allreduce buffer, in bytes (``HOROVOD_FUSION_THRESHOLD``)."""
        return self._cycle.fusion_threshold

    @property
    def table(self) -> Table:
        """The negotiation table (identical on every rank)."""
        return self._cycle.table

    @property
    def timeline(self) -> Timeline | None:
        """The Chrome-trace timeline being recorded on this rank, if any."""
        return self._cycle.timeline

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        self._cycle.timeline = timeline

    # -- caller side ----------------------------------------------------------------------
    def auto_name(self, kind: str) -> str:
        """``allreduce.noname.7``: ranks that submit unnamed ops in the same order agree on names."""
        return self.ledger.auto_name(kind)

    def submit(self, request: Request, array: np.ndarray | None = None, wake: bool = True) -> Handle:
        """Queue a collective; raises ValueError for a name submitted and not yet finished on this rank.

        Args:
            request: what to run.
            array: its buffer.
            wake: wake the background thread; False when the caller waits on the handle at once.
        """
        return self.submit_many([(request, array)], wake)[0]

    def submit_many(self, items: Sequence[tuple[Request, np.ndarray | None]], wake: bool = True) -> list[Handle]:
        """Queue several collectives at once: they reach the other ranks in the same announcement
        (a grouped op's tensors are negotiated together). Nothing is queued if one name is in flight."""
        timeline = self.timeline
        negotiation_starts: Callable[[LocalOp], None] | None = None
        if timeline is not None:
            def negotiation_starts(op: LocalOp) -> None:
                if op.request.kind != "shutdown":
                    timeline.negotiate_start(op.request.name, op.request.kind)

        ops, wake_now = self.ledger.add(items, wake, negotiation_starts)
        self._record(ops)
        if wake_now:
            self._loop.wake()
        return [op.handle for op in ops]

    def _record(self, ops: Sequence[LocalOp]) -> None:
        """Enter ``ops`` in the flight recorder; each lands when its handle finishes (even before this runs)."""
        for op in ops:
            request = op.request
            if request.kind == "shutdown":
                continue
            nbytes = int(getattr(op.array, "nbytes", 0) or 0)
            flight = op.handle.flight = self.recorder.take_off(request.name, request.kind, nbytes)
            if op.handle.done():
                flight.land()

    def release_name(self, name: str) -> None:
        """The op ``name`` finished on this rank: the name may be used again here once the rank goes on."""
        self.ledger.release_name(name)

    def name_seen(self, name: str, number: int) -> None:
        """The caller took up the end of the op ``name`` (this rank's submission ``number``): the name is free."""
        self.ledger.seen(name, number)

    @contextlib.contextmanager
    def paused(self) -> Iterator[Backend]:
        """A collective: yield the backend for direct calls (byte counts, benchmarks) on every rank.

        The background thread stops starting cycles before the barrier, so once any rank is
        past it, no rank can mistake direct traffic for negotiation.
        """
        with self._loop.held():
            self.run(Request(self.auto_name("pause"), "barrier"))
            with self._loop.progress():
                yield self.backend

    def run(self, request: Request, array: np.ndarray | None = None) -> Any:
        """Submit and wait on the calling thread: the blocking collectives."""
        return self.submit(request, array, wake=False).wait()

    @property
    def compiled(self) -> UniformSteps | None:
        """The compiled module's runner of this rank's steps across hosts (None: the pure-Python path)."""
        return self._cycle.compiled

    @property
    def stragglers(self) -> StragglerWatch | None:
        """Rank 0's straggler watch (None on the other ranks and in a job of one rank)."""
        return self._cycle.stragglers

    def drive_until(self, handle: Handle, timeout_s: float | None) -> None:
        """Run cycles on the caller's thread until ``handle`` is done (:meth:`Handle.wait` calls it); the time it
        takes counts as this rank's wait (``hvdrun top``)."""
        waiting = self.recorder.wait_begins()
        try:
            self._loop.drive_until(handle, timeout_s)
        finally:
            self.recorder.wait_ends(waiting)

    def express_allreduce(self, request: Request, array: np.ndarray) -> bool:
        """A blocking allreduce of a rank with nothing else in flight, as one cycle on the caller's thread without
        the queue, the handle, the progress loop and the table (about half of a small op's Python across hosts).

        The cycle is an ordinary one to the other ranks: it announces ``request`` (with its data when eager), and
        when every rank announced it alone the op runs at once, into ``array`` (True). Otherwise the op joins the
        ledger and the cycles that follow finish it, with every check of the usual path (mismatch, stall,
        deadlock). False: not taken (something else in flight on this rank, another thread driving, the name in
        flight); the caller takes the usual path. The caller's thread waits all along (this rank's wait).
        """
        if not self.express or not self.quiet():
            return False
        if request.kind != "allreduce" or request.group_size > 1 or not self._loop.try_drive():
            return False
        payload = self.ledger.eager_payload(request, array)
        name = request.name
        try:
            if not self.ledger.claim(name):
                return False
            loop = self._loop
            loop.cycle_begins()
            flight = self.recorder.take_off(name, "allreduce", array.nbytes)
            try:
                agreed = self._cycle.express(request, payload, array)
            except Exception as e:  # as in the progress loop: every op of this rank fails, the others are told
                flight.land()
                self._fail_from(e)
                raise CollectiveError(self.ledger.failure or str(e)) from e
            loop.cycle_ended()
            if agreed is None:
                flight.land()
                self.ledger.release_name(name, seen=True)
                self.express_used += 1
                return True
            op = self.ledger.adopt(request, array, payload)
            op.handle.flight = flight
            try:
                self._cycle.apply(agreed)
            except Exception as e:
                self._fail_from(e)
        finally:
            self._loop.stop_driving()  # as after drive_until: the background thread stands down a while
        op.handle.wait()
        return True

    def quiet(self) -> bool:
        """Nothing of this rank in flight, nothing held, no failure, no timeline, no join: the
        fast lane may take a blocking allreduce (:func:`hvdrun.runtime.lane.try_allreduce`)."""
        ledger = self.ledger
        return not (ledger.taken or ledger.unseen or self._loop.holding or ledger.failure is not None or ledger.stopped
                    or self._cycle.holding or self._cycle.timeline is not None or JOIN in self._cycle.table.entries)

    def stop(self, timeout_s: float) -> str | None:
        """Negotiate a shutdown with every rank (bounded by ``timeout_s``), then stop the thread; why the shutdown
        did not complete on every rank (None: it did)."""
        failed = None
        try:
            self.submit(Request(SHUTDOWN, "shutdown")).wait(timeout_s)
        except (CollectiveError, TimeoutError) as e:
            failed = str(e) or "it timed out"
        self._loop.stop(timeout_s)
        return failed

    # -- failure: the progress loop reports here ---------------------------------------------
    def _fail_from(self, error: Exception) -> None:
        """Fail this rank for an error of a cycle: a collective's own, or the backend's (gloo: a peer closed its
        connection)."""
        if isinstance(error, CollectiveError):
            self.fail(self._explain(error))
        else:  # gloo's "connection closed" is a consequence too, as a lost peer is
            self.fail(self._with_root_cause(f"the {self.backend.name} backend failed on rank {self.world.rank}: "
                                            f"{error}"))

    def _check_stalls(self) -> None:
        warning = self._stalls.check(self._cycle.table, self.world.rank)
        if warning:
            sys.stderr.write(warning)
        if self.on_stall is None:
            return
        if warning:
            self.on_stall(warning.strip(), False)
        final = self._stalls.about_to_fail(self._cycle.table)
        if final:
            self.on_stall(final, True)

    def _explain(self, error: CollectiveError) -> str:
        """The failure to report: a lost peer connection is usually a consequence (that peer failed because of
        another rank, and exited), so wait a moment for the control plane's verdict and name it first."""
        return self._with_root_cause(str(error)) if isinstance(error, PeerLostError) else str(error)

    def _with_root_cause(self, here: str) -> str:
        """``here``, after the job's root cause once the control plane names it (waited for a moment)."""
        deadline = time.monotonic() + PEER_LOST_GRACE_S
        while (cause := self._root_cause()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return here if cause is None or cause == here else f"{cause} (here: {here})"

    def fail(self, reason: str) -> None:
        """Fail this rank's engine: every pending op ends with ``reason`` and the other ranks are told."""
        try:  # first: a rank whose user code exits as soon as its op fails has told the others (and its host) why
            self._report_failure(reason)
        except OSError:
            pass
        self.ledger.fail_all(reason)
