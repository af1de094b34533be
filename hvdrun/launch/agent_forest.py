"""hvdrun's end of the host agents (:mod:`hvdrun.launch.remote.host_agent.main`): the tree they form, the facts they
report, and the ranks they run for a job started over SSH.

Every remote host runs one agent under one SSH channel: it answers with the host's facts (it is the probe), then
starts the host's ranks, each under its own guard, and sends their output and exit codes back as tagged lines.
Up to the fan-out (:data:`DEFAULT_FANOUT` hosts, ``HVDRUN_SSH_FANOUT``) hvdrun reaches every host itself; past it,
hvdrun reaches the first ``fanout`` hosts and the agent of host ``i`` reaches hosts ``fanout * (i + 1)`` to
``fanout * (i + 2) - 1``, breadth first (as pdsh and MPICH's hydra do), so that no machine holds more than
``fanout`` handshakes and channels, whatever the host count. Ten hosts, fan-out 3::

    hvdrun -> 0 1 2        0 -> 3 4 5        1 -> 6 7 8        2 -> 9

The default, 32 (``benchmarks/hosts_startup.py``, 2 cores): each host hvdrun reaches itself costs it about 18 ms
of CPU (handshake, channel, the agent's lines), under the GIL; a level of the tree adds about one agent start
and its handshakes, in parallel on every host of the level. At 32 hosts x 2 ranks, flat and two levels start in
the same time (13.5 s and 13.0 s to every rank past ``init()``, the ranks' own start being most of it) while
the tree spares hvdrun 0.3 s of CPU; 1024 hosts flat would cost hvdrun some 18 s of CPU, two levels of 32
about 0.6 s. So up to 32 hosts stay flat (one hop less, one failure domain less), and 1024 take two levels.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hvdrun.envvars import guard_options, remote_env
from hvdrun.launch.launcher import Worker, WorkerSpec
from hvdrun.launch.output import OutputRouter
from hvdrun.launch.remote.connections import SshTarget
from hvdrun.launch.remote.guard import KILL, TERMINATE, forward_byte
from hvdrun.launch.remote.host_agent.channel import AgentChannel
from hvdrun.launch.remote.host_agent.messages import DROP, FACTS, FAILED, LOST, PLAN, SIGNAL, Node, frame, node, subtree
from hvdrun.launch.remote.hostfacts import HostFacts
from hvdrun.launch.remote.lines import Tagged, untag
from hvdrun.ranks import Slot

if TYPE_CHECKING:
    import paramiko

DEFAULT_FANOUT = 32
KILL_CONFIRM_S = 3.0  # after a kill, how long a remote rank has to report its end before it is taken as killed
LOST_STATUS = 255  # like ssh(1) when the connection drops
PlanEntry = tuple[int, list[str], dict[str, str], str]


def agent_tree(count: int, fanout: int) -> dict[int, list[int]]:
    """The hosts each node reaches, for ``count`` hosts: ``-1`` is hvdrun, ``0..count-1`` the hosts, breadth first.

    Raises:
        ValueError: ``fanout`` is below 1.
    """
    if fanout < 1:
        raise ValueError(f"a fan-out of {fanout}: at least 1 host must be reached from each")
    tree = {-1: list(range(min(count, fanout)))}
    for index in range(count):
        first = fanout * (index + 1)
        tree[index] = list(range(first, min(first + fanout, count)))
    return tree


@dataclass(frozen=True)
class AgentHost:
    """A remote host of the job, as its agent is started.

    Attributes:
        name: the host's name in the job.
        target: where and as whom to connect.
        command: the shell command that starts its agent (its Python, in the job's working directory).
        ports: free ports to find there (rank 0's host: 2).
    """

    name: str
    target: SshTarget
    command: str
    ports: int = 0

    def node(self, index: int, children: list[Node]) -> Node:
        """The host's node for the hello frame."""
        target = self.target
        return node(index, self.name, (target.host, target.hostname, target.port, target.user, target.key_files),
                    self.command, self.ports, children)


def tree_nodes(hosts: Sequence[AgentHost], fanout: int) -> list[Node]:
    """The nodes hvdrun reaches itself, every other host beneath one of them (:func:`agent_tree`)."""
    tree = agent_tree(len(hosts), fanout)

    def build(index: int) -> Node:
        return hosts[index].node(index, [build(child) for child in tree[index]])

    return [build(index) for index in tree[-1]]


def rank_env(spec: WorkerSpec) -> dict[str, str]:
    """What a rank on another host gets on top of its login environment: the worker's environment but the
    launcher's login session, and the bin/ of a host's own Python first on ``PATH``."""
    env = remote_env(spec.env)
    if spec.python != sys.executable:  # a host's own Python (YAML python:/venv:): its bin/ first on PATH
        env["PATH"] = f"{os.path.dirname(spec.python)}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


def plan_entry(spec: WorkerSpec, grace_s: float) -> PlanEntry:
    """One rank of a host's plan: ``(rank, guard_argv, env, cwd)``."""
    guard_argv = [f"{grace_s:g}", *guard_options(spec.env), "--", *spec.argv]
    return spec.slot.rank, guard_argv, rank_env(spec), spec.cwd


def lost_note(host: str, lost: dict[str, Any]) -> str:
    """Why a rank on ``host`` ended when the agent channel ``lost`` (a ``lost`` line's value) went away."""
    via, status = str(lost.get("host", host)), int(lost.get("status", -1))
    if via != host:
        return f"lost its SSH connection (through {via}: that host went down, or its agent or connection ended)"
    if status == -1:
        why = f"lost its SSH connection (host {host} down, or sshd killed the session)"
    else:
        last = (str(lost.get("stderr") or "").strip().splitlines() or [""])[-1]
        why = f"lost its SSH connection: hvdrun's agent on {host} ended with exit code {status}" + (
            f" ({last})" if last else "")
    beneath = list(lost.get("beneath") or [])
    if beneath:
        named = ", ".join(beneath[:3]) + (f" and {len(beneath) - 3} more" if len(beneath) > 3 else "")
        why += f"; the ranks of the {len(beneath)} host(s) reached through it went with it: {named}"
    return why


class AgentForest:
    """The agents of the hosts of one :meth:`prepare <hvdrun.launch.launcher.Launcher.prepare>`: those hvdrun reaches
    itself (the roots) and, through them, every other.

    Args:
        roots: the roots' nodes (the others are beneath them).
        clients: hvdrun's connection to each root.
    """

    def __init__(self, roots: Sequence[Node], clients: Sequence[paramiko.SSHClient]) -> None:
        self._changed = threading.Condition()
        self.facts: dict[int, HostFacts] = {}
        self.reached: dict[int, float] = {}  # host index -> when its facts came (wall clock: the job report)
        self.failed: dict[int, dict[str, Any]] = {}
        self._lost: dict[int, dict[str, Any]] = {}
        self._names = {below["index"]: below["name"] for root in roots for below in subtree(root)}
        self._parent = {child["index"]: above["index"] for root in roots for above in subtree(root)
                        for child in above["children"]}
        self._channels = [AgentChannel(root, client, functools.partial(self._lines, i), functools.partial(self._end, i))
                          for i, (root, client) in enumerate(zip(roots, clients, strict=True))]
        self._root_of = {below["index"]: i for i, root in enumerate(roots) for below in subtree(root)}
        self._feeds: dict[int, Callable[[bytes], None]] = {}
        self._ended: set[int] = set()
        self._status: dict[int, int] = {}  # rank -> exit status
        self._notes: dict[int, str] = {}
        self._ranks_on: dict[int, list[int]] = {}  # host index -> its ranks
        self._running: dict[int, set[int]] = {}  # channel -> its ranks that have not ended

    @property
    def hosts(self) -> list[int]:
        """Every host's index."""
        return list(self._names)

    def path(self, index: int) -> list[str]:
        """The hosts through which hvdrun reaches host ``index``, the one it reaches itself first."""
        above = []
        while index in self._parent:
            index = self._parent[index]
            above.append(self._names[index])
        return above[::-1]

    def start(self, job: dict[str, Any], deadline: float) -> None:
        """Start the roots' agents (each starts those beneath it)."""
        for channel in self._channels:
            channel.start(job, deadline)

    def wait(self, deadline: float) -> list[int]:
        """Wait until every host answered (facts) or failed, or ``deadline``; the hosts that did neither."""
        def silent() -> list[int]:
            return [index for index in self._names if index not in self.facts and index not in self.failed]

        with self._changed:
            self._changed.wait_for(lambda: not silent(), max(deadline - time.monotonic(), 0.0))
            return silent()

    def run(self, plans: dict[int, list[PlanEntry]], router: OutputRouter) -> None:
        """Send every host its plan; the ranks' lines go to ``router``."""
        for i, channel in enumerate(self._channels):
            feed = router.multiplexed(f"agent-{channel.top['name']}", self._exited)
            with self._changed:
                self._feeds[i] = feed
                ended = i in self._ended
            if ended:
                feed(b"")
        with self._changed:
            for host, entries in plans.items():
                ranks = [entry[0] for entry in entries]
                self._ranks_on.setdefault(host, []).extend(ranks)
                self._running.setdefault(self._root_of[host], set()).update(ranks)
            for host, lost in self._lost.items():
                self._lose(host, lost)
        for host, entries in plans.items():
            self._send(host, (PLAN, host, entries))

    def _send(self, host: int, message: tuple[Any, ...]) -> None:
        self._channels[self._root_of[host]].send(frame(message))

    def signal(self, host: int, ranks: Sequence[int] | None, code: int) -> None:
        """Write ``code`` to the lifelines of ``ranks`` on ``host`` (None: all), or close them (:data:`DROP`)."""
        self._send(host, (SIGNAL, host, None if ranks is None else list(ranks), code))

    def status(self, rank: int) -> int | None:
        """How ``rank`` ended (negative: by that signal), or None while it runs."""
        return self._status.get(rank)

    def note(self, rank: int) -> str:
        """Why ``rank`` ended, when its status alone does not say (a lost connection)."""
        return self._notes.get(rank, "")

    def settle(self, rank: int, status: int) -> int:
        """Take ``status`` as how ``rank`` ended unless it reported already; how it ended."""
        with self._changed:
            self._ended_rank(rank, status)
            return self._status[rank]

    def close(self) -> None:
        """End every agent (each stops what is left of its ranks) and the connections."""
        for channel in self._channels:
            channel.close()

    def _lines(self, channel: int, lines: list[bytes]) -> None:
        for line in lines:
            tagged = untag(line)
            if tagged is not None and tagged.kind in (FACTS, FAILED, LOST):
                self._host_line(tagged)
            elif (feed := self._feeds.get(channel)) is not None:
                feed(line)

    def _host_line(self, tagged: Tagged) -> None:
        with self._changed:
            if tagged.number not in self._names:
                return
            if tagged.kind == FACTS:
                self.facts[tagged.number] = HostFacts.from_json(tagged.text.decode())
                self.reached[tagged.number] = time.time()
            elif tagged.kind == FAILED:
                self.failed.setdefault(tagged.number, json.loads(tagged.text))
            else:
                self._lost[tagged.number] = json.loads(tagged.text)
                self._lose(tagged.number, self._lost[tagged.number])
            self._changed.notify_all()

    def _lose(self, host: int, lost: dict[str, Any]) -> None:
        """Every rank of ``host`` that has not ended ends with :data:`LOST_STATUS` (its guard stopped it)."""
        for rank in self._ranks_on.get(host, ()):
            if rank not in self._status:
                self._notes[rank] = lost_note(self._names[host], lost)
                self._ended_rank(rank, LOST_STATUS)

    def _exited(self, rank: int, code: int) -> None:
        with self._changed:
            self._ended_rank(rank, code)

    def _ended_rank(self, rank: int, status: int) -> None:
        """(Holding the lock.) ``rank`` ended; its channel's stream is complete once every rank on it ended
        (each rank's exit line comes after its last output line)."""
        self._status.setdefault(rank, status)
        for channel, running in self._running.items():
            if rank in running:
                running.discard(rank)
                if not running and channel in self._feeds:
                    self._feeds[channel](b"")

    def _end(self, channel: int) -> None:
        with self._changed:
            self._ended.add(channel)
            feed = self._feeds.get(channel)
            self._changed.notify_all()
        if feed is not None:
            feed(b"")


class AgentWorker(Worker):
    """A rank that a host agent runs, seen through the agents' channels.

    Args:
        slot: the rank's place in the job.
        forest: the agents.
        host: the index of the rank's host among them.
    """

    def __init__(self, slot: Slot, forest: AgentForest, host: int) -> None:
        super().__init__(slot)
        self._forest, self._host = forest, host
        self._kill_sent_at: float | None = None

    def poll(self) -> int | None:
        status = self._forest.status(self.slot.rank)
        if status is None and self._kill_sent_at is not None and time.monotonic() - self._kill_sent_at > KILL_CONFIRM_S:
            self._forest.signal(self._host, [self.slot.rank], DROP)  # its guard sees EOF and kills what is left
            status = self._forest.settle(self.slot.rank, -signal.SIGKILL)
        return status

    def failure_note(self) -> str:
        return self._forest.note(self.slot.rank)

    def signal_group(self, signum: int) -> None:
        if self._forest.status(self.slot.rank) is not None:
            return  # ended: its guard is gone
        self._forest.signal(self._host, [self.slot.rank], (KILL if signum == signal.SIGKILL else TERMINATE)[0])
        if signum == signal.SIGKILL and self._kill_sent_at is None:
            self._kill_sent_at = time.monotonic()

    def forward_signal(self, signum: int) -> bool:
        """Through the guard's lifeline, as teardown signals go."""
        if self._forest.status(self.slot.rank) is None:
            self._forest.signal(self._host, [self.slot.rank], forward_byte(signum)[0])
        return True
