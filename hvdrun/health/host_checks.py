"""Per-host checks of ``hvdrun check``: reach every host at once, ask it about itself, test the port.

Phase 1 runs in parallel, one thread per host, each bounded by the per-host timeout: reach the
host (this machine, or SSH with its host key verified), run ``python -m hvdrun.health.on_host
facts`` under the Python the ranks will use, and compare the answer with the launcher's own
(Python, hvdrun and torch versions), the GPUs the config promises and the free disk. A host that
does not answer is reported by name when its timeout passes; the others go on.

With node expectations (``hvdrun check --health``, ``hvdrun --preflight``) phase 1 also asks each host about
its health (:mod:`hvdrun.health.node_health`), judges the answer (:mod:`hvdrun.health.node_checks`) and reads
its clock over the same connection, a few round trips long.

Phase 2 proves the rendezvous port: rank 0's host serves a fresh TCP port (as the real job would)
and every host that answered connects to it and reads back a per-check token.
"""

from __future__ import annotations

import functools
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hvdrun.errors import LaunchError, UsageError
from hvdrun.health.node_checks import (
    VENDOR_TOOL,
    NodeExpectations,
    clock_check,
    clock_offset,
    clock_unread,
    node_checks,
)
from hvdrun.health.node_health import CLOCK_READY
from hvdrun.health.on_host import HealthFacts, ask_token, installed_torch_version, serve_token
from hvdrun.health.verdict import Check
from hvdrun.hosts import Host
from hvdrun.launch.hostprobe import explain_probe_failure, module_command
from hvdrun.launch.local import LOOPBACK
from hvdrun.launch.remote import cpubind
from hvdrun.launch.remote.connections import (
    DEFAULT_SSH_PORT,
    SshOptions,
    SshTarget,
    connect,
    peer_address,
    resolve_targets,
    run_command,
)
from hvdrun.launch.remote.hostfacts import interface_address
from hvdrun.ranks import GpuLayout
from hvdrun.version import __version__

if TYPE_CHECKING:
    import paramiko

ON_HOST_MODULE = "hvdrun.health.on_host"  # run on every host (python -m)
_GB = 1e9


@dataclass
class HostReport:
    """Everything checked on one host."""

    host: str
    via: str
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0
    facts: HealthFacts | None = None

    @property
    def ok(self) -> bool:
        """Every check passed (and there was at least one)."""
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def reached(self) -> bool:
        """The host answered the probe."""
        return self.facts is not None


@dataclass(frozen=True)
class Expectations:
    """What every host must match: the launcher's versions, the GPUs promised, the disk wanted."""

    python: str
    hvdrun: str
    torch: str | None
    gpus: int = 0
    gpus_from: str = ""
    min_disk_bytes: int = int(_GB)
    cpu_bind: str = "none"  # the job's --cpu-bind, as each host's guard will apply it
    layout: GpuLayout = GpuLayout()

    @classmethod
    def of_launcher(cls, gpus: int, gpus_from: str, min_disk_bytes: int) -> Expectations:
        """The launcher's own Python, hvdrun and torch (torch as ``import torch`` reports it)."""
        return cls(python=sys.version.split()[0], hvdrun=__version__, torch=installed_torch_version(), gpus=gpus,
                   gpus_from=gpus_from, min_disk_bytes=min_disk_bytes)


@dataclass(frozen=True)
class CheckTarget:
    """A host to check and how: its Python, the working directory, SSH or this machine."""

    host: Host
    python: str
    remote: bool
    ranks: int = 1  # the job's ranks on this host


class HostChecker:
    """Runs phase 1 and 2 over ``targets``; ``on_report`` hears each host as it answers.

    Args:
        targets: the hosts, rank 0's host first.
        workdir: the ranks' working directory (the probe runs there).
        ssh: how to reach remote hosts.
        timeout_s: the bound on each host's answer (connect + probe), and on the port test.
        expect: what the answers must match.
        interface: ``--network-interface``, whose address rank 0 would advertise.
        node: what each node's health must show (None: its health is not asked about).
        versions: compare Python, hvdrun and torch with the launcher's and report the bindings (``--preflight``
            leaves them to the job: only whether the host can run hvdrun, its GPUs and its health count there).
    """

    def __init__(self, targets: Sequence[CheckTarget], workdir: str, ssh: SshOptions, timeout_s: float,
                 expect: Expectations, interface: str | None = None, node: NodeExpectations | None = None,
                 versions: bool = True) -> None:
        self.targets, self.workdir, self.ssh = list(targets), workdir, ssh
        self.timeout_s, self.expect, self.interface = timeout_s, expect, interface
        self.node, self.versions = node, versions
        self._clients: dict[str, paramiko.SSHClient] = {}
        self._ssh_targets = dict(zip([t.host.name for t in self.targets if t.remote],
                                     resolve_targets([t.host for t in self.targets if t.remote], ssh), strict=True))

    def run(self, on_report: Callable[[HostReport], None] = lambda r: None) -> list[HostReport]:
        """Check every host; returns the reports in target order."""
        try:
            reports = self._facts_phase(on_report)
            self._port_phase(reports)
            return reports
        finally:
            self._close()

    def check_nodes(self, on_report: Callable[[HostReport], None] = lambda r: None) -> list[HostReport]:
        """Phase 1 alone (``hvdrun --preflight``); returns the reports in target order."""
        try:
            return self._facts_phase(on_report)
        finally:
            self._close()

    def _close(self) -> None:
        for client in list(self._clients.values()):
            client.close()

    # -- phase 1 -----------------------------------------------------------------------------------

    def _facts_phase(self, on_report: Callable[[HostReport], None]) -> list[HostReport]:
        answers: queue.Queue[tuple[int, HostReport]] = queue.Queue()
        for index, target in enumerate(self.targets):
            threading.Thread(target=lambda i=index, t=target: answers.put((i, self._check_one(t))),
                             name=f"hvdrun-check-{target.host.name}", daemon=True).start()
        reports: dict[int, HostReport] = {}
        deadline = time.monotonic() + self.timeout_s + 2.0  # each thread is bounded by timeout_s itself
        while len(reports) < len(self.targets):
            try:
                index, report = answers.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            reports[index] = report
            on_report(report)
        for index, target in enumerate(self.targets):
            if index not in reports:  # a thread stuck past every bound: report it, leave it behind
                reports[index] = self._unreached(target, f"no answer within {self.timeout_s:g} s", 0.0)
                on_report(reports[index])
        return [reports[i] for i in range(len(self.targets))]

    def _check_one(self, target: CheckTarget) -> HostReport:
        started = time.monotonic()
        deadline = started + self.timeout_s
        try:
            via, status, out, err = self._probe(target, deadline)
        except LaunchError as e:
            return self._unreached(target, str(e), time.monotonic() - started)
        except Exception as e:  # noqa: BLE001 - a timeout or a dropped connection, named in the report
            return self._unreached(target, f"no answer to hvdrun's probe: {e or type(e).__name__}",
                                   time.monotonic() - started)
        report = HostReport(target.host.name, via, seconds=time.monotonic() - started)
        report.checks.append(Check("reach", True, _reach_expected(target, self._ssh_targets),
                                   "ssh, host key verified" if target.remote else "this machine"))
        if status != 0:
            report.checks.append(Check("python", False, f"{target.python} running hvdrun {self.expect.hvdrun}",
                                       explain_probe_failure(self._where(target), status, err, self.workdir,
                                                             target.python),
                                       _FIX_PYTHON.format(host=target.host.name)))
            return report
        report.facts = HealthFacts.from_json(out.strip().splitlines()[-1])
        name = target.host.name
        if self.versions:
            report.checks += compare(report.facts, self.expect, name)
            report.checks.append(binding_check(report.facts, self.expect, name, target.ranks))
        else:
            report.checks.append(_gpu_check(report.facts, self.expect, name))
        if self.node is not None:
            report.checks += node_checks(report.facts.node, self.node, name)
            report.checks.append(self._clock(target, self.node.max_clock_skew_s, deadline))
        report.seconds = time.monotonic() - started
        return report

    def _clock(self, target: CheckTarget, max_skew_s: float, deadline: float) -> Check:
        """The clock verdict of ``target``: its ``time.time()`` against ours over the host's SSH connection; this
        machine's is the launcher's own."""
        if not target.remote:
            return clock_check(clock_offset(time.time), max_skew_s, target.host.name)
        command = module_command(self.workdir, target.python, ON_HOST_MODULE, ["clock"])
        try:
            with _RemoteClock(self._clients[target.host.name], command, max(deadline - time.monotonic(), 1.0)) as ask:
                reading = clock_offset(ask)
        except Exception as e:  # noqa: BLE001 - a timeout, a dropped connection, a wrong answer: named in the report
            return clock_unread(str(e) or type(e).__name__, max_skew_s)
        return clock_check(reading, max_skew_s, target.host.name)

    def _probe(self, target: CheckTarget, deadline: float) -> tuple[str, int, str, str]:
        args = ["facts"] + (["--interface", self.interface] if self.interface else [])
        if self.node is not None:  # a vendor tool that hangs is named, within the host's own bound
            args += [*self.node.probe_args(), "--tool-timeout", f"{max(self.timeout_s / 3, 1.0):g}"]
        args += [] if self.versions else ["--no-torch"]  # nothing compares its version
        command = module_command(self.workdir, target.python, ON_HOST_MODULE, args)
        if not target.remote:
            done = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True,
                                  timeout=max(deadline - time.monotonic(), 0.1))
            return "local", done.returncode, done.stdout, done.stderr
        ssh_target = self._ssh_targets[target.host.name]
        client = connect(ssh_target, self.ssh, deadline)
        self._clients[target.host.name] = client
        status, out, err = run_command(client, command, max(deadline - time.monotonic(), 0.1))
        return "ssh", status, out, err

    def _unreached(self, target: CheckTarget, why: str, seconds: float) -> HostReport:
        fix = self._reach_fix(target) if target.remote else "check that this machine can run the Python the ranks use"
        return HostReport(target.host.name, "ssh" if target.remote else "local", seconds=seconds,
                          checks=[Check("reach", False, _reach_expected(target, self._ssh_targets), why, fix)])

    def _reach_fix(self, target: CheckTarget) -> str:
        """What to check for a host SSH did not reach: the known_hosts file is the one hvdrun used."""
        ssh = self._ssh_targets[target.host.name]
        known = self.ssh.known_hosts_path
        given = " (--ssh-known-hosts)" if self.ssh.known_hosts else ""
        port = f"-p {ssh.port} " if ssh.port != DEFAULT_SSH_PORT else ""
        return (f"check that the host is up and sshd listens on {ssh.hostname}:{ssh.port}, that its key is in "
                f"{known}{given} (ssh-keyscan {port}{ssh.hostname} >> {known}) and that your key is authorised there")

    def _where(self, target: CheckTarget) -> str:
        ssh_target = self._ssh_targets.get(target.host.name)
        return ssh_target.describe() if ssh_target else f"this machine ({target.host.name})"

    # -- phase 2 -----------------------------------------------------------------------------------

    def _port_phase(self, reports: list[HostReport]) -> None:
        """Rank 0's host serves a port; every host that answered connects to it."""
        reached = [(t, r) for t, r in zip(self.targets, reports, strict=True) if r.reached]
        if not reached or not reports[0].reached:
            return
        token = secrets.token_hex(8)
        rank0 = self.targets[0]
        try:
            with self._listener(rank0, reports[0], token) as (addr, port):
                expected = f"TCP {addr}:{port} on {rank0.host.name} (rank 0's rendezvous) reachable"
                results = _parallel([functools.partial(self._connect_from, t, addr, port) for t, _ in reached],
                                    self.timeout_s + 2.0)
                for (target, report), answer in zip(reached, results, strict=True):
                    report.checks.append(_port_check(expected, answer, token, rank0.host.name, target.host.name))
        except (OSError, LaunchError, TimeoutError) as e:
            reports[0].checks.append(Check("port", False, f"a TCP port served on {rank0.host.name}",
                                           f"could not serve one: {e}", "check the host's ephemeral port range"))

    def _listener(self, target: CheckTarget, report: HostReport, token: str) -> _Listener:
        if target.remote:
            client = self._clients[target.host.name]
            addr = (report.facts.base.interface_addr if report.facts else None) or peer_address(client)[1]
            command = module_command(self.workdir, target.python, ON_HOST_MODULE, ["listen", "--token", token])
            return _RemoteListener(client, command, addr, self.timeout_s)
        route = next((peer_address(c)[0] for c in self._clients.values()), LOOPBACK)
        addr = (interface_address(self.interface) if self.interface else None) or route
        return _LocalListener(addr, token)

    def _connect_from(self, target: CheckTarget, addr: str, port: int) -> str:
        """The token read from ``addr:port`` by ``target``, or ``error: ...``."""
        if not target.remote:
            try:
                return ask_token(addr, port, min(self.timeout_s, 5.0))
            except OSError as e:
                return f"error: {e.strerror or e}"
        command = module_command(self.workdir, target.python, ON_HOST_MODULE, ["connect", addr, str(port)])
        try:
            status, out, err = run_command(self._clients[target.host.name], command, self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a timeout or a dropped connection
            return f"error: {e or type(e).__name__}"
        return out.strip() if status == 0 else f"error: {err.strip() or f'exit code {status}'}"


def compare(facts: HealthFacts, expect: Expectations, host: str) -> list[Check]:
    """The version, GPU and disk verdicts of one host's facts."""
    checks = [
        _equal("python", expect.python, facts.base.python, f"Python {facts.base.executable}",
               _FIX_PYTHON.format(host=host)),
        _equal("hvdrun", expect.hvdrun, facts.base.hvdrun, "hvdrun",
               f"install hvdrun {expect.hvdrun} for {facts.base.executable} on {host}"),
    ]
    if facts.torch_version is None:
        checks.append(Check("torch", False, expect.torch or "importable", f"not importable ({facts.torch_error})",
                            f"pip install torch=={expect.torch} for {facts.base.executable} on {host}"))
    else:
        checks.append(_equal("torch", expect.torch or facts.torch_version, facts.torch_version, "torch",
                             f"install torch {expect.torch} for {facts.base.executable} on {host}"))
    checks.append(_gpu_check(facts, expect, host))
    free_gb = facts.disk_free_bytes / _GB
    checks.append(Check("disk", facts.disk_free_bytes >= expect.min_disk_bytes,
                        f">= {expect.min_disk_bytes / _GB:.1f} GB free in {facts.workdir}", f"{free_gb:.1f} GB free",
                        f"free space in {facts.workdir} on {host} (checkpoints and logs are written there)"))
    return checks


def binding_check(facts: HealthFacts, expect: Expectations, host: str, ranks: int) -> Check:
    """The bindings report of ``host``: each local rank's cores and NUMA node under ``--cpu-bind``, and its
    GPU's NUMA node where ``/sys`` says; a warning when they differ, a failure when the binding does not fit."""
    nodes = {int(n): frozenset(c) for n, c in facts.numa.items()}
    siblings = {int(c): frozenset(t) for c, t in facts.siblings.items()}
    gpu_numa = facts.gpu_numa.get(expect.layout.vendor, [])
    lines, apart = [], []
    try:
        bind = cpubind.parse_cpu_bind(expect.cpu_bind)
        beside = cpubind.local_gpu_nodes([expect.layout.cards_for(local, host) for local in range(ranks)], gpu_numa)
        for local in range(ranks):
            cores = cpubind.cores_for(bind, local, ranks, set(facts.cpus), nodes, siblings, beside)
            numa = cpubind.numa_of(cores, nodes)
            devices = expect.layout.devices_for(local, host)
            cards = expect.layout.cards_for(local, host)
            gpu_nodes = sorted({gpu_numa[i] for d in cards if (i := cpubind.gpu_index(d)) is not None
                                and i < len(gpu_numa) and gpu_numa[i] >= 0})
            seen = f" = device {expect.layout.ordinal_for(local)} of {','.join(expect.layout.visible_for(local, host))}"
            gpu = f", GPU {','.join(devices)}{seen} (NUMA {','.join(map(str, gpu_nodes)) or '?'})" if devices else ""
            lines.append(f"local rank {local}: cores {cpubind.format_cpulist(cores)} (NUMA {numa}){gpu}")
            if gpu_nodes and not set(map(str, gpu_nodes)) & set(numa.split(",")):
                apart.append(local)
    except (cpubind.CpuBindError, UsageError) as e:
        return Check("binding", False, f"--cpu-bind {expect.cpu_bind} fits {host}", str(e),
                     f"give --cpu-bind a binding that fits the cores of {host}")
    fix = (f"local ranks {', '.join(map(str, apart))} of {host} have their cores on another NUMA node than their "
           "GPU: set the cluster's gpu_order (Polaris lists its GPUs reversed) or a --cpu-bind list") if apart else None
    return Check("binding", True, f"--cpu-bind {expect.cpu_bind}", "; ".join(lines), fix, warn=bool(apart))


_FIX_PYTHON = ("use the same Python everywhere: install it on {host} or set 'python:' or 'venv:' for {host} in the "
               "cluster YAML")


def _equal(name: str, expected: str, found: str, what: str, fix: str) -> Check:
    ok = expected == found
    return Check(name, ok, expected, found if ok else f"{found} ({what}; the launcher has {expected})",
                 None if ok else fix)


def _gpu_check(facts: HealthFacts, expect: Expectations, host: str) -> Check:
    names = sorted({g.name for g in facts.gpus})
    found = f"{len(facts.gpus)} ({', '.join(names)}; {facts.gpu_source})" if facts.gpus else "0"
    if facts.gpu_error:
        found += f"; {facts.gpu_error}"
    if not expect.gpus:
        return Check("gpus", True, "any (no gpus_per_node given)", found)
    vendor = expect.layout.vendor
    if vendor != "nvidia" and not facts.gpus:  # nvidia-smi and torch.cuda see NVIDIA's only
        return Check("gpus", True, f"{expect.gpus} ({expect.gpus_from})",
                     f"not counted: nvidia-smi and torch.cuda see no {vendor} GPU; --health counts them with "
                     f"{VENDOR_TOOL.get(vendor, 'the vendor tool')}", warn=True)
    ok = len(facts.gpus) >= expect.gpus
    return Check("gpus", ok, f"{expect.gpus} ({expect.gpus_from})", found,
                 None if ok else f"check the GPU driver on {host} (nvidia-smi), or set gpus_per_node to "
                                 f"what the nodes have")


def _port_check(expected: str, answer: str, token: str, rank0: str, host: str) -> Check:
    if answer == token:
        return Check("port", True, expected, "connected")
    found = answer if answer.startswith("error") else f"another service answered ({answer[:40]!r})"
    return Check("port", False, expected, found,
                 f"let {host} open TCP connections to {rank0} (firewall, ephemeral ports), or give "
                 "--network-interface with an interface the hosts share")


def _reach_expected(target: CheckTarget, ssh_targets: dict[str, SshTarget]) -> str:
    if not target.remote:
        return "this machine"
    return f"ssh {ssh_targets[target.host.name].describe()} with a known host key"


def _parallel(tasks: Sequence[Callable[[], str]], timeout_s: float) -> list[str]:
    results: list[str] = [f"error: no answer within {timeout_s:g} s"] * len(tasks)

    def run(index: int) -> None:
        results[index] = tasks[index]()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(tasks))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    return results


class _Listener:
    """A context manager serving the token; enters as (address, port)."""

    def __enter__(self) -> tuple[str, int]:
        raise NotImplementedError

    def __exit__(self, *exc: object) -> None:
        raise NotImplementedError


class _LocalListener(_Listener):
    def __init__(self, addr: str, token: str) -> None:
        self.addr, self.token = addr, token
        self.stop = threading.Event()

    def __enter__(self) -> tuple[str, int]:
        self.server = socket.create_server(("", 0))
        self.thread = threading.Thread(target=serve_token, args=(self.server, self.token.encode(), self.stop),
                                       daemon=True)
        self.thread.start()
        return self.addr, int(self.server.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.server.close()


class _RemoteListener(_Listener):
    def __init__(self, client: paramiko.SSHClient, command: str, addr: str, timeout_s: float) -> None:
        self.client, self.command, self.addr, self.timeout_s = client, command, addr, timeout_s

    def __enter__(self) -> tuple[str, int]:
        transport = self.client.get_transport()
        assert transport is not None
        self.channel = transport.open_session(timeout=self.timeout_s)
        self.channel.settimeout(self.timeout_s)
        self.channel.exec_command(self.command)
        line = b""
        while not line.endswith(b"\n"):
            chunk = self.channel.recv(64)  # raises socket.timeout past timeout_s
            if not chunk:
                raise LaunchError(f"the port listener ended early: {self.channel.recv_stderr(4096).decode()}")
            line += chunk
        return self.addr, int(line)

    def __exit__(self, *exc: object) -> None:
        self.channel.shutdown_write()  # the listener ends at EOF on stdin
        self.channel.close()


class _RemoteClock:
    """``on_host clock`` on a host; enters as a callable that returns the host's ``time.time()`` once per call."""

    def __init__(self, client: paramiko.SSHClient, command: str, timeout_s: float) -> None:
        self.client, self.command, self.timeout_s = client, command, timeout_s
        self.pending = b""

    def __enter__(self) -> Callable[[], float]:
        transport = self.client.get_transport()
        assert transport is not None
        self.channel = transport.open_session(timeout=self.timeout_s)
        self.channel.settimeout(self.timeout_s)
        self.channel.exec_command(self.command)
        if (first := self._line()) != CLOCK_READY:
            raise LaunchError(f"the clock reader said {first!r} instead of {CLOCK_READY!r}")
        return self._ask

    def _ask(self) -> float:
        self.channel.sendall(b"\n")
        return float(self._line())

    def _line(self) -> str:
        while b"\n" not in self.pending:
            chunk = self.channel.recv(256)  # raises socket.timeout past timeout_s
            if not chunk:
                raise LaunchError(f"the clock reader ended: {self.channel.recv_stderr(4096).decode().strip()}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode().strip()

    def __exit__(self, *exc: object) -> None:
        self.channel.shutdown_write()  # the reader ends at EOF on stdin
        self.channel.close()
