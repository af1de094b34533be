"""Restarts of a whole job after a rank fails (``hvdrun --max-restarts N``), routed around the host that failed.

Each attempt is an ordinary job: every rank is started, supervised and, when one fails, all are stopped
(:func:`hvdrun.launch.job.run_job`). Between attempts this module decides three things, each stop or restart
announced in one line:

* **whether to go on**: up to N restarts; an interrupt ends at once; a launch error that names no host (a usage
  or set-up error) is not retried; the program's own error (an exit, not a signal) that comes back with the same
  exit code and last stderr lines (host names and clock times left out) on a different host is the program's,
  not a node's, and ends the retries early;
* **where the next attempt runs**: the hosts of the earlier failures are left out when the job has spare hosts
  (more slots than ``-np``: the allocation's other nodes, or ``--spares K``); without spares the same hosts.
  The launcher probes the chosen hosts first (SSH: connect and run the same probe as before any launch); a host
  that fails is a node fault, left out in turn, and a spare takes its place while spares last;
* **what the ranks are told**: ``HVDRUN_RESTART_COUNT``/``TORCHELASTIC_RESTART_COUNT`` (see
  :class:`hvdrun.envvars.Rendezvous`); output goes to ``--output-dir DIR/attempt.K/rank.N``.

A node fault is a rank killed by a signal, a host that cannot be reached or whose connection was lost, one
whose probe fails, or an mpiexec/srun that exited with no rank saying why (no host to blame: the same hosts
run again). A signal that arrives between two attempts stops the job before the next one starts (exit 128 + N).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from hvdrun.errors import JobInterrupted, LaunchError, WorkerFailed
from hvdrun.hosts import Host
from hvdrun.interrupts import Interrupted, signal_number
from hvdrun.launch.supervision import stop_signals_handled
from hvdrun.ranks import Slot, total_slots


class Plan(Protocol):
    """What a restart reads of a job's plan (:class:`hvdrun.launch.plan.JobPlan`)."""

    @property
    def slots(self) -> tuple[Slot, ...]:
        """Where every rank of this attempt runs."""
        ...

    @property
    def hosts(self) -> tuple[Host, ...]:
        """Every host the job may use, spares included."""
        ...


P = TypeVar("P", bound=Plan)
Probe = Callable[[Sequence[Host]], Mapping[str, str]]  # hosts -> those that failed the probe, each with why


@dataclass(frozen=True)
class Fault:
    """Why one attempt failed, as far as a restart cares."""

    host: str | None  # the host to blame (None: nothing to route around)
    node: bool  # a node's fault: a signal, an unreachable or lost host, a failed probe
    cause: str  # what is compared across attempts: see fault_of
    summary: str  # one line for the announcement


def fault_of(error: WorkerFailed | LaunchError) -> Fault:
    """The :class:`Fault` behind a failed attempt.

    A rank's failure is compared by its exit status (code or signal) and its last stderr lines, without the
    host's name or clock times, so that the same program error on two hosts (also a silent one: an exit code
    and nothing on stderr) compares equal. A launch error is compared by its first line.
    """
    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, LaunchError):
        return Fault(error.host, error.host is not None, first_line, first_line)
    summary = re.sub(r" [\d.]+ s after start .*$", "", first_line)  # "rank 1 on host h2 was killed by signal 9 ..."
    status = f"signal {error.signal}" if error.signal is not None else f"exit code {error.exit_code}"
    lines = without_host_and_times(error.cause, error.host).splitlines()
    return Fault(error.host, error.signal is not None or bool(error.note), "\n".join([status, *lines]), summary)


_HOST_EDGE = r"(?<![\w.-]){}(?![\w-])"
_CLOCK = re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?\b")  # 2026-11-24, 12:03:59.250


def without_host_and_times(text: str, host: str | None) -> str:
    """``text`` with ``host``'s name and dates and clock times replaced by ``<host>`` and ``<time>``."""
    if host:
        text = re.sub(_HOST_EDGE.format(re.escape(host)), "<host>", text)
    return _CLOCK.sub("<time>", text)


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
                      run_attempt: Callable[[P, int], None], log: Callable[[str], None],
                      probe: Probe = lambda hosts: {}) -> None:
    """Run ``plan``, restarting it up to ``max_restarts`` times (see the module docstring).

    Args:
        plan: the job; ``plan.hosts`` are every host it may use, spares included.
        max_restarts: ``--max-restarts``.
        replan: the plan with the same ranks on other hosts.
        run_attempt: runs one attempt of a plan (its number given: 0 is the first).
        log: where the one-line announcements go.
        probe: checks hosts before an attempt starts there; returns those that failed, each name with why
            (the launcher's :meth:`hvdrun.launch.launcher.Launcher.probe_hosts`; by default none is checked).

    Raises:
        WorkerFailed: the last attempt's failure (its exit code is the job's), or an early stop.
        LaunchError: a launch failure that blames no host.
        JobInterrupted: hvdrun was interrupted (during an attempt or between two).
    """
    interrupts: list[int] = []  # SIGINT/SIGTERM/SIGHUP outside an attempt's supervision (it handles its own)

    def interrupted(signum: int) -> None:
        interrupts.append(signum)
        if len(interrupts) == 1:  # a second one must not cut the first one's way out short
            raise Interrupted(signum)

    with stop_signals_handled(interrupted):
        try:
            _attempts(plan, max_restarts, replan, run_attempt, log, probe, interrupts)
        except KeyboardInterrupt as e:
            signum = interrupts[0] if interrupts else signal_number(e)
            raise JobInterrupted(f"received {signal.Signals(signum).name} between two attempts; nothing is running",
                                 128 + signum) from None


def _attempts(plan: P, limit: int, replan: Callable[[tuple[Host, ...]], P], run_attempt: Callable[[P, int], None],
              log: Callable[[str], None], probe: Probe, interrupts: Sequence[int] = ()) -> None:
    attempt_plan = plan
    suspects: list[str] = []
    faults: list[Fault] = []
    for attempt in range(limit + 1):
        if interrupts:  # one came while an attempt's supervision handled it, or while a handler was being swapped
            raise Interrupted(interrupts[0])
        try:
            run_attempt(attempt_plan, attempt)
            return
        except (WorkerFailed, LaunchError) as error:
            fault = fault_of(error)
            why_stop = _why_stop(fault, faults, attempt, limit)
            faults.append(fault)
            if why_stop is not None:
                log(f"hvdrun: not restarting: {why_stop}")
                raise
            if fault.host is not None:
                suspects.append(fault.host)
        previous = attempt_plan
        attempt_plan, broken = _probed_plan(plan, suspects, replan, probe, log, attempt + 2)
        _announce(log, attempt, limit, faults, previous, attempt_plan, broken)


def _why_stop(fault: Fault, earlier: list[Fault], attempt: int, limit: int) -> str | None:
    """Why no restart follows this failure (None: restart)."""
    if attempt == limit:
        return f"attempt {attempt + 1} failed and all {limit} restarts are used (--max-restarts {limit})"
    if fault.host is None and not fault.node:
        return f"the launch failed naming no host to leave out (a set-up error, the same every time): {fault.summary}"
    repeated = _same_error_elsewhere(fault, earlier)
    if repeated is None:
        return None
    lines = fault.cause.splitlines()
    return (f"attempts {repeated + 1} and {attempt + 1} failed with the same error on different hosts "
            f"({earlier[repeated].host}, {fault.host}), so it is the program's, not a node's: {lines[0]}"
            + (f", {lines[-1]}" if len(lines) > 1 else " and nothing on stderr"))


def _same_error_elsewhere(fault: Fault, earlier: list[Fault]) -> int | None:
    """The attempt (index) whose program error this one repeats on another host, if any."""
    if fault.node:
        return None
    return next((index for index, other in enumerate(earlier)
                 if not other.node and other.cause == fault.cause and other.host != fault.host), None)


def _probed_plan(plan: P, suspects: list[str], replan: Callable[[tuple[Host, ...]], P], probe: Probe,
                 log: Callable[[str], None], number: int) -> tuple[P, list[str]]:
    """The plan of attempt ``number`` (1: the first), whose hosts all passed the probe while spares last, and the
    hosts that failed it.

    A host that fails the probe is a node fault: announced in one line, added to ``suspects`` (so left out while
    the others hold every rank), and the plan is made again; each host is probed once.
    """
    passed: set[str] = set()
    broken: list[str] = []
    while True:
        next_plan = replan(hosts_for_attempt(plan, suspects))
        untried = [host for host in _hosts_of(next_plan) if host.name not in passed and host.name not in broken]
        failed = probe(untried) if untried else {}
        if not failed:
            return next_plan, broken
        for host in untried:
            if host.name in failed:
                log(f"hvdrun: before attempt {number}: host {host.name} failed hvdrun's probe, a node fault: "
                    f"{failed[host.name]}")
                suspects.append(host.name)
                broken.append(host.name)
            else:
                passed.add(host.name)


def _hosts_of(plan: Plan) -> list[Host]:
    """The hosts ``plan`` runs ranks on, in rank order."""
    return list(dict.fromkeys(slot.host for slot in plan.slots))


def _announce(log: Callable[[str], None], attempt: int, limit: int, faults: list[Fault], previous: Plan,
              next_plan: Plan, broken: list[str]) -> None:
    fault = faults[-1]
    hosts = [host.name for host in _hosts_of(next_plan)]
    left_out = [name for name in dict.fromkeys([fault.host, *broken]) if name is not None and name not in hosts]
    same = set(hosts) == {host.name for host in _hosts_of(previous)}
    where = "the same hosts" if same else ", ".join(hosts) + (f", without {', '.join(left_out)}" if left_out else "")
    kind = "a node fault" if fault.node else "an error"
    log(f"hvdrun: restart {attempt + 1} of {limit}: attempt {attempt + 1} ended with {kind} ({fault.summary}); "
        f"attempt {attempt + 2} runs on {where}" + (_same_error_here(faults) if same else ""))


def _same_error_here(faults: list[Fault]) -> str:
    """What the restart line adds when a program error repeats on the same host, which the job has no other host to
    try it on: why hvdrun still restarts (it cannot tell the program's error from the node's)."""
    fault = faults[-1]
    again = next((index for index, other in enumerate(faults[:-1])
                  if not fault.node and not other.node and other.cause == fault.cause and other.host == fault.host),
                 None)
    if again is None:
        return ""
    return (f" (the same error as attempt {again + 1}, on the same host: with no other host to run it on, hvdrun "
            "cannot tell the program's error from the node's; --max-restarts 0 while developing)")
