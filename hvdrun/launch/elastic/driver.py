"""Elastic jobs: workers come and go while training goes on (Horovod's elastic mode).

The launcher's side, in three parts: :class:`~hvdrun.launch.elastic.worker_pool.WorkerPool` keeps the job's
workers matched to what discovery (:mod:`hvdrun.launch.elastic.discovery`) offers; the *membership service*
(:mod:`hvdrun.launch.elastic.membership_service`) answers the workers that join at every ``init()``
(:mod:`hvdrun.runtime.membership` is the other end); :class:`ElasticDriver` supervises them and
decides each round:

* a worker that dies is gone: its slot (``--blacklist-scope slot``) or its whole host
  (``--blacklist-scope host``, Horovod's blacklist: the host's other workers leave at the next
  round) gets a cool-down during which no new worker starts there; the survivors' collectives fail
  (the runtime's failure detector), they restore their last commit and join the next round;
* free slots in discovery (a new host, a cooled-down one) get new workers, which join the next
  round; the running workers learn of it at their next commit (the *host updates* count);
* a host that leaves discovery: its workers are told to leave when they come to the next round;
* fewer than ``--min-np`` workers for longer than ``--elastic-timeout`` ends the job, naming why;
  so does exceeding ``--reset-limit`` rounds.

A round forms when every live worker has joined: workers of the previous round keep their order
(the new rank 0 has the committed state), joiners come after. Workers are numbered in the order
they started; that number prefixes their output and names their ``--output-dir`` folder.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable

from hvdrun.errors import JobInterrupted, WorkerFailed
from hvdrun.hosts import Host
from hvdrun.interrupts import Wakeup
from hvdrun.launch.elastic.discovery import FixedHosts, ScriptDiscovery
from hvdrun.launch.elastic.membership_service import MembershipService
from hvdrun.launch.elastic.worker_pool import ElasticSettings, Member, WorkerPool
from hvdrun.launch.launcher import Launcher, WorkerSpec
from hvdrun.launch.output import OutputRouter
from hvdrun.launch.supervision import Failure, stop_signals_handled, stop_workers
from hvdrun.ranks import GpuLayout, Slot

_TICK_S = 0.05


class ElasticDriver:
    """Runs one elastic job until it ends: supervises its workers and decides each round.

    Args:
        launcher: starts workers (local or SSH), prepared for the hosts it may be asked to use.
        router: where the workers' output goes (by worker number).
        discovery: :class:`FixedHosts` or :class:`ScriptDiscovery`.
        settings: min/max workers, timeout, reset limit, cool-down.
        spec_for: the :class:`WorkerSpec` of a worker, from its slot and the job-wide variables.
        secret: the job's secret (the membership service authenticates with it).
        layout: the GPUs of each host.
        log: where news of the job go (stderr).
    """

    def __init__(self, launcher: Launcher, router: OutputRouter, discovery: FixedHosts | ScriptDiscovery,
                 settings: ElasticSettings, spec_for: Callable[[Slot, dict[str, str]], WorkerSpec],
                 secret: str, layout: GpuLayout | None = None,
                 log: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True)) -> None:
        self.launcher, self.discovery, self.settings, self.log = launcher, discovery, settings, log
        self.pool = WorkerPool(launcher, router, discovery, settings, spec_for, layout or GpuLayout(), log)
        self._wakeup = Wakeup()  # set by the signal handler: never a lock there (see Wakeup)
        self.service = MembershipService(secret, self.pool.is_member, self._wakeup.set)
        self._failures: list[tuple[Member, Failure]] = []
        self._finished = False  # a worker ended its training (exit 0): no new workers, no new rounds wait
        self._interrupt: int | None = None
        self._below_since: float | None = None
        self._started = time.monotonic()
        self._signals_to_pass: list[int] = []

    # -- the job ---------------------------------------------------------------------------------
    def run(self) -> None:
        """Find the hosts, serve membership, start the workers and supervise until the job ends.

        Raises:
            WorkerFailed: fewer than ``min_np`` workers were left too long, or the reset limit was passed.
            JobInterrupted: hvdrun got SIGINT or SIGTERM.
            UsageError: the discovery script is unusable from the start.
        """
        hosts = self.discovery.find()
        self.pool.prepare(hosts, first=True)
        service_addr = self.launcher.endpoint(Host("localhost", 1)).addr  # this machine, as the hosts reach it
        self.pool.service_address = self.service.start(service_addr)
        with stop_signals_handled(self._on_signal):
            try:
                self.pool.apply(hosts)
                self._supervise()
            finally:
                self.service.stop_admitting()
                stop_workers([m.worker for m in self.pool.members.values()], self.launcher.grace_s)
                self.service.close()
                self._wakeup.close()
        if self._interrupt is not None:
            raise JobInterrupted(f"received {signal.Signals(self._interrupt).name}; stopped every worker",
                                 128 + self._interrupt)

    def pass_signal(self, signum: int) -> None:
        """Pass ``signum`` to every live worker's processes at the next look (``--warn-before``'s warning); any
        thread. The job goes on."""
        self._signals_to_pass.append(signum)
        self._wakeup.set()

    def _pass_signals(self) -> None:
        while self._signals_to_pass:
            signum = self._signals_to_pass.pop(0)
            passed = sum(member.worker.forward_signal(signum) for member in self.pool.live())
            self.log(f"hvdrun: passed {signal.Signals(signum).name} to {passed} worker{'s' if passed != 1 else ''}; "
                     "the job goes on")

    def _on_signal(self, signum: int) -> None:
        if self._interrupt is None:
            self._interrupt = signum
        self._wakeup.set()

    def _supervise(self) -> None:
        last_discovery = time.monotonic()
        while self._interrupt is None:
            self._pass_signals()
            self._reap()
            if self._finished and not self.pool.serving():
                return None  # workers that never held a rank are stopped on the way out
            if time.monotonic() - last_discovery >= self.settings.discovery_interval_s and not self._finished:
                if self.pool.rediscover():
                    self.service.count_update()
                last_discovery = time.monotonic()
            self._check_minimum()
            self._stop_stuck_starters()
            self._form_round()
            self._wakeup.wait(_TICK_S)
            self._wakeup.clear()
        return None

    # -- workers that end ------------------------------------------------------------------------
    def _reap(self) -> None:
        for member in self.pool.live():
            status = member.worker.poll()
            if status is None:
                continue
            member.status = status
            member.worker.signal_group(signal.SIGKILL)  # leftovers of a finished worker
            self.service.drop(member.number)
            if member.removed:
                continue
            if status == 0:
                self._finished = True
                self._dismiss_joiners()
                continue
            self._lost(member, status)

    def _dismiss_joiners(self) -> None:
        """The training has ended: workers started for a round to come (a refilled slot, a new host) leave
        instead of forming a round of their own, which would start from scratch without the committed state."""
        if self.service.round == 0:
            return
        for member in self.pool.serving():
            if member.last_rank is None:
                member.removed = "the training ended before it joined a round"
                self.log(f"hvdrun: elastic: worker {member.number} on host {member.host.name} leaves: "
                         f"{member.removed}")

    def _lost(self, member: Member, status: int) -> None:
        """A worker of the job failed: its slot or host cools down and the others learn of it at their next commit."""
        failure = Failure(self.pool.slot(member.host, member.index, member.number), status,
                          time.monotonic() - self._started, member.worker.failure_note())
        self._failures.append((member, failure))
        cooled = self.pool.blacklist(member)
        self.service.count_update()
        self.log(f"hvdrun: elastic: worker {member.number} (rank {member.last_rank}) on host "
                 f"{member.host.name} {failure.describe()}; {len(self.pool.serving())} worker(s) go on")
        self.log(cooled)

    def _stop_stuck_starters(self) -> None:
        """A new worker that has not joined a round within ``--elastic-timeout`` of its start is stopped
        (it then counts as failed): a round must not wait for it forever."""
        joined = self.service.waiting()
        now = time.monotonic()
        for member in self.pool.serving():
            if member.last_rank is None and member.number not in joined and \
                    now - member.started > self.settings.timeout_s:
                self.log(f"hvdrun: elastic: worker {member.number} on host {member.host.name} did not join within "
                         f"{self.settings.timeout_s:g} s of its start (--elastic-timeout); stopping it")
                member.worker.signal_group(signal.SIGKILL)

    # -- minimum and rounds ----------------------------------------------------------------------
    def _check_minimum(self) -> None:
        serving = len(self.pool.serving())
        if serving >= self.settings.min_np or self._finished:
            self._below_since = None
            return
        now = time.monotonic()
        if self._below_since is None:
            self._below_since = now
            self.log(f"hvdrun: elastic: {serving} worker(s), fewer than --min-np {self.settings.min_np}; waiting "
                     f"up to {self.settings.timeout_s:g} s (--elastic-timeout) for hosts from "
                     f"{self.discovery.describe()}")
        hopeless = serving == 0 and not self.pool.live() and not any(self.pool.open_slots(h) for h in self.pool.hosts)
        if hopeless or now - self._below_since > self.settings.timeout_s:
            self._give_up(serving, hopeless)

    def _give_up(self, serving: int, hopeless: bool) -> None:
        """End the job: too few workers, for too long or with every host cooling down."""
        cause = ""
        if self._failures:
            member, failure = self._failures[-1]
            cause = f"; the last loss: worker {member.number} on host {member.host.name} {failure.describe()}"
        why = f"and every {self.pool.scope()} is cooling down after a failure" if hopeless else \
            f"for more than {self.settings.timeout_s:g} s (--elastic-timeout)"
        raise WorkerFailed(f"elastic job stopped: {serving} worker(s) left, fewer than --min-np "
                           f"{self.settings.min_np}, {why}{cause}", self._last_exit_code())

    def _last_exit_code(self) -> int:
        return self._failures[-1][1].exit_code if self._failures else 1

    def _form_round(self) -> None:
        joins = self.service.waiting()
        self._send_leavers(joins)
        serving = self.pool.serving()
        if not joins or any(m.number not in joins for m in serving):
            return
        if len(serving) < self.settings.min_np and not self._finished:
            return
        limit = self.settings.reset_limit
        if limit is not None and self.service.round > limit:
            raise WorkerFailed(f"elastic job stopped: it needs reset {self.service.round}, and --reset-limit is "
                               f"{limit}", 1)
        order = sorted(serving, key=lambda m: (m.last_rank is None, m.last_rank or 0, m.number))
        if self.service.round > 0 and order[0].last_rank is None:
            raise WorkerFailed("elastic job stopped: no worker of the last round is left, so the committed state "
                               f"went with them; the {len(order)} new worker(s) would start training from scratch",
                               self._last_exit_code())
        for rank, member in enumerate(order):
            member.last_rank = rank
        round_number = self.service.assign([m.number for m in order])
        self.log(f"hvdrun: elastic: round {round_number}: {len(order)} rank(s) on "
                 f"{len({m.host.name for m in order})} host(s)")

    def _send_leavers(self, joins: set[int]) -> None:
        for number in joins:
            member = self.pool.members.get(number)
            if member is not None and member.removed:
                self.service.send_leave(number, member.removed)
