"""What every launcher shares: worker specs, the launcher interface and supervision.

A :class:`Launcher` first prepares the job's hosts (connects, checks them, finds where rank 0
can be reached: :meth:`Launcher.prepare` and :meth:`Launcher.endpoint`), then turns each
:class:`WorkerSpec` into a running :class:`Worker`. A :class:`WorkerGroup` watches the
workers of one job: when one fails, every other one gets
SIGTERM and, after a grace period, SIGKILL of its whole process group; the first failure
is reported as the root cause. SIGINT / SIGTERM to hvdrun tear the job down the same way.
"""

from __future__ import annotations

import abc
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hvdrun.errors import JobInterrupted, WorkerFailed
from hvdrun.hosts import Host
from hvdrun.launch.output import OutputRouter
from hvdrun.ranks import Slot

GUARD_SCRIPT = str(Path(__file__).with_name("remote") / "guard.py")
_POLL_INTERVAL_S = 0.02
_DRAIN_TIMEOUT_S = 5.0
# when the first rank to fail failed because of another rank, how long to wait for that root cause
_SETTLE_S = 3.0
_CAUSE_LINES = 3  # the last lines of the failed rank's stderr that a restart compares (WorkerFailed.cause)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to start one rank.

    Attributes:
        slot: the rank's place in the job.
        argv: the command, already resolved (a ``.py`` script runs under the Python).
        env: the full environment of the worker.
        cwd: working directory.
    """

    slot: Slot
    argv: tuple[str, ...]
    env: dict[str, str] = field(repr=False)
    cwd: str
    python: str = sys.executable


@dataclass(frozen=True)
class Endpoint:
    """Where rank 0 serves the rendezvous: an address every rank can reach and two free ports there."""

    addr: str
    port: int
    master_port: int


class Worker(abc.ABC):
    """A started rank, seen from the launcher."""

    def __init__(self, slot: Slot) -> None:
        self.slot = slot

    def failure_note(self) -> str:
        """Why the worker ended, when its status alone does not say (e.g. a lost SSH connection)."""
        return ""

    def knows_failed_host(self) -> bool:
        """Whether a failure of this worker is its slot's host's (False: the launcher cannot tell where it
        failed, e.g. mpiexec exited and no rank said why)."""
        return True

    @abc.abstractmethod
    def poll(self) -> int | None:
        """The exit status (negative: killed by that signal) or None while running."""

    @abc.abstractmethod
    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the worker's whole process group; no error if it is gone."""


class Launcher(abc.ABC):
    """Starts workers; one subclass per way of starting them (local, ssh, mpiexec).

    Use: ``prepare(slots, deadline)``, ``endpoint(host of rank 0)``, ``start(spec)`` per rank,
    and ``close()`` at the end, whatever happened.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s

    def prepare(self, slots: Sequence[Slot], deadline: float) -> None:
        """Reach and check every host before any rank starts (monotonic ``deadline``); default: nothing.

        Raises:
            LaunchError: a host cannot run ranks; names the host and the cause.
        """
        return None

    @abc.abstractmethod
    def endpoint(self, host: Host) -> Endpoint:
        """Where rank 0, running on ``host``, can be reached by every rank."""

    def cpus(self, host: Host) -> int:
        """Number of CPUs of ``host`` (for OMP_NUM_THREADS)."""
        return os.cpu_count() or 1

    def probe_hosts(self, hosts: Sequence[Host], deadline: float) -> dict[str, str]:
        """Check ``hosts`` as :meth:`prepare` would, by the monotonic ``deadline``, starting no rank (between two
        attempts of ``--max-restarts``). Default: nothing to check (no cheap per-host probe: local, mpiexec, srun).

        Returns:
            The hosts that failed, each name with why (one line); empty when all answered.
        """
        return {}

    def close(self) -> None:
        """Release connections; called once after the job ended (or failed to start)."""
        return None

    @abc.abstractmethod
    def start(self, spec: WorkerSpec, router: OutputRouter) -> Worker:
        """Start one worker and attach its stdout/stderr to ``router``."""

    def start_all(self, specs: Sequence[WorkerSpec], router: OutputRouter) -> Iterator[Worker]:
        """Start every rank, yielding each worker as soon as it runs (mpiexec yields one for all)."""
        for spec in specs:
            yield self.start(spec, router)


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
        if self.note:
            return self.note
        if self.status > 0:
            return f"exited with code {self.status}"
        return f"was killed by signal {-self.status} ({signal.Signals(-self.status).name})"


class WorkerGroup:
    """Supervises the workers of one job until all end, one fails, or hvdrun is interrupted."""

    def __init__(self, launcher: Launcher, router: OutputRouter) -> None:
        self.launcher, self.router = launcher, router
        self.workers: list[Worker] = []
        self._interrupt: int | None = None
        self._wakeup = threading.Event()

    def run(self, specs: Sequence[WorkerSpec]) -> None:
        """Start every spec and supervise them.

        Raises:
            WorkerFailed: a worker exited non-zero; carries its exit code.
            JobInterrupted: hvdrun got SIGINT or SIGTERM.
        """
        started = time.monotonic()
        with self._stop_signals_handled():
            try:
                for worker in self.launcher.start_all(specs, self.router):
                    self.workers.append(worker)
                failure = self._supervise(started)
            finally:
                self._teardown()
        self.router.drain(_DRAIN_TIMEOUT_S)
        self._raise_for(failure, len(specs))

    def _supervise(self, started: float) -> Failure | None:
        """Wait for the first failure that is a root cause.

        A rank whose runtime says it failed because of another rank (a peer left, an op can never
        complete) is a consequence: the others get up to ``_SETTLE_S`` to show the failure that
        caused it, which is then reported instead.
        """
        running = list(self.workers)
        first: Failure | None = None
        while running and self._interrupt is None:
            for worker in list(running):
                status = worker.poll()
                if status is None:
                    continue
                running.remove(worker)
                worker.signal_group(signal.SIGKILL)  # leftovers of a finished worker
                if status != 0:
                    failure = Failure(worker.slot, status, time.monotonic() - started, worker.failure_note(),
                                      worker.knows_failed_host())
                    if not self.router.failed_because_of_another_rank(worker.slot.rank):
                        return failure
                    first = first or failure
            if first is not None and time.monotonic() - started - first.seconds_after_start > _SETTLE_S:
                return first
            self._wakeup.wait(_POLL_INTERVAL_S)
        return first

    def _teardown(self) -> None:
        stop_workers(self.workers, self.launcher.grace_s)

    def _raise_for(self, failure: Failure | None, ranks: int) -> None:
        if self._interrupt is not None:
            name = signal.Signals(self._interrupt).name
            raise JobInterrupted(f"received {name}; stopped all {ranks} workers",
                                 128 + self._interrupt)
        if failure is None:
            return
        others = ranks - 1
        tail = self.router.stderr_tail(failure.slot.rank)
        lines = [f"rank {failure.slot.rank} on host {failure.slot.hostname} {failure.describe()} "
                 f"{failure.seconds_after_start:.1f} s after start (first failure); stopped the other "
                 f"{others} rank{'s' if others != 1 else ''}"]
        if tail:
            lines.append(f"last lines of rank {failure.slot.rank} stderr:")
            lines.extend(f"    {line}" for line in tail)
        raise WorkerFailed("\n".join(lines), failure.exit_code,
                           host=failure.slot.hostname if failure.host_known else None, signal=failure.signal,
                           cause="\n".join([line.strip() for line in tail if line.strip()][-_CAUSE_LINES:]),
                           note=failure.note)

    def _stop_signals_handled(self) -> contextlib.AbstractContextManager[None]:
        def on_signal(signum: int) -> None:
            if self._interrupt is None:
                self._interrupt = signum
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


@contextlib.contextmanager
def stop_signals_handled(on_signal: Callable[[int], None]) -> Iterator[None]:
    """Call ``on_signal(signum)`` for SIGINT, SIGTERM and SIGHUP while inside (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, lambda signum, _frame: on_signal(signum))
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
