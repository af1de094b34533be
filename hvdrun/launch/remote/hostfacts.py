"""What a host says about itself before ranks start there: ``python -m hvdrun.launch.probe [OPTIONS]``.

The SSH launcher runs this on every remote host (in the job's working directory, under the
host's Python) and reads one JSON line: hostname, Python and package versions, CPU count,
the address of ``--interface`` and free ports for rank 0's rendezvous. A host where the
working directory, the Python or hvdrun is missing fails before it (see :func:`probe_command`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
from dataclasses import dataclass
from importlib import metadata

# exit codes of the shell prelude of probe_command
NO_WORKDIR, NO_PYTHON = 97, 98


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


def interface_names() -> list[str]:
    """Names of this machine's network interfaces."""
    import psutil

    return sorted(psutil.net_if_addrs())


def free_ports(count: int) -> tuple[int, ...]:
    """``count`` distinct TCP ports that were free on every interface a moment ago."""
    sockets = [socket.create_server(("", 0)) for _ in range(count)]
    try:
        return tuple(int(s.getsockname()[1]) for s in sockets)
    finally:
        for s in sockets:
            s.close()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def facts(interface: str | None, ports: int) -> HostFacts:
    """Collect this host's facts."""
    from hvdrun.version import __version__

    return HostFacts(hostname=socket.gethostname(), python=sys.version.split()[0], executable=sys.executable,
                     hvdrun=__version__, torch=_version("torch"), cpus=os.cpu_count() or 1,
                     interface_addr=interface_address(interface) if interface else None, ports=free_ports(ports))


def probe_command(workdir: str, python: str, interface: str | None, ports: int) -> str:
    """The shell command that runs the probe on a host; every value is quoted."""
    args = ["--ports", str(ports)] + (["--interface", interface] if interface else [])
    return module_command(workdir, python, "hvdrun.launch.probe", args)


def module_command(workdir: str, python: str, module: str, args: list[str]) -> str:
    """``python -m module args`` in ``workdir`` on a host; a missing directory or Python exits with
    :data:`NO_WORKDIR` or :data:`NO_PYTHON`. Every value is quoted."""
    return (f"cd -- {shlex.quote(workdir)} 2>/dev/null || exit {NO_WORKDIR}; "
            f"command -v -- {shlex.quote(python)} >/dev/null 2>&1 || exit {NO_PYTHON}; "
            f"exec {shlex.join([python, '-m', module, *args])}")


def explain_probe_failure(where: str, status: int, stderr: str, workdir: str, python: str) -> str:
    """Why a probe run on host ``where`` (``user@host (addr:port)``) exited with ``status``."""
    if status == NO_WORKDIR:
        return (f"working directory {workdir} does not exist on {where}; hvdrun starts every rank in the "
                "launcher's working directory (use a shared filesystem or create it there)")
    if status == NO_PYTHON:
        return (f"Python {python} not found on {where}; install it there or set 'python:' or 'venv:' for that host "
                "in the cluster YAML")
    if "No module named" in stderr and "hvdrun" in stderr:
        return f"hvdrun is not installed for {python} on {where}; install it there (pip install hvdrun)"
    tail = " | ".join(stderr.strip().splitlines()[-3:]) or "no output"
    return f"hvdrun's probe failed on {where} with exit code {status}: {tail}"


def main(argv: list[str] | None = None) -> None:
    """Print this host's facts as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m hvdrun.launch.probe")
    parser.add_argument("--interface")
    parser.add_argument("--ports", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(facts(args.interface, args.ports).__dict__))


if __name__ == "__main__":
    main()
