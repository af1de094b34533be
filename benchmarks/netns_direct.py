"""Namespace hosts without sshd: ranks started straight into each host's network namespace.

For machines where ``benchmarks/multihost.py``'s sshd fixture cannot run (no OpenSSH server installed,
nothing to install it from) but root may create network namespaces: a bridge and one namespace per host
(veth ``eth0``, ``SUBNET.(k+1)``; the bridge is ``SUBNET.254``), each rank in its host's namespace and a UTS
namespace of its own named ``hK`` (as the fixture's hosts are). What is measured is the same as over SSH:
hvdrun's collectives and MPI's over TCP on veth; only the launch differs.

- hvdrun ranks: started here with :func:`hvdrun.envvars.worker_env` (hvdrun's own variables for each slot,
  rank 0's rendezvous on host 0's address), no launcher process in between.
- MPI ranks: the mpich wheel's ``mpiexec`` with a stand-in for ``ssh`` (``-launcher-exec``) that runs hydra's
  proxy for host ``hK`` inside namespace K; proxies call back to the bridge's address (``-localhost``).

Where ``ip`` is missing too (no namespaces can be wired), or ``BENCH_LOOPBACK_HOSTS=1`` asks for it, the hosts
are *loopback* hosts: the same UTS names, every address 127.0.0.1, so hvdrun's ranks of different hosts and MPI's
of different proxies still talk over kernel TCP (loopback instead of veth), and only ranks of one host share
memory.

Used by ``multihost.py --no-ssh``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from hvdrun.envvars import Rendezvous, worker_env
from hvdrun.hosts import Host
from hvdrun.ranks import assign_slots

_UTS_EXEC = 'echo "$0" > /proc/sys/kernel/hostname && exec "$@"'


@dataclass(frozen=True)
class BareHosts:
    """The namespaces of one run: ``prefix + K`` is host ``hK`` at ``subnet.(K+1)``."""

    prefix: str
    bridge: str
    subnet: str
    count: int
    directory: Path
    loopback: bool = False

    @property
    def callback(self) -> str:
        """Where hydra's proxies reach mpiexec."""
        return "127.0.0.1" if self.loopback else f"{self.subnet}.254"

    def namespace(self, index: int) -> str:
        return f"{self.prefix}{index}"

    def address(self, index: int) -> str:
        return "127.0.0.1" if self.loopback else f"{self.subnet}.{index + 1}"

    def enter(self, index: int) -> list[str]:
        """The words that run a command as host ``hK`` (its network namespace, a UTS namespace named hK)."""
        netns = [] if self.loopback else ["ip", "netns", "exec", self.namespace(index)]
        return [*netns, "unshare", "--uts", "sh", "-c", _UTS_EXEC, f"h{index}"]


def _ip(*words: str) -> None:
    subprocess.run(["ip", *words], check=True, capture_output=True, text=True)


def hosts_for(count: int, env: dict[str, str], directory: Path) -> BareHosts:
    """The ``count`` hosts named after ``env``'s fixture variables (see multihost.fixture_env), not started."""
    return BareHosts(env["HVD_FX_NS_PREFIX"], env["HVD_FX_BRIDGE"], env["HVD_FX_SUBNET"], count, directory,
                     loopback=shutil.which("ip") is None or os.environ.get("BENCH_LOOPBACK_HOSTS") == "1")


def start(count: int, env: dict[str, str], directory: Path) -> BareHosts:
    """A bridge and ``count`` namespaces (or loopback hosts, see the module docstring) of :func:`hosts_for`."""
    hosts = hosts_for(count, env, directory)
    directory.mkdir(parents=True, exist_ok=True)
    if hosts.loopback:
        print("no 'ip' command: loopback hosts (kernel TCP over 127.0.0.1 between hosts)", file=sys.stderr)
        _write_ssh_stand_in(hosts)
        return hosts
    stop(hosts)
    _ip("link", "add", hosts.bridge, "type", "bridge")
    _ip("addr", "add", f"{hosts.subnet}.254/24", "dev", hosts.bridge)
    _ip("link", "set", hosts.bridge, "up")
    for index in range(count):
        ns, veth = hosts.namespace(index), f"{hosts.bridge[:-3]}v{index}"
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", hosts.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{hosts.address(index)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
    _write_ssh_stand_in(hosts)
    return hosts


def stop(hosts: BareHosts) -> None:
    """Kill what runs in the namespaces, delete them and the bridge (quietly: some may not exist)."""
    if hosts.loopback:
        return
    for index in range(hosts.count):
        ns = hosts.namespace(index)
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", hosts.bridge], capture_output=True)


def _write_ssh_stand_in(hosts: BareHosts) -> None:
    """``ssh [options] hK command...`` for hydra: the command, as host hK (no ssh involved)."""
    script = hosts.directory / "ssh"
    script.write_text(f"""#!{sys.executable}
import os, sys
args, i = sys.argv[1:], 0
while args[i].startswith("-"):
    i += 2 if args[i] in ("-o", "-p", "-i", "-l", "-F") else 1
host, command = args[i], " ".join(args[i + 1:])
netns = [] if {hosts.loopback!r} else ["ip", "netns", "exec", "{hosts.prefix}" + host.lstrip("h")]
os.execvp(*(netns or ["unshare"])[:1], [*netns, "unshare", "--uts", "sh", "-c", {_UTS_EXEC!r}, host, "sh", "-c",
                                         command])
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def _run(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout, env=env)


def run_hvdrun(hosts: BareHosts, count: int, per_host: int, script: list[str], extra_env: dict[str, str],
               timeout: float) -> tuple[int, str, str]:
    """One hvdrun job on hosts h0..h(count-1), ``per_host`` ranks each: (worst exit code, rank 0's stdout,
    every rank's stderr tail)."""
    from hvdrun.launch.remote.hostfacts import free_ports

    rendezvous = Rendezvous(hosts.address(0), *free_ports(2), uuid.uuid4().hex, uuid.uuid4().hex[:8])
    slots = assign_slots([Host(f"h{k}", per_host) for k in range(count)], count * per_host)
    base = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    procs = []
    for slot in slots:
        env = {**base, **worker_env(slot, rendezvous)}
        procs.append(subprocess.Popen([*hosts.enter(slot.host_index), sys.executable, *script], env=env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        return 124, "", f"ran past {timeout:.0f} s"
    codes = [proc.returncode for proc in procs]
    errors = "".join(f"[rank {i}] {err[-600:]}" for i, (_, err) in enumerate(outputs) if codes[i])
    return max(codes), outputs[0][0], errors


def run_mpi(hosts: BareHosts, count: int, per_host: int, script: list[str], mpi_env: dict[str, str],
            timeout: float) -> tuple[int, str, str]:
    """One MPI job through the mpich wheel's hydra, proxies started by the ssh stand-in."""
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if mpiexec is None:
        return 127, "", "mpiexec not found (pip install mpich mpi4py)"
    genv = [word for name, value in mpi_env.items() for word in ("-genv", name, value)]
    command = [mpiexec, "-launcher", "ssh", "-launcher-exec", str(hosts.directory / "ssh"),
               "-localhost", hosts.callback, "-hosts", ",".join(f"h{k}:{per_host}" for k in range(count)),
               "-n", str(count * per_host), *genv, sys.executable, *script]
    try:
        done = _run(command, {**os.environ, "OMP_NUM_THREADS": "1", **mpi_env}, timeout)
    except subprocess.TimeoutExpired:
        return 124, "", f"{shlex.join(command)} ran past {timeout:.0f} s"
    return done.returncode, done.stdout, done.stderr[-3000:]
