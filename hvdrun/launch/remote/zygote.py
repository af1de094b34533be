"""A local fork server forked by a process that already imported torch (a zygote), not by a new interpreter.

A local job's fork server (``forkserver.py``) is a new interpreter that imports torch once for the job's ranks:
about 2 CPU-s per job. A test suite that starts hundreds of short jobs pays that hundreds of times. When
``HVDRUN_FORK_SERVER_FROM`` names the Unix socket of a process that imported the preload modules (the suite's
own, ``tests/zygote.py``), :meth:`ForkServer.spawn <hvdrun.launch.remote.forkserver.ForkServer.spawn>` asks it
instead (:func:`adopt`): the zygote forks a child that becomes the job's fork server, in a session of its own,
with the launcher's environment, working directory and standard streams, shown in ``/proc`` as the spawned
server would be. Everything after that is the fork server's own code: its guards, its preload verdict (a rank
whose environment differs from the one the modules were imported under still starts as a new interpreter) and
its teardown. A zygote that cannot be reached or refuses leaves the ordinary spawn to run.

Meant for test suites: the server is the zygote's child, not the launcher's, so it is outside any hold a
scheduler has on the launcher (a Slurm step, a PBS job): never set it for a job a scheduler starts.

The protocol, one request per connection: an 8-byte big-endian length sent with three descriptors (the
server's socket, its stdout and its stderr), then that many bytes of JSON ``{"kind": "forkserver", "env": ...,
"cwd": ..., "modules": [...]}`` (``modules``: what the job's ranks want preloaded, ``HVDRUN_PRELOAD``).
Answers, one line each: ``pid N`` or ``refused WHY``; then ``exit CODE`` when the server ended (``CODE`` as
:attr:`subprocess.Popen.returncode`). Standard library only.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from hvdrun.envvars import FORK_SERVER_FROM

HEADER_BYTES = 8
FORK_SERVER = "forkserver"  # the request's kind


class AdoptedServer:
    """A fork server the zygote forked for us: its pid, and its end as the zygote reports it (it is the zygote's
    child, so only the zygote can reap it). What :class:`subprocess.Popen` offers that :class:`ForkServer
    <hvdrun.launch.remote.forkserver.ForkServer>` uses."""

    def __init__(self, pid: int, control: socket.socket, pending: bytes) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._control, self._pending = control, pending

    def wait(self, timeout: float | None = None) -> int:
        """The server's exit status (:class:`subprocess.TimeoutExpired` if not known within ``timeout`` s). If the
        zygote ended first, nobody can tell it: 0 once the server is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None and b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._control], [], [], left)[0]:
                raise subprocess.TimeoutExpired(f"fork server pid {self.pid}", timeout or 0)
            chunk = self._control.recv(64)
            if not chunk:
                while not _gone(self.pid):
                    if deadline is not None and time.monotonic() > deadline:
                        raise subprocess.TimeoutExpired(f"fork server pid {self.pid}", timeout or 0)
                    time.sleep(0.01)
                self._pending += b"exit 0\n"
            self._pending += chunk
        if self.returncode is None:
            self.returncode = int(self._pending.split(b"\n", 1)[0].split()[1])
            self._control.close()
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the server, as :meth:`subprocess.Popen.kill`."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def ask_for_pid(path: str, request: dict[str, Any], fds: Sequence[int]) -> tuple[int, socket.socket, bytes] | None:
    """Send ``request`` with ``fds`` to the zygote at ``path`` and read its first answer: the pid it forked, the
    connection (its ``exit CODE`` line comes there) and what came after the pid's line; None when it cannot be
    reached or refused."""
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        control.connect(path)
        payload = json.dumps(request).encode()
        socket.send_fds(control, [len(payload).to_bytes(HEADER_BYTES, "big")], list(fds))
        control.sendall(payload)
        received = b""
        while b"\n" not in received:
            chunk = control.recv(4096)
            if not chunk:
                break
            received += chunk
    except OSError:
        received = b""
    line, _, pending = received.partition(b"\n")
    words = line.decode(errors="replace").split()
    if words[:1] != ["pid"] or len(words) != 2 or not words[1].isdigit():
        control.close()
        return None
    return int(words[1]), control, pending


def adopt(server_end: socket.socket, modules: Sequence[str] = ()) -> AdoptedServer | None:
    """Ask the zygote at ``HVDRUN_FORK_SERVER_FROM`` for a fork server serving ``server_end``, whose ranks want
    ``modules`` preloaded (a zygote that imported them too may fork it from there); None when the variable is
    unset, or the zygote cannot be reached or refuses (then spawn the server the ordinary way)."""
    path = os.environ.get(FORK_SERVER_FROM)
    if not path:
        return None
    answer = ask_for_pid(path, {"kind": FORK_SERVER, "env": dict(os.environ), "cwd": os.getcwd(),
                                "modules": list(modules)}, [server_end.fileno(), 1, 2])
    return None if answer is None else AdoptedServer(*answer)
