"""Start ranks on other hosts over SSH (paramiko), each under the same guard as a local rank.

Before any rank starts, :meth:`SshLauncher.prepare` starts a host agent on every remote host
(:mod:`hvdrun.launch.agent_forest`): up to the fan-out (``HVDRUN_SSH_FANOUT``, 32) hvdrun connects to each host itself
(host keys verified, see :mod:`hvdrun.launch.remote.connections`), past it the agents of the hosts it reaches
reach the others, a tree. Each agent answers with its host's facts (:mod:`hvdrun.launch.remote.hostfacts`): a
missing working directory, Python or hvdrun, or a missing ``--network-interface``, stops the launch naming the
host, before anything runs anywhere.

A job's ranks (:meth:`SshLauncher.start_all`) start through the agents: one SSH channel per host, one Python
start per host (the agent's fork server forks each rank's guard), each rank under its own guard and lifeline.
The plan, secrets included, travels on the channel's stdin; the ranks' output comes back as tagged lines.

A rank started alone (:meth:`SshLauncher.start`: elastic jobs) gets a channel of its own, with this remote
command (every value shell-quoted)::

    cd -- /work/dir && exec env -- HVDRUN_RANK=3 ... /venv/bin/python -m hvdrun.launch.remote.guard 5 \\
        --signal-as-code --env-from-stdin HVDRUN_SECRET -- /venv/bin/python -u train.py --lr 0.1

The job's secret is not in it (``ps`` on the host would show it to every user): the first line hvdrun
writes to the channel is its value, which the guard reads into the environment.

The SSH channel's stdin is the guard's lifeline, or the agent's, which holds the lifeline of every rank of its
host: ``T``/``K`` signal a rank's process group, and EOF (hvdrun closed the channel, died, or the connection
dropped) makes every guard stop its group by itself, so no rank outlives hvdrun on any host. Ranks on hosts
that are this machine start through the local launcher unless ``everywhere`` asks for SSH to them too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hvdrun import envvars
from hvdrun.envvars import OFF_THE_COMMAND_LINE, guard_options
from hvdrun.errors import LaunchError, StartCancelled, UsageError
from hvdrun.hosts import Host, is_local_host
from hvdrun.launch.agent_forest import (
    DEFAULT_FANOUT,
    KILL_CONFIRM_S,
    LOST_STATUS,
    AgentForest,
    AgentHost,
    AgentWorker,
    PlanEntry,
    lost_note,
    plan_entry,
    rank_env,
    tree_nodes,
)
from hvdrun.launch.hostprobe import explain_probe_failure, module_command, probe_command
from hvdrun.launch.launcher import Endpoint, Launcher, Worker, WorkerSpec
from hvdrun.launch.local import LOOPBACK, LocalLauncher
from hvdrun.launch.output import OutputRouter
from hvdrun.launch.remote.connections import (
    SshOptions,
    SshTarget,
    connect,
    connect_all,
    peer_address,
    resolve_targets,
    run_command,
)
from hvdrun.launch.remote.guard import KILL, TERMINATE, forward_byte
from hvdrun.launch.remote.hostfacts import HostFacts, free_ports, interface_address, route_source_address
from hvdrun.launch.stage_tree import RelayStarter, SshRelays
from hvdrun.protocol.tree import fanout, inner_hosts
from hvdrun.ranks import Slot

if TYPE_CHECKING:
    import paramiko

SESSIONS_PER_CONNECTION = 8  # below sshd's default MaxSessions (10), with the host agent's channel
_LOST_CONNECTION = -1  # paramiko's exit status when the channel closed without one
AGENT_MODULE = "hvdrun.launch.remote.host_agent.main"


@dataclass
class _RemoteHost:
    """A remote host of the job: its agent, what it said, and hvdrun's own connections to it."""

    target: SshTarget
    forest: AgentForest
    index: int  # among the forest's hosts
    clients: list[paramiko.SSHClient] = field(default_factory=list)  # none for a host beneath another's agent
    facts: HostFacts | None = None
    sessions: int = 0

    def next_client(self, ssh: SshOptions) -> paramiko.SSHClient:
        """The connection for the next rank started alone: SESSIONS_PER_CONNECTION ranks share one.

        Raises:
            LaunchError: the host cannot be reached from here.
        """
        wanted = self.sessions // SESSIONS_PER_CONNECTION
        while len(self.clients) <= wanted:
            self.clients.append(connect(self.target, ssh, time.monotonic() + 2 * ssh.connect_timeout_s))
        self.sessions += 1
        return self.clients[wanted]


class SshLauncher(Launcher):
    """Starts ranks over SSH on remote hosts (and locally on this machine's hosts).

    Args:
        grace_s: seconds between SIGTERM and SIGKILL when stopping ranks.
        ssh: how to reach hosts.
        workdir: the working directory of every rank (the launcher's).
        python_for: the Python that runs on a host (the plan's rule); the agent runs under that one.
        network_interface: advertise rank 0 on this interface's address.
        everywhere: use SSH for hosts that are this machine too.
        fanout: hosts hvdrun reaches itself; the agents reach the others (default: ``HVDRUN_SSH_FANOUT``, 32).
        agent_env: exported on top of the login's environment for each host's agent: the variables the ranks'
            interpreters read at their start (``preload.start_up_variables``), so that its fork server, started
            as they are, can fork them from its preload.
    """

    def __init__(self, grace_s: float, ssh: SshOptions, workdir: str, python_for: Callable[[Host], str],
                 network_interface: str | None = None, everywhere: bool = False, fanout: int | None = None,
                 agent_env: Mapping[str, str] | None = None) -> None:
        super().__init__(grace_s)
        self.ssh, self.workdir, self.python_for = ssh, workdir, python_for
        self.agent_env = dict(agent_env or {})
        self.network_interface, self.everywhere = network_interface, everywhere
        self.fanout = fanout if fanout is not None else envvars.env_int(os.environ, envvars.SSH_FANOUT,
                                                                         DEFAULT_FANOUT)
        if self.fanout < 1:
            raise UsageError(f"{envvars.SSH_FANOUT}={self.fanout}: hvdrun must reach at least 1 host itself; "
                             f"give a number like {DEFAULT_FANOUT}")
        self._remote: dict[Host, _RemoteHost] = {}
        self._forests: list[AgentForest] = []
        self._local = LocalLauncher(grace_s)
        self._inner: set[Host] = set()  # hosts that admit others in the rendezvous tree (hvdrun.protocol.tree)

    def is_remote(self, host: Host) -> bool:
        """Ranks on ``host`` start over SSH."""
        return self.everywhere or not is_local_host(host.name)

    def prepare(self, slots: Sequence[Slot], deadline: float) -> None:
        every_host = list(Counter(slot.host for slot in slots))
        self._inner = set(inner_hosts(every_host, fanout(os.environ)))
        hosts = [host for host in every_host if self.is_remote(host)]
        rank0_host = slots[0].host
        if hosts:
            self._reach(hosts, rank0_host, deadline)
        if self.network_interface and not self.is_remote(rank0_host) and self._local_interface_addr() is None:
            raise LaunchError(f"this machine has no IPv4 address on --network-interface '{self.network_interface}'")

    def _reach(self, hosts: list[Host], rank0_host: Host, deadline: float) -> None:
        """Start an agent on every host (a tree past the fan-out) and take their facts.

        Raises:
            LaunchError: a host could not be reached or cannot run ranks; names the first such host.
        """
        targets = resolve_targets(hosts, self.ssh)
        agents = [AgentHost(host.name, target, module_command(self.workdir, self.python_for(host), AGENT_MODULE, [],
                                                          self.agent_env),
                            2 if host == rank0_host else int(host in self._inner))
                  for host, target in zip(hosts, targets, strict=True)]
        roots = tree_nodes(agents, self.fanout)
        clients = connect_all([targets[root["index"]] for root in roots], self.ssh, deadline)
        forest = AgentForest(roots, clients)
        self._forests.append(forest)
        for index, (host, target) in enumerate(zip(hosts, targets, strict=True)):
            self._remote[host] = _RemoteHost(target, forest, index)
        for root, client in zip(roots, clients, strict=True):
            self._remote[hosts[root["index"]]].clients.append(client)
        forest.start(self._job(), deadline)
        silent = forest.wait(deadline)
        # a host that failed (down, refused, no hvdrun) is the cause to name before one that was only slow
        failed_first = sorted(range(len(hosts)), key=lambda index: index not in forest.failed)
        for index in failed_first:
            self._remote[hosts[index]].facts = self._facts(hosts[index], forest, index, index in silent)

    def _job(self) -> dict[str, Any]:
        """What every host's agent shares: the interface to look up, and how to reach the hosts beneath it."""
        ssh = {"identity_file": self.ssh.identity_file, "known_hosts": self.ssh.known_hosts,
               "connect_timeout_s": self.ssh.connect_timeout_s}
        return {"interface": self.network_interface, "ssh": ssh}

    def _facts(self, host: Host, forest: AgentForest, index: int, silent: bool) -> HostFacts:
        """``host``'s facts, or the LaunchError that says why it has none."""
        where = self._remote[host].target.describe()
        via = forest.path(index)
        through = f" (reached through {' -> '.join(via)})" if via else ""
        failed = forest.failed.get(index)
        if failed is not None:
            raise LaunchError(self._failure(host, where, failed) + through, host.name)
        if silent:
            raise LaunchError(f"{where} did not answer hvdrun's probe in time (--start-timeout){through}", host.name)
        facts = forest.facts[index]
        if self.network_interface and facts.interface_addr is None:
            raise LaunchError(f"{where} has no IPv4 address on --network-interface '{self.network_interface}'",
                              host.name)
        return facts

    def _failure(self, host: Host, where: str, failed: dict[str, Any]) -> str:
        """Why a host's agent did not answer, in hvdrun's words."""
        if "connect" in failed:
            return str(failed["connect"])
        if "unreached" in failed:
            return f"{where} was not reached: the host that reaches it, {failed['unreached']}, failed first"
        status = int(failed.get("status", _LOST_CONNECTION))
        if status == _LOST_CONNECTION:
            return f"{where} {lost_note(host.name, {'status': status})} before hvdrun's probe answered"
        return explain_probe_failure(where, status, str(failed.get("stderr", "")), self.workdir, self.python_for(host))

    def _ask(self, host: Host, target: SshTarget, client: paramiko.SSHClient, ports: int,
             deadline: float) -> HostFacts:
        """Run the probe on ``host`` over ``client``; a host that cannot run ranks is a LaunchError naming it."""
        python = self.python_for(host)
        command = probe_command(self.workdir, python, self.network_interface, ports)
        try:
            status, out, err = run_command(client, command, max(deadline - time.monotonic(), 1.0))
        except Exception as e:  # noqa: BLE001 - a timeout or a dropped connection, named below
            raise LaunchError(f"{target.describe()} did not answer hvdrun's probe: {e}", host.name) from e
        if status != 0:
            raise LaunchError(explain_probe_failure(target.describe(), status, err, self.workdir, python), host.name)
        facts = HostFacts.from_json(out.strip().splitlines()[-1])
        if self.network_interface and facts.interface_addr is None:
            raise LaunchError(f"{target.describe()} has no IPv4 address on --network-interface "
                              f"'{self.network_interface}'", host.name)
        return facts

    def probe_hosts(self, hosts: Sequence[Host], deadline: float) -> dict[str, str]:
        """Connect to every remote host of ``hosts`` at once and run the probe there (no agent: no rank starts);
        hosts that are this machine need none."""
        remote = [host for host in dict.fromkeys(hosts) if self.is_remote(host)]
        if not remote:
            return {}
        targets = resolve_targets(remote, self.ssh)
        with ThreadPoolExecutor(max_workers=min(len(remote), 64), thread_name_prefix="hvdrun-probe") as pool:
            answers = list(pool.map(functools.partial(self._probe_one, deadline=deadline), remote, targets))
        return {host.name: why for host, why in zip(remote, answers, strict=True) if why}

    def _probe_one(self, host: Host, target: SshTarget, deadline: float) -> str:
        """Why ``host`` fails the probe on its own connection (closed after); empty when it passes."""
        try:
            client = connect(target, self.ssh, deadline)
        except LaunchError as e:
            return str(e)
        try:
            self._ask(host, target, client, 0, deadline)
            return ""
        except LaunchError as e:
            return str(e)
        finally:
            client.close()

    @contextlib.contextmanager
    def connection(self, host: Host) -> Iterator[paramiko.SSHClient | None]:
        """hvdrun's connection to ``host`` while inside (None: its ranks start on this machine), for work before the
        ranks start (``--stage-env``, :mod:`hvdrun.launch.staging`). A host that :meth:`prepare` reached through
        another host's agent gets one opened now and closed after, so that hvdrun does not keep a connection to
        every host of a tree.

        Raises:
            LaunchError: the host cannot be reached from here.
        """
        remote = self._remote.get(host)
        if remote is None:
            yield None
        elif remote.clients:
            yield remote.clients[0]
        else:
            client = connect(remote.target, self.ssh, time.monotonic() + 2 * self.ssh.connect_timeout_s)
            try:
                yield client
            finally:
                client.close()

    def relays(self, hosts: Sequence[tuple[Host, str]], directory: str) -> RelayStarter:
        """The staging relays of ``hosts`` (``--stage-env``), each started over hvdrun's connection to its host."""
        return SshRelays(hosts, directory, self.connection)

    def callback_address(self, hosts: Sequence[Host]) -> str:
        """This machine's address as ``hosts`` reach it: on ``--network-interface``, else of the route to the first
        of them that is not this machine (loopback when they all are)."""
        towards = next((host for host in hosts if not is_local_host(host.name)), None)
        if towards is None:  # every host is this machine (--launcher ssh to it)
            return LOOPBACK
        return self._local_interface_addr() or route_source_address(towards.name)

    def _local_interface_addr(self) -> str | None:
        return interface_address(self.network_interface) if self.network_interface else None

    def reached_at(self) -> dict[str, float]:
        """When each remote host's agent answered with its facts (wall clock)."""
        return {host.name: remote.forest.reached[remote.index] for host, remote in self._remote.items()
                if remote.index in remote.forest.reached}

    def endpoint(self, host: Host) -> Endpoint:
        return Endpoint(self._address(host), *self._ports(host, 2))

    def tree_endpoint(self, host: Host) -> tuple[str, int] | None:
        """An inner host of the rendezvous tree: the port its probe found free (see :meth:`prepare`)."""
        return self._address(host), self._ports(host, 1)[0]

    def _address(self, host: Host) -> str:
        """Where every rank reaches a listener of ``host``: its ``--network-interface`` address, else the address
        hvdrun reached it at (this machine: the address of its route to the remote hosts)."""
        remote = self._remote.get(host)
        if remote is not None:
            assert remote.facts is not None
            reached = peer_address(remote.clients[0])[1] if remote.clients else remote.facts.address
            return remote.facts.interface_addr or reached or remote.target.hostname
        clients = [remote.clients[0] for remote in self._remote.values() if remote.clients]
        return self._local_interface_addr() or (peer_address(clients[0])[0] if clients else LOOPBACK)

    def _ports(self, host: Host, count: int) -> tuple[int, ...]:
        """``count`` free ports of ``host``: found by its probe, or here on this machine."""
        remote = self._remote.get(host)
        if remote is not None:
            assert remote.facts is not None
            return tuple(remote.facts.ports[:count])
        return free_ports(count)

    def cpus(self, host: Host) -> int:
        remote = self._remote.get(host)
        return remote.facts.cpus if remote is not None and remote.facts is not None else super().cpus(host)

    def start_all(self, specs: Sequence[WorkerSpec], router: OutputRouter) -> Iterator[Worker]:
        """Start this machine's ranks through the local launcher and every remote host's ranks through its agent
        (one plan per host), then yield the workers in ``specs``' order."""
        workers: dict[int, Worker] = {}
        with contextlib.suppress(StartCancelled):  # the stop is seen below
            for worker in self._local.start_all([spec for spec in specs if spec.slot.host not in self._remote],
                                                router):
                workers[worker.slot.rank] = worker
        if self.starts_cancelled:  # before any remote rank starts: the local ones are handed over to be stopped
            yield from workers.values()
            raise StartCancelled("the job's stop cancelled the ranks' start")
        plans: dict[AgentForest, dict[int, list[PlanEntry]]] = {}
        for spec in specs:
            remote = self._remote.get(spec.slot.host)
            if remote is not None:
                plans.setdefault(remote.forest, {}).setdefault(remote.index, []).append(plan_entry(spec, self.grace_s))
                workers[spec.slot.rank] = AgentWorker(spec.slot, remote.forest, remote.index)
        for forest, plan in plans.items():
            forest.run(plan, router)
        for spec in specs:
            yield workers[spec.slot.rank]

    def start(self, spec: WorkerSpec, router: OutputRouter) -> Worker:
        """Start one rank on a channel of its own (a rank started alone, e.g. by an elastic job)."""
        remote = self._remote.get(spec.slot.host)
        if remote is None:
            return self._local.start(spec, router)
        transport = remote.next_client(self.ssh).get_transport()
        try:
            assert transport is not None and transport.is_active()
            channel = transport.open_session(timeout=10)
            channel.exec_command(worker_command(spec, self.grace_s))
            channel.sendall(stdin_preamble(spec))
        except Exception as e:  # noqa: BLE001 - paramiko's channel errors, named below
            raise LaunchError(f"cannot start rank {spec.slot.rank} on {remote.target.describe()}: "
                              f"{e or type(e).__name__}", spec.slot.host.name) from e
        router.attach_reader(spec.slot.rank, "stdout", _reader(channel.recv))
        router.attach_reader(spec.slot.rank, "stderr", _reader(channel.recv_stderr))
        return SshWorker(spec.slot, channel)

    def cancel_starts(self) -> None:
        """As :meth:`Launcher.cancel_starts`, for this machine's ranks too."""
        super().cancel_starts()
        self._local.cancel_starts()

    def close(self) -> None:
        for forest in self._forests:
            forest.close()
        for remote in self._remote.values():
            for client in remote.clients:
                client.close()
        self._local.close()


class SshWorker(Worker):
    """A rank on another host, seen through its SSH channel."""

    def __init__(self, slot: Slot, channel: paramiko.Channel) -> None:
        super().__init__(slot)
        self.channel = channel
        self._status: int | None = None
        self._note = ""
        self._kill_sent_at: float | None = None

    def poll(self) -> int | None:
        if self._status is None:
            if self.channel.exit_status_ready():
                self._status = self._decode(self.channel.recv_exit_status())
            elif self._kill_sent_at is not None and time.monotonic() - self._kill_sent_at > KILL_CONFIRM_S:
                self.channel.close()  # the guard there sees EOF and kills what is left
                self._status = -signal.SIGKILL
        return self._status

    def _decode(self, code: int) -> int:
        if code == _LOST_CONNECTION:
            self._note = lost_note(self.slot.hostname, {"status": code})
            return LOST_STATUS
        if 128 < code <= 128 + 64:  # the guard reports death by signal N as 128 + N
            return 128 - code
        return code

    def failure_note(self) -> str:
        return self._note

    def signal_group(self, signum: int) -> None:
        try:
            self.channel.send(KILL if signum == signal.SIGKILL else TERMINATE)
        except Exception:  # noqa: BLE001,S110 - the channel is gone: nothing left to signal
            pass
        if signum == signal.SIGKILL and self._kill_sent_at is None:
            self._kill_sent_at = time.monotonic()

    def forward_signal(self, signum: int) -> bool:
        """Through the guard's lifeline (the channel's stdin), as teardown signals go."""
        try:
            self.channel.send(forward_byte(signum))
        except Exception:  # noqa: BLE001,S110 - the channel is gone: nothing left to signal
            pass
        return True


def worker_command(spec: WorkerSpec, grace_s: float) -> str:
    """The remote shell command of one rank: its working directory, environment and guarded command."""
    env = {name: value for name, value in rank_env(spec).items() if name not in OFF_THE_COMMAND_LINE}
    from_stdin = [word for name in OFF_THE_COMMAND_LINE if name in spec.env for word in ("--env-from-stdin", name)]
    words = ["env", "--", *(f"{name}={value}" for name, value in sorted(env.items())),
             spec.python, "-m", "hvdrun.launch.remote.guard", f"{grace_s:g}", "--signal-as-code",
             *guard_options(spec.env), *from_stdin, "--", *spec.argv]
    return f"cd -- {shlex.quote(spec.cwd)} && exec {shlex.join(words)}"


def stdin_preamble(spec: WorkerSpec) -> bytes:
    """What hvdrun writes first to a rank's channel: the values the guard reads with ``--env-from-stdin``."""
    return "".join(f"{spec.env[name]}\n" for name in OFF_THE_COMMAND_LINE if name in spec.env).encode()


def _reader(receive: Callable[[int], bytes]) -> Callable[[], bytes]:
    def read() -> bytes:
        try:
            return receive(65536)
        except Exception:  # noqa: BLE001 - a closed channel or transport is EOF for the output pump
            return b""

    return read

