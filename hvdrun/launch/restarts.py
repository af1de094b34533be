"""Restarts of a whole job after a rank fails (``hvdrun --max-restarts N``), routed around the host that failed.

Each attempt is an ordinary job: every rank is started, supervised and, when one fails, all are stopped
(:func:`hvdrun.launch.job.run_job`). Between attempts this module decides three things:

* **whether to go on**: up to N restarts; an interrupt ends at once; a failure that names no host (a usage or
  configuration error) is not retried; the program's own error (an exit, not a signal) that comes back with
  the same last line on a different host is the program's, not a node's, and ends the retries early;
* **where the next attempt runs**: the hosts of the earlier failures are left out when the job has spare hosts
  (more slots than ``-np``: the allocation's other nodes, or ``--spares K``); without spares the same hosts;
* **what the ranks are told**: ``HVDRUN_RESTART_COUNT``/``TORCHELASTIC_RESTART_COUNT`` (see
  :class:`hvdrun.envvars.Rendezvous`); output goes to ``--output-dir DIR/attempt.K/rank.N``.

A node fault is a rank killed by a signal, a host that cannot be reached, or one whose probe fails. A
signal that arrives between two attempts stops the job before the next one starts (exit 128 + N).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from hvdrun.errors import JobInterrupted, LaunchError, WorkerFailed
from hvdrun.hosts import Host
from hvdrun.launch.base import stop_signals_handled
from hvdrun.ranks import Slot, total_slots


class Plan(Protocol):
    """What a restart reads of a job's plan (:class:`hvdrun.launch.job.JobPlan`)."""

    @property
    def slots(self) -> tuple[Slot, ...]:
        """Where every rank of this attempt runs."""
        ...

    @property
    def hosts(self) -> tuple[Host, ...]:
        """Every host the job may use, spares included."""
        ...


P = TypeVar("P", bound=Plan)


@dataclass(frozen=True)
class Fault:
    """Why one attempt failed, as far as a restart cares."""

    host: str | None  # the host to blame (None: nothing to route around)
    node: bool  # a node's fault: a signal, an unreachable host, a failed probe
    cause: str  # what is compared across attempts (the failed rank's last stderr line, or the launch error)
    summary: str  # one line for the announcement


def fault_of(error: WorkerFailed | LaunchError) -> Fault:
    """The :class:`Fault` behind a failed attempt."""
    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, LaunchError):
        return Fault(error.host, True, first_line, first_line)
    summary = re.sub(r" [\d.]+ s after start .*$", "", first_line)  # "rank 1 on host h2 was killed by signal 9 ..."
    return Fault(error.host, error.signal is not None, error.cause or first_line, summary)


def hosts_for_attempt(plan: Plan, suspects: list[str]) -> tuple[Host, ...]:
    """The hosts of the next attempt: the plan's hosts less the suspects (the most recent first kept out) while
    the rest still hold the job's ranks; the plan's own hosts when there is no spare room."""
    needed = len(plan.slots)
    for count in range(len(suspects), 0, -1):
        left_out = set(suspects[-count:])
        candidates = tuple(host for host in plan.hosts if host.name not in left_out)
        if total_slots(candidates) >= needed:
            return candidates
    return tuple(dict.fromkeys(slot.host for slot in plan.slots))


def run_with_restarts(plan: P, max_restarts: int, replan: Callable[[tuple[Host, ...]], P],
                      run_attempt: Callable[[P, int], None], log: Callable[[str], None]) -> None:
    """Run ``plan``, restarting it up to ``max_restarts`` times (see the module docstring).

    Args:
        plan: the job; ``plan.hosts`` are every host it may use, spares included.
        max_restarts: ``--max-restarts``.
        replan: the plan with the same ranks on other hosts.
        run_attempt: runs one attempt of a plan (its number given: 0 is the first).
        log: where the one-line announcements go.

    Raises:
        WorkerFailed: the last attempt's failure (its exit code is the job's), or an early stop.
        LaunchError: a launch failure that blames no host.
        JobInterrupted: hvdrun was interrupted (during an attempt or between two).
    """
    interrupts: list[int] = []  # SIGINT/SIGTERM/SIGHUP outside an attempt's supervision (it handles its own)

    def interrupted(signum: int) -> None:
        interrupts.append(signum)
        raise KeyboardInterrupt

    with stop_signals_handled(interrupted):
        try:
            _attempts(plan, max_restarts, replan, run_attempt, log)
        except KeyboardInterrupt:
            signum = interrupts[0] if interrupts else signal.SIGINT
            raise JobInterrupted(f"received {signal.Signals(signum).name} between two attempts; nothing is running",
                                 128 + signum) from None


def _attempts(plan: P, limit: int, replan: Callable[[tuple[Host, ...]], P], run_attempt: Callable[[P, int], None],
              log: Callable[[str], None]) -> None:
    attempt_plan = plan
    suspects: list[str] = []
    faults: list[Fault] = []
    for attempt in range(limit + 1):
        try:
            run_attempt(attempt_plan, attempt)
            return
        except (WorkerFailed, LaunchError) as error:
            fault = fault_of(error)
            if attempt == limit or fault.host is None:
                raise
            repeated = _same_error_elsewhere(fault, faults)
            faults.append(fault)
            if repeated is not None:
                log(f"hvdrun: not restarting: attempts {repeated + 1} and {attempt + 1} failed with the same error "
                    f"on different hosts ({faults[repeated].host}, {fault.host}), so it is the program's, not a "
                    f"node's: {fault.cause}")
                raise
            suspects.append(fault.host)
        attempt_plan = replan(hosts_for_attempt(plan, suspects))
        _announce(log, attempt, limit, fault, attempt_plan)


def _same_error_elsewhere(fault: Fault, earlier: list[Fault]) -> int | None:
    """The attempt (index) whose program error this one repeats on another host, if any."""
    if fault.node:
        return None
    return next((index for index, other in enumerate(earlier)
                 if not other.node and other.cause == fault.cause and other.host != fault.host), None)


def _announce(log: Callable[[str], None], attempt: int, limit: int, fault: Fault, next_plan: Plan) -> None:
    hosts = list(dict.fromkeys(slot.hostname for slot in next_plan.slots))
    where = "the same hosts" if fault.host in hosts else f"{', '.join(hosts)}, without {fault.host}"
    kind = "a node fault" if fault.node else "an error"
    log(f"hvdrun: restart {attempt + 1} of {limit}: attempt {attempt + 1} ended with {kind} ({fault.summary}); "
        f"attempt {attempt + 2} runs on {where}")
