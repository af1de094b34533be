"""The launcher's side of the host probe: the shell command that asks a host about itself, and why it failed.

The host answers with :mod:`hvdrun.launch.remote.hostfacts`. The command first enters the job's
working directory and checks the host's Python, exiting with :data:`NO_WORKDIR` or :data:`NO_PYTHON`
when one is missing, so that :func:`explain_probe_failure` can name what to fix on that host.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

# exit codes of the shell prelude of module_command
NO_WORKDIR, NO_PYTHON = 97, 98


def probe_command(workdir: str, python: str, interface: str | None, ports: int) -> str:
    """The shell command that runs the probe on a host; every value is quoted."""
    args = ["--ports", str(ports)] + (["--interface", interface] if interface else [])
    return module_command(workdir, python, "hvdrun.launch.remote.hostfacts", args)


def module_command(workdir: str, python: str, module: str, args: list[str],
                   env: Mapping[str, str] | None = None) -> str:
    """``python -m module args`` in ``workdir`` on a host, with ``env`` exported on top of the login's; a missing
    directory or Python exits with :data:`NO_WORKDIR` or :data:`NO_PYTHON`. Every value is quoted; a variable
    whose name a shell cannot assign is left out."""
    exports = "".join(f"export {name}={shlex.quote(value)}; " for name, value in sorted((env or {}).items())
                      if _SHELL_NAME.fullmatch(name))
    return (f"cd -- {shlex.quote(workdir)} 2>/dev/null || exit {NO_WORKDIR}; "
            f"command -v -- {shlex.quote(python)} >/dev/null 2>&1 || exit {NO_PYTHON}; "
            f"{exports}exec {shlex.join([python, '-m', module, *args])}")


_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
