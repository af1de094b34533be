"""What a host says about itself before ranks start there: ``python -m hvdrun.launch.remote.hostfacts [OPTIONS]``.

A host's agent (:mod:`hvdrun.launch.remote.host_agent.main`) answers with these facts first; the SSH launcher runs
this module on a host to check it without starting an agent (before a restart), in the job's working directory
under the host's Python, and reads one JSON line: hostname, Python and package versions, CPU count, the address
of ``--interface``, free ports for rank 0's rendezvous and the address sshd was reached at. A host where the
working directory, the Python or hvdrun is missing fails before it (the launcher's side,
:mod:`hvdrun.launch.hostprobe`, builds the command and explains such a failure).
:func:`free_ports` and :func:`interface_address` serve the launcher's own machine too.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from hvdrun.envvars import SSH_CONNECTION


@dataclass(frozen=True)
class HostFacts:
    """A host's answer to the probe."""

    hostname: str
    python: str
    executable: str
    hvdrun: str
    torch: str | None
    cpus: int
    interface_addr: str | None
    ports: tuple[int, ...]
    address: str | None = None  # where the host was reached over SSH (sshd's SSH_CONNECTION), if it was

    @classmethod
    def from_json(cls, text: str) -> HostFacts:
        """Parse the probe's output line."""
        data = json.loads(text)
        return cls(**{**data, "ports": tuple(data["ports"])})


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` on this machine, or None when it has none."""
    import psutil

    for addr in psutil.net_if_addrs().get(name, ()):
        if addr.family == socket.AF_INET:
            return str(addr.address)
    return None


def route_source_address(towards: str) -> str:
    """This machine's address on the route to host ``towards`` (no packet is sent).

    Raises:
        LaunchError: there is no route to it.
    """
    from hvdrun.errors import LaunchError

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((towards, 9))
            return str(probe.getsockname()[0])
    except OSError as e:
        raise LaunchError(f"no route from this machine to {towards}: {e.strerror or e}", towards) from e


_PORT_FLOOR = 10_000  # the least port free_ports picks below the ephemeral range
_PORT_TRIES = 200


def free_ports(count: int) -> tuple[int, ...]:
    """``count`` distinct TCP ports that were free on every interface a moment ago.

    A port is bound later, by another process (rank 0, once it has started): in between, any outgoing connection
    on the host may take a port of the kernel's ephemeral range (``ip_local_port_range``) as its own end. So the
    ports are picked at random below that range, where only an explicit bind can take them; where the range leaves
    no room below it, the kernel picks them (port 0).
    """
    low = _ephemeral_low()
    if low - _PORT_FLOOR < 1_000:
        return _kernel_ports(count)
    chosen: list[int] = []
    for port in random.sample(range(_PORT_FLOOR, low), min(_PORT_TRIES, low - _PORT_FLOOR)):
        if len(chosen) == count:
            break
        try:
            socket.create_server(("", port)).close()
        except OSError:
            continue
        chosen.append(port)
    return tuple(chosen) if len(chosen) == count else _kernel_ports(count)


def _kernel_ports(count: int) -> tuple[int, ...]:
    sockets = [socket.create_server(("", 0)) for _ in range(count)]
    try:
        return tuple(int(s.getsockname()[1]) for s in sockets)
    finally:
        for s in sockets:
            s.close()


def _ephemeral_low() -> int:
    """The first port of this host's ephemeral range (Linux's default: 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _version(package: str) -> str | None:
    from importlib import metadata  # 15 ms: the launcher imports this module for free_ports() alone

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def facts(interface: str | None, ports: int) -> HostFacts:
    """Collect this host's facts."""
    from hvdrun.version import __version__

    return HostFacts(hostname=socket.gethostname(), python=sys.version.split()[0], executable=sys.executable,
                     hvdrun=__version__, torch=_version("torch"), cpus=os.cpu_count() or 1,
                     interface_addr=interface_address(interface) if interface else None, ports=free_ports(ports),
                     address=reached_at(os.environ))


def reached_at(environ: Mapping[str, str]) -> str | None:
    """The address this host was reached at over SSH: the third word of sshd's ``SSH_CONNECTION``."""
    words = environ.get(SSH_CONNECTION, "").split()
    return words[2] if len(words) == 4 else None


def main(argv: list[str] | None = None) -> None:
    """Print this host's facts as one JSON line."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hvdrun.launch.remote.hostfacts")
    parser.add_argument("--interface")
    parser.add_argument("--ports", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(facts(args.interface, args.ports).__dict__))


if __name__ == "__main__":
    main()
