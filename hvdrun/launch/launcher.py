"""What every launcher shares: the worker spec, the worker and the launcher interface.

A :class:`Launcher` first prepares the job's hosts (connects, checks them, finds where rank 0
can be reached: :meth:`Launcher.prepare` and :meth:`Launcher.endpoint`), then turns each
:class:`WorkerSpec` into a running :class:`Worker`. :mod:`hvdrun.launch.supervision` watches them.
"""

from __future__ import annotations

import abc
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hvdrun.errors import StartCancelled
from hvdrun.hosts import Host
from hvdrun.launch.output import OutputRouter
from hvdrun.ranks import Slot

GUARD_SCRIPT = str(Path(__file__).with_name("remote") / "guard.py")


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

    def forward_signal(self, signum: int) -> bool:
        """Pass ``signum`` (e.g. SIGUSR1 from a scheduler) to the rank's processes, not to its guard; the job goes
        on. Default: the whole process group. Returns False when this worker cannot pass it on."""
        self.signal_group(signum)
        return True


class Launcher(abc.ABC):
    """Starts workers; one subclass per way of starting them (local, ssh, mpiexec).

    Use: ``prepare(slots, deadline)``, ``endpoint(host of rank 0)``, ``start(spec)`` per rank,
    and ``close()`` at the end, whatever happened.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.starts_cancelled = False  # set by cancel_starts()

    def cancel_starts(self) -> None:
        """A stop was decided: the ranks not started yet never start, and a wait for one's start ends with
        :class:`~hvdrun.errors.StartCancelled`. Safe in a signal handler (it sets a flag, nothing more)."""
        self.starts_cancelled = True

    def prepare(self, slots: Sequence[Slot], deadline: float) -> None:
        """Reach and check every host before any rank starts (monotonic ``deadline``); default: nothing.

        Raises:
            LaunchError: a host cannot run ranks; names the host and the cause.
        """
        return None

    @abc.abstractmethod
    def endpoint(self, host: Host) -> Endpoint:
        """Where rank 0, running on ``host``, can be reached by every rank."""

    def tree_endpoint(self, host: Host) -> tuple[str, int] | None:
        """Where the leader of ``host``, an inner host of the rendezvous tree (:mod:`hvdrun.protocol.tree`), admits
        its children: an address they reach and a port free there; None where this launcher reserved none (then
        every host joins rank 0). Default: None."""
        return None

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

    def reached_at(self) -> dict[str, float]:
        """When each host was reached and answered (host name -> wall clock), for the job report; launchers that
        reach no host of their own (local, mpiexec): none."""
        return {}

    def close(self) -> None:
        """Release connections; called once after the job ended (or failed to start)."""
        return None

    @abc.abstractmethod
    def start(self, spec: WorkerSpec, router: OutputRouter) -> Worker:
        """Start one worker and attach its stdout/stderr to ``router``."""

    def start_all(self, specs: Sequence[WorkerSpec], router: OutputRouter) -> Iterator[Worker]:
        """Start every rank, yielding each worker as soon as it runs (mpiexec yields one for all); after
        :meth:`cancel_starts`, those already started, then :class:`~hvdrun.errors.StartCancelled`."""
        for spec in specs:
            if self.starts_cancelled:
                raise StartCancelled("the job's stop cancelled the ranks' start")
            yield self.start(spec, router)
