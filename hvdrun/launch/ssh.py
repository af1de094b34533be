"""Start ranks on other hosts over SSH (paramiko), each under the same guard as a local rank.

Before any rank starts, :meth:`SshLauncher.prepare` connects to every remote host at once
(host keys verified, see :mod:`hvdrun.launch.connections`) and runs the probe there
(:mod:`hvdrun.launch.remote.hostfacts`): a missing working directory, Python or hvdrun, or a missing
``--network-interface``, stops the launch naming the host, before anything runs anywhere.

One rank's remote command (every value shell-quoted)::

    cd -- /work/dir && exec env -- HVDRUN_RANK=3 ... /venv/bin/python -m hvdrun.launch.remote.guard 5 \\
        --signal-as-code --env-from-stdin HVDRUN_SECRET -- /venv/bin/python -u train.py --lr 0.1

The job's secret is not in it (``ps`` on the host would show it to every user): the first line hvdrun
writes to the channel is its value, which the guard reads into the environment.

The SSH channel's stdin is the guard's lifeline: ``T``/``K`` on it signal the rank's process
group, and EOF (hvdrun closed the channel, died, or the connection dropped) makes the guard
stop the group by itself, so no rank outlives hvdrun on any host. Ranks on hosts that are this
machine start through the local launcher unless ``everywhere`` asks for SSH to them too.
"""

from __future__ import annotations

import functools
import math
import os
import shlex
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hvdrun.envvars import OFF_THE_COMMAND_LINE, guard_options, remote_env
from hvdrun.errors import LaunchError
from hvdrun.hosts import Host, is_local_host
from hvdrun.launch.base import Endpoint, Launcher, Worker, WorkerSpec
from hvdrun.launch.connections import (
    SshOptions,
    SshTarget,
    connect,
    connect_all,
    peer_address,
    resolve_targets,
    run_command,
)
from hvdrun.launch.hostprobe import explain_probe_failure, probe_command
from hvdrun.launch.local import LOOPBACK, LocalLauncher
from hvdrun.launch.output import OutputRouter
from hvdrun.launch.remote.guard import KILL, TERMINATE, forward_byte
from hvdrun.launch.remote.hostfacts import HostFacts, free_ports, interface_address
from hvdrun.ranks import Slot

if TYPE_CHECKING:
    import paramiko

SESSIONS_PER_CONNECTION = 8  # below sshd's default MaxSessions (10)
_KILL_CONFIRM_S = 3.0
_LOST_CONNECTION = -1  # paramiko's exit status when the channel closed without one


@dataclass
class _RemoteHost:
    """A remote host of the job: its connections and what its probe said."""

    target: SshTarget
    clients: list[paramiko.SSHClient]
    facts: HostFacts | None = None
    sessions: int = 0

    def next_client(self) -> paramiko.SSHClient:
        """The connection for the next rank: SESSIONS_PER_CONNECTION ranks share one."""
        client = self.clients[min(self.sessions // SESSIONS_PER_CONNECTION, len(self.clients) - 1)]
        self.sessions += 1
        return client


class SshLauncher(Launcher):
    """Starts ranks over SSH on remote hosts (and locally on this machine's hosts).

    Args:
        grace_s: seconds between SIGTERM and SIGKILL when stopping ranks.
        ssh: how to reach hosts.
        workdir: the working directory of every rank (the launcher's).
        python_for: the Python that runs on a host (the plan's rule); the probe checks that one.
        network_interface: advertise rank 0 on this interface's address.
        everywhere: use SSH for hosts that are this machine too.
    """

    def __init__(self, grace_s: float, ssh: SshOptions, workdir: str, python_for: Callable[[Host], str],
                 network_interface: str | None = None, everywhere: bool = False) -> None:
        super().__init__(grace_s)
        self.ssh, self.workdir, self.python_for = ssh, workdir, python_for
        self.network_interface, self.everywhere = network_interface, everywhere
        self._remote: dict[Host, _RemoteHost] = {}
        self._local = LocalLauncher(grace_s)

    def is_remote(self, host: Host) -> bool:
        """Ranks on ``host`` start over SSH."""
        return self.everywhere or not is_local_host(host.name)

    def prepare(self, slots: Sequence[Slot], deadline: float) -> None:
        ranks_on = Counter(slot.host for slot in slots)
        hosts = [host for host in ranks_on if self.is_remote(host)]
        targets = resolve_targets(hosts, self.ssh)
        per_host = [math.ceil(ranks_on[h] / SESSIONS_PER_CONNECTION) for h in hosts]
        clients = connect_all([t for t, n in zip(targets, per_host, strict=True) for _ in range(n)], self.ssh,
                              deadline)
        for host, target, count in zip(hosts, targets, per_host, strict=True):
            self._remote[host], clients = _RemoteHost(target, clients[:count]), clients[count:]
        rank0_host = slots[0].host
        _in_parallel([functools.partial(self._probe, h, 2 if h == rank0_host else 0, deadline) for h in hosts])
        if self.network_interface and not self.is_remote(rank0_host) and self._local_interface_addr() is None:
            raise LaunchError(f"this machine has no IPv4 address on --network-interface '{self.network_interface}'")

    def _probe(self, host: Host, ports: int, deadline: float) -> None:
        remote = self._remote[host]
        remote.facts = self._ask(host, remote.target, remote.clients[0], ports, deadline)

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
        """Connect to every remote host of ``hosts`` at once and run the probe there, as :meth:`prepare` does;
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

    def _local_interface_addr(self) -> str | None:
        return interface_address(self.network_interface) if self.network_interface else None

    def endpoint(self, host: Host) -> Endpoint:
        remote = self._remote.get(host)
        if remote is not None:
            assert remote.facts is not None
            addr = remote.facts.interface_addr or peer_address(remote.clients[0])[1]
            return Endpoint(addr, *remote.facts.ports[:2])
        route = peer_address(next(iter(self._remote.values())).clients[0])[0] if self._remote else LOOPBACK
        return Endpoint(self._local_interface_addr() or route, *free_ports(2))

    def cpus(self, host: Host) -> int:
        remote = self._remote.get(host)
        return remote.facts.cpus if remote is not None and remote.facts is not None else super().cpus(host)

    def start(self, spec: WorkerSpec, router: OutputRouter) -> Worker:
        remote = self._remote.get(spec.slot.host)
        if remote is None:
            return self._local.start(spec, router)
        transport = remote.next_client().get_transport()
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

    def close(self) -> None:
        for remote in self._remote.values():
            for client in remote.clients:
                client.close()


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
            elif self._kill_sent_at is not None and time.monotonic() - self._kill_sent_at > _KILL_CONFIRM_S:
                self.channel.close()  # the guard there sees EOF and kills what is left
                self._status = -signal.SIGKILL
        return self._status

    def _decode(self, code: int) -> int:
        if code == _LOST_CONNECTION:
            self._note = f"lost its SSH connection (host {self.slot.hostname} down, or sshd killed the session)"
            return 255
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
    env = {name: value for name, value in remote_env(spec.env).items() if name not in OFF_THE_COMMAND_LINE}
    from_stdin = [word for name in OFF_THE_COMMAND_LINE if name in spec.env for word in ("--env-from-stdin", name)]
    if spec.python != sys.executable:  # a host's own Python (YAML python:/venv:): its bin/ first on PATH
        env["PATH"] = f"{os.path.dirname(spec.python)}:{env.get('PATH', '/usr/bin:/bin')}"
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


def _in_parallel(tasks: Sequence[Callable[[], None]]) -> None:
    """Run ``tasks`` concurrently; raise the first failure in task order."""
    if not tasks:
        return
    with ThreadPoolExecutor(max_workers=min(len(tasks), 64), thread_name_prefix="hvdrun-probe") as pool:
        futures = [pool.submit(task) for task in tasks]
    for future in futures:
        future.result()
