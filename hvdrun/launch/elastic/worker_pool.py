"""The workers of an elastic job and the hosts they run on (:class:`WorkerPool`), and the job's elastic options.

The pool keeps the workers matched to what discovery (:mod:`hvdrun.launch.elastic.discovery`) offers and
keeps the cool-downs of failed slots and hosts; :class:`hvdrun.launch.elastic.driver.ElasticDriver`
decides when to ask it and what counts as a host update.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hvdrun import envvars
from hvdrun.errors import LaunchError, UsageError
from hvdrun.hosts import Host
from hvdrun.launch.elastic.discovery import DiscoveryError, FixedHosts, ScriptDiscovery
from hvdrun.launch.launcher import Launcher, Worker, WorkerSpec
from hvdrun.launch.output import OutputRouter
from hvdrun.ranks import GpuLayout, Slot, Topology, slot_on

DEFAULT_ELASTIC_TIMEOUT_S = 600.0
DEFAULT_COOLDOWN_S = (60.0, 3600.0)
SLOT, HOST = "slot", "host"
BLACKLIST_SCOPES = (SLOT, HOST)  # what a failed worker takes out for its cool-down (--blacklist-scope)


@dataclass(frozen=True)
class ElasticSettings:
    """The elastic options of ``hvdrun``."""

    min_np: int
    max_np: int | None = None
    timeout_s: float = DEFAULT_ELASTIC_TIMEOUT_S
    reset_limit: int | None = None
    cooldown_s: tuple[float, float] = DEFAULT_COOLDOWN_S
    blacklist_scope: str | None = None  # None: host while discovery offers more than one host, else slot
    discovery_interval_s: float = 1.0


@dataclass
class Member:
    """One started worker."""

    number: int
    host: Host
    index: int  # its slot on the host
    worker: Worker
    started: float
    last_rank: int | None = None
    removed: str = ""  # why the launcher is taking it out ("" while it belongs)
    status: int | None = None


@dataclass
class _Cooldown:
    until: float = 0.0
    strikes: int = 0


class WorkerPool:
    """The workers of an elastic job and the hosts they run on.

    Reaches hosts never used before, starts workers on free slots (hosts in discovery order, up to
    ``max_np``), marks the workers of hosts that left discovery, and cools a slot or a host down after
    a failure (:meth:`blacklist`).
    Its methods report whether the hosts changed; counting that as a host update is the driver's.

    Args:
        launcher: starts workers (local or SSH), prepared for the hosts it may be asked to use.
        router: where the workers' output goes (by worker number).
        discovery: :class:`FixedHosts` or :class:`ScriptDiscovery`.
        settings: min/max workers, timeout, cool-down and its scope.
        spec_for: the :class:`WorkerSpec` of a worker, from its slot and the job-wide variables.
        layout: the GPUs of each host.
        log: where warnings and news go.
    """

    def __init__(self, launcher: Launcher, router: OutputRouter, discovery: FixedHosts | ScriptDiscovery,
                 settings: ElasticSettings, spec_for: Callable[[Slot, dict[str, str]], WorkerSpec],
                 layout: GpuLayout, log: Callable[[str], None]) -> None:
        self.launcher, self.router, self.discovery, self.settings = launcher, router, discovery, settings
        self.spec_for, self.layout, self.log = spec_for, layout, log
        self.members: dict[int, Member] = {}
        self.hosts: tuple[Host, ...] = ()
        self.service_address: tuple[str, int] = ("", 0)  # where workers find the membership service
        self.prepare_timeout_s = 60.0
        self._cooldowns: dict[tuple[str, int | None], _Cooldown] = {}  # (host, slot index or None: all of it)
        self._prepared: set[str] = set()
        self._next_number = 0

    # -- workers ---------------------------------------------------------------------------------
    def live(self) -> list[Member]:
        """Workers still running (on their way out or not)."""
        return [m for m in self.members.values() if m.status is None]

    def serving(self) -> list[Member]:
        """Live workers that belong to the job (not on their way out)."""
        return [m for m in self.live() if not m.removed]

    def is_member(self, number: int) -> bool:
        """Whether worker ``number`` was started for this job."""
        return number in self.members

    def slot(self, host: Host, index: int, number: int) -> Slot:
        """The slot of worker ``number``, the ``index``-th on ``host``."""
        host_index = next((i for i, h in enumerate(self.hosts) if h.name == host.name), 0)
        topology = Topology(rank=number, size=max(self._capacity(), number + 1), local_rank=index,
                            local_size=host.slots, cross_rank=host_index, cross_size=max(len(self.hosts), 1))
        return slot_on(self.layout, topology, host, host_index, max(len(self.hosts), 1))

    def _capacity(self) -> int:
        slots = sum(h.slots for h in self.hosts)
        return min(slots, self.settings.max_np) if self.settings.max_np else slots

    def _start(self, host: Host, index: int) -> None:
        number, self._next_number = self._next_number, self._next_number + 1
        slot = self.slot(host, index, number)
        env = {envvars.ELASTIC_ADDR: self.service_address[0], envvars.ELASTIC_PORT: str(self.service_address[1]),
               envvars.WORKER_ID: str(number)}
        worker = self.launcher.start(self.spec_for(slot, env), self.router)
        self.members[number] = Member(number, host, index, worker, time.monotonic())

    # -- cool-downs ------------------------------------------------------------------------------
    def cool_down(self, host: str, index: int | None = None) -> float:
        """No new worker starts on ``host`` (only on its slot ``index`` when given) for a while; each strike
        doubles the while (up to the maximum). Returns the seconds."""
        low, high = self.settings.cooldown_s
        entry = self._cooldowns.setdefault((host, index), _Cooldown())
        seconds = min(low * 2 ** entry.strikes, high) + random.uniform(0, low * 0.1)
        entry.until, entry.strikes = time.monotonic() + seconds, entry.strikes + 1
        return seconds

    def cooling(self, host: str, index: int | None = None) -> bool:
        """Whether ``host`` as a whole is in a cool-down (or, given ``index``, the host or that slot of it)."""
        now = time.monotonic()
        entries = (self._cooldowns.get((host, key)) for key in {None, index})
        return any(entry is not None and now < entry.until for entry in entries)

    def open_slots(self, host: Host) -> list[int]:
        """The slot indices of ``host`` that no cool-down closes (busy or not)."""
        return [] if self.cooling(host.name) else [i for i in range(host.slots) if not self.cooling(host.name, i)]

    def scope(self) -> str:
        """What a failure takes out now: ``--blacklist-scope`` when given, else the whole host (Horovod's way) while
        discovery's last answer has more than one host, and only the slot while it has one (blacklisting the only
        host would end the job). Asked at each failure, so a job that grows onto more hosts turns to ``host``."""
        if self.settings.blacklist_scope is not None:
            return self.settings.blacklist_scope
        return HOST if len({h.name for h in self.hosts}) > 1 else SLOT

    def blacklist(self, failed: Member) -> str:
        """Cool down what worker ``failed`` takes out (:meth:`scope`): its slot, or its whole host, whose other
        workers then leave at the next round (Horovod's blacklist). Returns the line that says so."""
        host, who = failed.host.name, f"worker {failed.number}"
        if self.scope() == SLOT:
            seconds = self.cool_down(host, failed.index)
            return (f"hvdrun: elastic: slot {failed.index} of host {host} cools down for {seconds:.1f} s after "
                    f"{who} failed there; the host's other slots stay open (--blacklist-scope slot)")
        seconds = self.cool_down(host)
        mates = [m for m in self.serving() if m.host.name == host]
        for mate in mates:
            mate.removed = f"host {host} is blacklisted for {seconds:.1f} s after {who} failed on it"
        leaving = f"; worker(s) {', '.join(str(m.number) for m in mates)} leave at the next round" if mates else ""
        return (f"hvdrun: elastic: host {host} is blacklisted for {seconds:.1f} s after {who} failed on it: no "
                f"worker starts there until then{leaving} (--blacklist-scope host)")

    # -- hosts -----------------------------------------------------------------------------------
    def rediscover(self) -> bool:
        """Ask discovery again and match the workers to its answer; whether that changed the hosts."""
        try:
            hosts = self.discovery.find()
        except DiscoveryError as e:
            self.log(f"hvdrun: elastic: warning: {e}; keeping the last host list")
            return False
        self.prepare(hosts)
        return self.apply(hosts)

    def prepare(self, hosts: Sequence[Host], first: bool = False) -> None:
        """Reach hosts never used before (SSH: connect and probe); a host that fails cools down."""
        fresh = [h for h in hosts if h.name not in self._prepared and not self.cooling(h.name)]
        if not fresh:
            return
        try:
            self.launcher.prepare([self.slot(h, 0, 0) for h in fresh], time.monotonic() + self.prepare_timeout_s)
        except LaunchError as e:
            if first:
                raise
            self.log(f"hvdrun: elastic: warning: {e}; trying these hosts again after a cool-down")
            for host in fresh:
                self.cool_down(host.name)
            return
        self._prepared.update(h.name for h in fresh)

    def apply(self, hosts: tuple[Host, ...]) -> bool:
        """Make the workers match ``hosts``: leavers marked, free slots filled; whether anything changed."""
        self.hosts = hosts
        listed = {h.name: h for h in hosts}
        changed = self._remove_unlisted(listed)
        changed |= self._fill(hosts)
        return changed

    def _remove_unlisted(self, listed: dict[str, Host]) -> bool:
        changed = False
        for member in self.serving():
            host = listed.get(member.host.name)
            if host is None or member.index >= host.slots:
                member.removed = f"host {member.host.name} left {self.discovery.describe()}" if host is None else \
                    f"host {member.host.name} has {host.slots} slot(s) now"
                changed = True
                self.log(f"hvdrun: elastic: worker {member.number} leaves at the next round: {member.removed}")
        return changed

    def _fill(self, hosts: Sequence[Host]) -> bool:
        """Start workers on free slots (hosts in discovery order, up to ``max_np``)."""
        busy = {(m.host.name, m.index) for m in self.live()}
        room = (self.settings.max_np or sys.maxsize) - len(self.serving())
        started = 0
        for host in hosts:
            if host.name not in self._prepared:
                continue
            for index in self.open_slots(host):
                if started >= room:
                    return started > 0
                if (host.name, index) not in busy:
                    try:
                        self._start(host, index)
                    except LaunchError as e:
                        self.log(f"hvdrun: elastic: warning: {e}; host {host.name} cools down")
                        self.cool_down(host.name)
                        break
                    started += 1
        return started > 0


def check_settings(settings: ElasticSettings, launcher: str) -> None:
    """Usage errors of the elastic options, before anything starts."""
    if launcher not in ("local", "ssh"):
        raise UsageError(f"elastic jobs (--min-np/--max-np/--host-discovery-script) run with the local or ssh "
                         f"launcher, not {launcher}: ranks of an mpiexec job cannot change")
    if settings.min_np < 1:
        raise UsageError(f"--min-np must be at least 1, got {settings.min_np}")
    if settings.max_np is not None and settings.max_np < settings.min_np:
        raise UsageError(f"--max-np {settings.max_np} is below --min-np {settings.min_np}")
    low, high = settings.cooldown_s
    if not 0 <= low <= high:
        raise UsageError(f"--blacklist-cooldown-range {low:g} {high:g}: expected 0 <= MIN <= MAX")
    if settings.blacklist_scope is not None and settings.blacklist_scope not in BLACKLIST_SCOPES:
        raise UsageError(f"--blacklist-scope {settings.blacklist_scope!r}: expected one of "
                         f"{', '.join(BLACKLIST_SCOPES)}")
