"""The engine's progress: which thread runs the cycles of a rank, and when.

Only the holder of the progress lock runs cycles. The background thread runs them for asynchronous work
(gradient hooks during backward); a caller blocked in :meth:`Handle.wait` runs them itself instead of
sleeping, as MPI progress works, because a hand-off to another thread and back costs tens of microseconds.
The background thread stands down while a caller drives, and for a short grace after, so a loop of blocking
collectives keeps the progress on its own thread. An idle rank sleeps on a wake pipe (and its backend's
peers) until it has a new request or a peer starts a cycle. A rank blocked for a while starts a probe cycle
in which every rank says what it waits for (deadlock detection).

The engine (:mod:`hvdrun.runtime.engine`) owns this loop: it wakes it on submission, holds it for direct
backend calls, and is told, through callbacks, of the errors that fail the rank and when to check for stalls.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

from hvdrun.errors import CollectiveError
from hvdrun.runtime.backends.backend import Backend
from hvdrun.runtime.cycle import Cycle
from hvdrun.runtime.handles import Handle
from hvdrun.runtime.readiness import readable
from hvdrun.runtime.submissions import Submissions
from hvdrun.runtime.verdicts import SHUTDOWN

_IDLE_TIMEOUT_S = 0.5
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


class ProgressLoop:
    """Runs the cycles of one rank, on the background thread or on a waiting caller's.

    Args:
        backend: the rank's backend (its peers wake an idle loop; a fast lane's bell wakes rank 0).
        ledger: this rank's submissions; its lock guards the loop's counters too.
        cycle: what one cycle does.
        cycle_time_s: cycle period for backends that cannot wake an idle peer.
        fail: fails the rank with a reason (an unexpected error of the background thread).
        fail_from: fails the rank for an error of a cycle.
        check_stalls: warns about (and reports) ops that some ranks have not submitted.
    """

    def __init__(self, backend: Backend, ledger: Submissions, cycle: Cycle, cycle_time_s: float,
                 fail: Callable[[str], None], fail_from: Callable[[Exception], None],
                 check_stalls: Callable[[], None]) -> None:
        self.backend, self.ledger, self.cycle_time_s = backend, ledger, cycle_time_s
        self._cycle, self._lock = cycle, ledger.lock
        self._fail, self._fail_from, self._check_stalls = fail, fail_from, check_stalls
        self.cycles = 0  # negotiation cycles run on this rank (the fast lane watches it for engine traffic)
        self.lane = lane = backend.lane
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._idle_fds = [self._wake_read] + ([lane.bell_fd] if lane and backend.world.rank == 0 else [])
        self._progress = threading.Lock()
        self._waiters = 0  # threads inside drive_until: the background thread stands down
        self._holds = 0  # held() sections: the background thread starts no cycle
        self._last_driven = 0.0
        self._last_cycle = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="hvdrun-engine", daemon=True)

    # -- the engine's side -----------------------------------------------------------------
    def start(self) -> None:
        """Start the background thread."""
        self._thread.start()

    def wake(self) -> None:
        """Wake the background thread (something was submitted for it)."""
        os.write(self._wake_write, b"\0")

    def stop(self, timeout_s: float) -> None:
        """Stop the background thread (waiting at most ``timeout_s``) and close the wake pipe."""
        with self._lock:
            self.ledger.stopped = True
        self.wake()
        self._thread.join(timeout_s)
        os.close(self._wake_read)
        os.close(self._wake_write)

    @property
    def holding(self) -> bool:
        """A :meth:`held` section is open."""
        return bool(self._holds)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A section in which the background thread starts no cycle."""
        with self._lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1

    @contextlib.contextmanager
    def progress(self) -> Iterator[None]:
        """Hold the progress lock: no cycle runs meanwhile."""
        with self._progress:
            yield

    def try_drive(self) -> bool:
        """Take the progress lock if it is free, for a cycle on the caller's thread; :meth:`stop_driving` after."""
        return self._progress.acquire(blocking=False)

    def stop_driving(self) -> None:
        """Give back the lock :meth:`try_drive` took; as after :meth:`drive_until`, the background thread stands
        down a while."""
        self._last_driven = time.monotonic()
        self._progress.release()

    def cycle_begins(self) -> None:
        """One cycle (the progress lock held) is counted as it starts; :meth:`cycle_ended` once it ends well."""
        self.cycles += 1

    def cycle_ended(self) -> None:
        """The cycle :meth:`cycle_begins` counted ended well: the last cycle's time."""
        self._last_cycle = time.monotonic()

    # -- driving: whoever holds self._progress runs cycles --------------------------------------
    def drive_until(self, handle: Handle, timeout_s: float | None) -> None:
        """Run cycles on the caller's thread until ``handle`` is done; the background thread stands down."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        started = time.monotonic()
        awaited = (handle.name, started) if handle.name is not None and handle.name != SHUTDOWN else None
        with self._lock:
            self._waiters += 1
            if awaited is not None:
                self.ledger.waiting.append(awaited)
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
                    self.ledger.waiting.remove(awaited)

    def _drive_locked(self, handle: Handle, deadline: float | None, started: float) -> None:
        lane, ledger = self.lane, self.ledger
        try:
            with lane.engine_path() if lane is not None else contextlib.nullcontext():
                while not handle.done() and not ledger.stopped and (deadline is None or time.monotonic() < deadline):
                    if lane is not None:
                        lane.service()  # rank 0 in this path aborts fast-lane attempts peers wait on
                    if self._has_work() or self._probe_due(started):
                        self._cycle_once()
                        self.backend.progressed()
                    else:
                        self.backend.idle_wait(self._idle_fds)
                        self._check_stalls()
        except Exception as e:
            self._fail_from(e)

    def _has_work(self) -> bool:
        return bool(self.ledger.new) or self.backend.peer_waiting() or self._cycle.flush_due() or (
            not self.backend.wakeable and time.monotonic() - self._last_cycle >= self.cycle_time_s)

    def _cycle_once(self) -> None:
        self.cycle_begins()
        new, waiting = self.ledger.take_new(DEADLOCK_CONFIRM_S)
        self._cycle.run(new, waiting)
        self.cycle_ended()

    def _probe_due(self, waiting_since: float) -> bool:
        """Blocked for a while, and no cycle for as long: ask every rank what it waits for."""
        now = time.monotonic()
        return now - waiting_since >= DEADLOCK_PROBE_S and now - self._last_cycle >= DEADLOCK_PROBE_S

    # -- the background thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self.ledger.stopped:
                grace = self._last_driven + _TAKEOVER_GRACE_S - time.monotonic()
                if self._holds or ((self._waiters or grace > 0) and not self.ledger.async_new):
                    self._sleep_on_wake_pipe(max(grace, _TAKEOVER_GRACE_S))  # a caller drives
                    continue
                if self._has_work():
                    if self._progress.acquire(timeout=_TAKEOVER_GRACE_S):
                        try:  # re-check: a held() section may have begun, or the shutdown completed on a caller's
                            # thread, while we waited for the lock (a cycle after it would wait for peers that left)
                            if not self._holds and not self.ledger.stopped and self._has_work():
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
            self._fail_from(e)
        except Exception as e:  # a bug: still fail every rank cleanly rather than hang them
            self._fail(f"hvdrun engine crashed on rank {self.backend.world.rank}: {e!r}")

    def _sleep_on_wake_pipe(self, timeout_s: float) -> None:
        with self._lock:
            if self.ledger.async_new or self.ledger.stopped:
                return
            self.ledger.sleeping = True
        try:
            readable([self._wake_read], timeout_s)
        finally:
            self.ledger.sleeping = False
            self._drain_wake_pipe()

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass

    def _idle(self) -> None:
        with self._lock:
            if self.ledger.new or self.ledger.stopped:
                return
            self.ledger.sleeping = True
        timeout = _IDLE_TIMEOUT_S if self.backend.wakeable else self.cycle_time_s
        try:
            self.backend.wait_for_peer([self._wake_read], timeout)
        finally:
            self.ledger.sleeping = False
            self._drain_wake_pipe()
