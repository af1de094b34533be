"""``--warn-before S``: every rank gets a signal S seconds before the allocation ends, once.

The allocation's end comes from its scheduler (:mod:`hvdrun.walltime`); the ranks also get it as
``HVDRUN_DEADLINE`` (``hvd.time_left()``). A :class:`WarningClock` runs beside the job: at the moment it passes the
signal to the workers through whatever supervises them then (the :class:`~hvdrun.launch.supervision.WorkerGroup` of
the current attempt, the elastic driver), holding it while none does (between two restarts). Inside a job of a
chain (``hvdrun qsub --chain``) it notes the warning, and a stop signal that ended the job, in the job's events
file, which decides whether the next job of the chain runs (:mod:`hvdrun.jobs.chain`).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from hvdrun.envvars import DEADLINE, JOB_EVENTS, WARN_BEFORE, WARN_SIGNAL
from hvdrun.errors import JobInterrupted, UsageError
from hvdrun.walltime import Deadline, JobEvents, NoDeadline, find_deadline, format_duration

DEFAULT_WARN_SIGNAL = signal.SIGUSR1
Deliver = Callable[[int], None]
# signals that would break a rank or its guard rather than warn it: the guard waits for its rank through SIGCHLD,
# the others are a program's own faults or stop it
_NOT_A_WARNING = frozenset({signal.SIGCHLD, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL,
                            signal.SIGABRT, signal.SIGTRAP, signal.SIGSYS, signal.SIGPIPE, signal.SIGXFSZ,
                            signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})


@dataclass(frozen=True)
class WalltimeWarning:
    """When the allocation ends, how long before that the ranks are warned, and with which signal."""

    deadline: Deadline
    lead_s: float | None  # None: no --warn-before (the ranks still get the deadline)
    signum: int = DEFAULT_WARN_SIGNAL

    @property
    def warn_at(self) -> float | None:
        """When the ranks are warned (seconds since the epoch); None without ``--warn-before``."""
        return None if self.lead_s is None else self.deadline.ends_at - self.lead_s

    def env(self) -> dict[str, str]:
        """What the ranks are told: ``HVDRUN_DEADLINE`` and, with ``--warn-before``, the lead and the signal."""
        values = {DEADLINE: f"{self.deadline.ends_at:.3f}"}
        if self.lead_s is not None:
            values.update({WARN_BEFORE: f"{self.lead_s:g}", WARN_SIGNAL: str(int(self.signum))})
        return values


def plan_warning(lead_s: float | None, signal_name: str | None, environ: Mapping[str, str],
                 verbose: bool) -> tuple[WalltimeWarning | None, tuple[str, ...]]:
    """The job's warning (None outside an allocation with a known end), and the notes to print: where the end
    was read (``--verbose``), or why there is none (with ``--warn-before`` or ``--verbose``).

    Raises:
        UsageError: ``--warn-signal`` is not a signal hvdrun can pass to the ranks.
    """
    signum = warn_signal_number(signal_name)
    inside = any(environ.get(name) for name in ("PBS_JOBID", "SLURM_JOB_ID", "COBALT_JOBID"))
    if not inside and lead_s is None and not verbose:
        return None, ()
    try:
        deadline = find_deadline(environ)
    except NoDeadline as e:
        said = lead_s is not None or verbose
        return None, ((f"no deadline: {e}; the job runs without a warning before its end",) if said else ())
    warning = WalltimeWarning(deadline, lead_s, signum)
    notes: tuple[str, ...] = (f"the allocation {deadline.describe()}",) if verbose else ()
    if lead_s is not None and deadline.time_left() <= lead_s:
        notes += (f"the allocation ends in {format_duration(max(deadline.time_left(), 0))}, within --warn-before "
                  f"{lead_s:g} s: the ranks are warned ({signal.Signals(signum).name}) as soon as they start, and "
                  "again in hvd.init() where their script has its handler by then",)
    return warning, notes


def warn_signal_number(name: str | None) -> int:
    """``--warn-signal``'s number (SIGUSR1 when not given).

    Raises:
        UsageError: not one signal that hvdrun can pass to the ranks.
    """
    from hvdrun.launch.supervision import parse_signal_list

    if name is None:
        return int(DEFAULT_WARN_SIGNAL)
    found = parse_signal_list(name, "--warn-signal")
    if len(found) != 1:
        raise UsageError(f"--warn-signal {name}: expected one signal, e.g. USR1")
    if found[0] in _NOT_A_WARNING:
        raise UsageError(f"--warn-signal {name}: {signal.Signals(found[0]).name} would break the ranks rather than "
                         "warn them; use USR1, USR2 or another signal a script handles")
    return found[0]


class WarningClock:
    """Passes the warning signal to the job's workers once, at :attr:`WalltimeWarning.warn_at`, through the
    deliverer attached then (:meth:`attached`); one that fires while none is attached waits for the next."""

    def __init__(self, warning: WalltimeWarning, say: Callable[[str], None], events: JobEvents | None = None) -> None:
        self.warning, self.say, self.events = warning, say, events
        self._lock = threading.Lock()
        self._deliver: Deliver | None = None
        self._due = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._wait_and_warn, name="hvdrun-walltime-warning", daemon=True)

    def start(self) -> None:
        """Start watching the clock (nothing to do without ``--warn-before``)."""
        if self.warning.warn_at is not None:
            self._thread.start()

    def stop(self) -> None:
        """Stop watching (the job ended)."""
        self._stopped.set()

    @contextmanager
    def attached(self, deliver: Deliver) -> Iterator[None]:
        """While inside, the warning goes to ``deliver`` (at once if it came due while nothing was attached)."""
        with self._lock:
            self._deliver = deliver
            due, self._due = self._due, False
        if due:
            deliver(self.warning.signum)
        try:
            yield
        finally:
            with self._lock:
                self._deliver = None

    def _wait_and_warn(self) -> None:
        warn_at = self.warning.warn_at
        assert warn_at is not None
        while not self._stopped.wait(min(max(warn_at - time.time(), 0.0), 1.0)):
            if time.time() >= warn_at:  # wall clock, checked again each second: it may have been set meanwhile
                self._warn()
                return

    def _warn(self) -> None:
        name = signal.Signals(self.warning.signum).name
        left = format_duration(max(self.warning.deadline.time_left(), 0.0))
        self.say(f"hvdrun: the allocation ends in {left} (--warn-before {self.warning.lead_s:g}): warning every rank "
                 f"with {name}")
        if self.events is not None:
            self.events.note_warned(name)
        with self._lock:  # delivered (a non-blocking hand-over) or held: never to a supervisor already detached
            self._due = self._deliver is None
            if self._deliver is not None:
                self._deliver(self.warning.signum)


@contextmanager
def warning_clock(warning: WalltimeWarning | None, say: Callable[[str], None],
                  environ: Mapping[str, str]) -> Iterator[WarningClock | None]:
    """The job's :class:`WarningClock` while inside (None without a deadline); a stop signal that ends the job
    is noted in the job's events file (``HVDRUN_JOB_EVENTS``, set by a job of a chain)."""
    events = JobEvents(environ[JOB_EVENTS]) if environ.get(JOB_EVENTS) else None
    clock = WarningClock(warning, say, events) if warning is not None else None
    if clock is not None:
        clock.start()
    try:
        yield clock
    except JobInterrupted as e:
        if events is not None and e.exit_code > 128:
            events.note_stopped(signal.Signals(e.exit_code - 128).name)
        raise
    finally:
        if clock is not None:
            clock.stop()
