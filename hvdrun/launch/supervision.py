"""Supervision of one job's workers (:mod:`hvdrun.launch.launcher` starts them).

A :class:`WorkerGroup` watches the workers of one job: when one fails, every other one gets
SIGTERM and, after a grace period, SIGKILL of its whole process group; the first failure
is reported as the root cause, with a line per group of other ranks saying what they were doing.
SIGINT / SIGTERM to hvdrun tear the job down the same way; SIGUSR1 / SIGUSR2 (``--forward-signals``)
are passed to every rank and the job goes on. ``--idle-timeout`` stops a job whose ranks all fell
silent (exit 124), and a rank that ends without entering ``init()`` while another waits there for it
ends the job at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from hvdrun.errors import (
    RENDEZVOUS_TIMED_OUT,
    RENDEZVOUS_UNREACHED,
    JobInterrupted,
    StartCancelled,
    UsageError,
    WorkerFailed,
)
from hvdrun.interrupts import Wakeup
from hvdrun.launch.launcher import Launcher, Worker, WorkerSpec
from hvdrun.launch.output import OutputRouter
from hvdrun.launch.remote.forkserver import describe_status
from hvdrun.ranks import Slot, format_ranks

_POLL_INTERVAL_S = 0.02
_DRAIN_TIMEOUT_S = 2.0  # for output held open by a process that outlived its rank, in all
# when the first rank to fail failed because of another rank, how long to wait for that root cause
_SETTLE_S = 3.0
_CAUSE_LINES = 3  # the last lines of the failed rank's stderr that a restart compares (WorkerFailed.cause)
DEFAULT_FORWARD_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)  # schedulers' "preemption soon" signals
IDLE_EXIT_CODE = 124  # like timeout(1) and ezpz's idle watchdog
_NOT_FORWARDED = {signal.SIGINT: "stops the job (every rank gets SIGTERM)",
                  signal.SIGTERM: "stops the job (every rank gets SIGTERM)",
                  signal.SIGHUP: "stops the job (every rank gets SIGTERM)",
                  signal.SIGKILL: "cannot be caught by hvdrun", signal.SIGSTOP: "cannot be caught by hvdrun"}


@dataclass(frozen=True)
class Failure:
    """The first worker that failed: the root cause of a job's failure."""

    slot: Slot
    status: int
    seconds_after_start: float
    note: str = ""
    host_known: bool = True  # False: the launcher cannot tell on which host it failed (see Worker.knows_failed_host)

    @property
    def exit_code(self) -> int:
        """The worker's exit code; ``128 + N`` for death by signal N, like a shell."""
        return self.status if self.status > 0 else 128 - self.status

    @property
    def signal(self) -> int | None:
        """The signal that killed the worker (also when a remote guard reported it as ``128 + N``), else None."""
        if self.status < 0:
            return -self.status
        return self.status - 128 if 128 < self.status <= 128 + 64 else None

    def describe(self) -> str:
        """``exited with code 3`` or ``was killed by signal 9 (SIGKILL)``."""
        return self.note or describe_status(self.status)


_HANDLING = "During handling of the above exception, another exception occurred:"


def hvdrun_error(stderr_tail: Sequence[str]) -> str | None:
    """The last error hvdrun reported in a rank's stderr, ``hvdrun: error: ...`` or an uncaught
    ``hvdrun.errors.RendezvousError: ...`` (a traceback's last line), without its prefix; None if there is none.
    Where another exception occurred while one of hvdrun's was being handled, the first one's: the root cause."""
    last = root = current = None
    chained = False  # the next traceback continues this one's chain
    for line in stderr_tail:
        text = line.strip()
        if text.startswith("Traceback (most recent call last):"):
            root = root if chained else None  # a new chain: its root is its own
            current, chained = None, False
        elif text == _HANDLING:
            root, chained = root or current, True
        elif text.startswith("hvdrun: error: "):
            last = current = text.removeprefix("hvdrun: error: ")
        elif text.startswith("hvdrun.errors.") and ": " in text:
            last = current = text.split(": ", 1)[1]
    return root or last


class WorkerGroup:
    """Supervises the workers of one job until all end, one fails, or hvdrun is interrupted.

    Args:
        launcher: starts the workers.
        router: where their output goes.
        idle_timeout_s: stop the job (exit 124) when no rank printed for this long (``--idle-timeout``).
        on_idle: called once before an idle job is stopped (e.g. to print every rank's stack).
        forward_signals: signals to hvdrun that are passed to every rank (``--forward-signals``).
        signal_ranks: passes a signal to every rank's process through the job's control connections, the
            number reached; used where the workers cannot pass it on (mpiexec).
    """

    def __init__(self, launcher: Launcher, router: OutputRouter, idle_timeout_s: float | None = None,
                 on_idle: Callable[[], None] | None = None,
                 forward_signals: Sequence[int] = DEFAULT_FORWARD_SIGNALS,
                 signal_ranks: Callable[[int], int] | None = None) -> None:
        self.launcher, self.router = launcher, router
        self.idle_timeout_s, self.on_idle, self.forward_signals = idle_timeout_s, on_idle, tuple(forward_signals)
        self.signal_ranks = signal_ranks
        self.workers: list[Worker] = []
        self._interrupt: int | None = None
        self._idle = False
        self._forward_pending: list[int] = []
        self._ended: dict[int, tuple[int, float]] = {}  # rank -> (status, seconds after start)
        self._never_joined: list[Failure] = []  # ranks that exited 0 without entering init()
        self._wakeup = Wakeup()  # set by the signal handlers: never a lock there (see Wakeup)

    def run(self, specs: Sequence[WorkerSpec]) -> None:
        """Start every spec and supervise them.

        Raises:
            WorkerFailed: a worker exited non-zero; carries its exit code.
            JobInterrupted: hvdrun got SIGINT or SIGTERM.
        """
        started = time.monotonic()
        with self._stop_signals_handled(), signals_handled(self.forward_signals, self._on_forward_signal):
            try:
                self._start_all(specs)
                self.router.last_output = max(self.router.last_output, time.monotonic())
                failure = self._supervise(started)
            finally:
                self._teardown()
                self._wakeup.close()  # a handler that runs after this finds it closed: a no-op
        self.router.drain(_DRAIN_TIMEOUT_S)
        self._raise_for(failure, len(specs))

    def _start_all(self, specs: Sequence[WorkerSpec]) -> None:
        """Start the workers; a stop signal meanwhile cancels the starts still pending (the launcher's wait for
        them ends at once, the ranks not yet started never start, and those already started are handed over
        to be stopped with the others)."""
        try:
            for worker in self.launcher.start_all(specs, self.router) if self._interrupt is None else ():
                self.workers.append(worker)
        except StartCancelled:
            if self._interrupt is None:
                raise

    def _supervise(self, started: float) -> Failure | None:
        """Wait for the first failure that is a root cause.

        A rank whose runtime says it failed because of another rank (a peer left, an op can never
        complete) is a consequence: the others get up to ``_SETTLE_S`` to show the failure that
        caused it, which is then reported instead.
        """
        running = list(self.workers)
        first: Failure | None = None
        while running and self._interrupt is None:
            self._pass_on_signals(running)
            for worker in list(running):
                status = worker.poll()
                if status is None:
                    continue
                running.remove(worker)
                worker.signal_group(signal.SIGKILL)  # leftovers of a finished worker
                failure = Failure(worker.slot, status, time.monotonic() - started, worker.failure_note(),
                                  worker.knows_failed_host())
                self._ended[worker.slot.rank] = (status, failure.seconds_after_start)
                if status == 0:
                    self._note_if_never_joined(worker, failure)
                elif not self.router.failed_because_of_another_rank(worker.slot.rank):
                    return failure
                else:
                    first = first or failure
            if first is not None and time.monotonic() - started - first.seconds_after_start > _SETTLE_S:
                return first
            stranded = self._stranded(running, started)
            if stranded is not None or self._idle_expired():
                return stranded
            self._wakeup.wait(_POLL_INTERVAL_S)
        return first

    def _note_if_never_joined(self, worker: Worker, ended: Failure) -> None:
        """Remember a rank that exited 0 without entering ``init()`` (its output read to the end first)."""
        if worker.slot.rank in self.router.entered_init:
            return  # the common case, known long before the exit: no wait on the supervision loop
        self.router.failed_because_of_another_rank(worker.slot.rank)  # waits for its output to end
        if worker.slot.rank not in self.router.entered_init:
            self._never_joined.append(ended)

    def _stranded(self, running: Sequence[Worker], started: float) -> Failure | None:
        """A rank that ended without entering ``init()`` while another rank waits there for it: the job can never
        start (the others would wait the whole --start-timeout); that rank is the failure (exit code 1)."""
        waiting = [w.slot.rank for w in running
                   if w.slot.rank in self.router.entered_init and w.slot.rank not in self.router.joined]
        if not self._never_joined or not waiting:
            return None
        gone = self._never_joined[0]
        note = (f"ended (exit code 0) without joining the job (it never called init(); rank(s) "
                f"{format_ranks(waiting)} wait for it there)")
        return Failure(gone.slot, 1, time.monotonic() - started, note, gone.host_known)

    def _idle_expired(self) -> bool:
        """``--idle-timeout``: no rank printed for that long; calls ``on_idle`` once (its errors are reported)."""
        if self.idle_timeout_s is None or time.monotonic() - self.router.last_output < self.idle_timeout_s:
            return False
        self._idle = True
        if self.on_idle is not None:
            try:
                self.on_idle()
            except Exception as e:  # noqa: BLE001 - a broken hook must not keep the job from stopping
                self.router.say(f"hvdrun: warning: the idle hook failed: {type(e).__name__}: {e}")
        return True

    def _on_forward_signal(self, signum: int) -> None:
        self._forward_pending.append(signum)
        self._wakeup.set()

    def pass_signal(self, signum: int) -> None:
        """Pass ``signum`` to every running rank as a forwarded signal (``--warn-before``'s warning); any thread."""
        self._on_forward_signal(signum)

    def _pass_on_signals(self, running: Sequence[Worker]) -> None:
        """Pass the signals hvdrun got since the last look (``--forward-signals``) to every running rank."""
        self._wakeup.clear()
        while self._forward_pending:
            signum = self._forward_pending.pop(0)
            name = signal.Signals(signum).name
            passed = sum(worker.forward_signal(signum) for worker in running)
            reached = self.signal_ranks(signum) if not passed and self.signal_ranks is not None else 0
            if passed:
                self.router.say(f"hvdrun: passed {name} to {passed} running worker{'s' if passed != 1 else ''}; "
                                "the job goes on")
            elif reached:
                self.router.say(f"hvdrun: passed {name} to {reached} rank{'s' if reached != 1 else ''} through the "
                                "job's control connections; the job goes on")
            else:
                self.router.say(f"hvdrun: warning: cannot pass {name} to the ranks yet: their launcher does not "
                                "pass signals, and rank 0's control connections (which do) are up only once the "
                                "ranks have called init(); ignored, the job goes on")

    def _teardown(self) -> None:
        stop_workers(self.workers, self.launcher.grace_s)

    def _raise_for(self, failure: Failure | None, ranks: int) -> None:
        if self._interrupt is not None:
            name = signal.Signals(self._interrupt).name
            stopped = f"stopped all {ranks} workers" if self.workers else "no rank was started"
            raise JobInterrupted(f"received {name}; {stopped}", 128 + self._interrupt)
        if self._idle and failure is None:
            raise JobInterrupted(f"no rank printed for {self.idle_timeout_s:g} s (--idle-timeout); stopped all "
                                 f"{ranks} workers", IDLE_EXIT_CODE)
        if failure is None:
            return
        others = ranks - 1
        tail = self.router.stderr_tail(failure.slot.rank)
        error = hvdrun_error(tail)
        absent = self._still_outside_init(failure, error)
        if absent:
            raise self._never_joined_error(failure, absent, error, ranks)
        lines = [f"rank {failure.slot.rank} on host {failure.slot.hostname} {failure.describe()} "
                 f"{failure.seconds_after_start:.1f} s after start (first failure); stopped the other "
                 f"{others} rank{'s' if others != 1 else ''}"]
        if error:
            lines.append(f"rank {failure.slot.rank}'s error: {error}")
        lines.extend(self._others_summary(failure, ranks))
        if tail:
            lines.append(f"last lines of rank {failure.slot.rank} stderr:")
            lines.extend(f"    {line}" for line in tail)
        raise WorkerFailed("\n".join(lines), failure.exit_code,
                           host=failure.slot.hostname if failure.host_known else None, signal=failure.signal,
                           cause="\n".join([line.strip() for line in tail if line.strip()][-_CAUSE_LINES:]),
                           note=failure.note)

    def _still_outside_init(self, failure: Failure, error: str | None) -> list[Slot]:
        """The ranks to blame when the first failure is a rendezvous that timed out, or a rank that could not reach
        rank 0's: those still running that never entered ``init()`` (the failed rank only waited for them)."""
        if error is None or not error.startswith((RENDEZVOUS_TIMED_OUT, RENDEZVOUS_UNREACHED)):
            return []
        return [worker.slot for worker in self.workers
                if worker.slot.rank != failure.slot.rank and worker.slot.rank not in self.router.entered_init
                and self._ended.get(worker.slot.rank) is None]

    def _never_joined_error(self, failure: Failure, absent: list[Slot], error: str | None,
                            ranks: int) -> WorkerFailed:
        """The job's error when ranks never joined: those ranks first, then what the rank that gave up said."""
        first = absent[0]
        lines = [f"{_ranks_on_hosts(absent)} never joined the job: still running without having called init() when "
                 f"rank {failure.slot.rank} gave up waiting in init() {failure.seconds_after_start:.1f} s after "
                 "start; "
                 f"stopped all {ranks} ranks",
                 f"rank {failure.slot.rank}'s error: {error}"]
        return WorkerFailed("\n".join(lines), failure.exit_code, host=first.hostname if failure.host_known else None,
                            cause=f"never joined: rank {first.rank}", note=failure.note)

    def _others_summary(self, failure: Failure, ranks: int) -> list[str]:
        """``other ranks:`` and one line per group of ranks in the same state (torchrun's "Root Cause" block)."""
        groups: dict[str, list[Slot]] = {}
        covered = {w.slot.rank for w in self.workers}
        for worker in self.workers:
            if worker.slot.rank != failure.slot.rank:
                groups.setdefault(self._what_it_did(worker.slot.rank, failure), []).append(worker.slot)
        missing = ranks - len(covered | {failure.slot.rank})
        lines = [f"    {_ranks_on_hosts(slots)}: {state}" for state, slots in groups.items()]
        if missing > 0:  # mpiexec: one worker for every rank
            lines.append(f"    {missing} other rank{'s' if missing != 1 else ''}: stopped with the job's launcher")
        return ["other ranks:", *lines] if lines else []

    def _what_it_did(self, rank: int, failure: Failure) -> str:
        ended = self._ended.get(rank)
        if ended is None or ended[1] > failure.seconds_after_start:
            if rank in self.router.entered_init and rank not in self.router.joined:
                return "stopped by hvdrun after the failure (were waiting in init() for the others)"
            return "stopped by hvdrun after the failure (were running)"
        status, seconds = ended
        if status == 0:
            return "exited 0 before the failure"
        how = Failure(failure.slot, status, seconds).describe()
        if self.router.failed_because_of_another_rank(rank, 0.0):
            return f"{how}, failing because of another rank"
        return f"also failed: {how}"

    def _stop_signals_handled(self) -> contextlib.AbstractContextManager[None]:
        def on_signal(signum: int) -> None:
            if self._interrupt is None:
                self._interrupt = signum
            self.launcher.cancel_starts()
            self._wakeup.set()

        return stop_signals_handled(on_signal)


def stop_workers(workers: Sequence[Worker], grace_s: float) -> None:
    """SIGTERM every live worker's process group, SIGKILL after ``grace_s``, and reap them all."""
    alive = [w for w in workers if w.poll() is None]
    for worker in alive:
        worker.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(w.poll() is None for w in alive) and time.monotonic() < deadline:
        time.sleep(_POLL_INTERVAL_S)
    for worker in workers:
        worker.signal_group(signal.SIGKILL)
    for worker in workers:
        while worker.poll() is None:
            time.sleep(_POLL_INTERVAL_S)


def parse_signal_list(text: str, option: str = "--forward-signals") -> tuple[int, ...]:
    """``USR1,USR2,CONT`` (names with or without ``SIG``, or numbers; ``none``) as signal numbers, given to
    ``option``.

    Raises:
        UsageError: an unknown signal, or one that stops the job or cannot be caught.
    """
    if text.strip().lower() in ("", "none"):
        return ()
    found: list[int] = []
    for word in (w.strip().upper() for w in text.split(",")):
        name = word if word.startswith("SIG") or word.isdigit() else f"SIG{word}"
        try:
            signum = signal.Signals(int(name)) if name.isdigit() else signal.Signals[name]
        except (KeyError, ValueError):
            raise UsageError(f"{option} {text}: {word!r} is not a signal; expected names or numbers "
                             "like USR1,USR2,CONT") from None
        if signum in _NOT_FORWARDED or signum >= 64:
            why = _NOT_FORWARDED.get(signum, "cannot be passed through the guard (1..63 only)")
            raise UsageError(f"{option} {text}: {signum.name} {why}")
        found.append(int(signum))
    return tuple(dict.fromkeys(found))


def _ranks_on_hosts(slots: Sequence[Slot]) -> str:
    """``ranks 0,2-3 on h1``, ``rank 4 on h1,h2``, ``ranks 0-511 on 64 hosts``."""
    hosts = sorted({slot.hostname for slot in slots})
    where = ",".join(hosts) if len(hosts) <= 3 else f"{len(hosts)} hosts"
    return f"rank{'s' if len(slots) != 1 else ''} {format_ranks([slot.rank for slot in slots])} on {where}"


def stop_signals_handled(on_signal: Callable[[int], None]) -> contextlib.AbstractContextManager[None]:
    """Call ``on_signal(signum)`` for SIGINT, SIGTERM and SIGHUP while inside (main thread only)."""
    return signals_handled((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), on_signal)


@contextlib.contextmanager
def signals_handled(signals: Sequence[int], on_signal: Callable[[int], None]) -> Iterator[None]:
    """Call ``on_signal(signum)`` for each of ``signals`` while inside (main thread only; else nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, lambda signum, _frame: on_signal(signum)) for s in signals}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
