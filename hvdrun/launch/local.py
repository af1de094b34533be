"""Start workers on this machine, each under its own guard process (see ``remote/guard.py``)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Sequence

from hvdrun.envvars import guard_options
from hvdrun.errors import LaunchError
from hvdrun.hosts import Host
from hvdrun.launch.base import GUARD_SCRIPT, Endpoint, Launcher, Worker, WorkerSpec
from hvdrun.launch.output import OutputRouter
from hvdrun.launch.remote.guard import forward_byte
from hvdrun.launch.remote.hostfacts import free_ports
from hvdrun.ranks import Slot

LOOPBACK = "127.0.0.1"
_PIPE_BYTES = 1 << 20


def widen_pipe(fd: int) -> None:
    """Give a pipe 1 MiB of buffer (Linux; 64 KiB by default): far fewer wake-ups for chatty workers."""
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_BYTES)
    except OSError:
        pass  # above /proc/sys/fs/pipe-max-size for this user, or not Linux: keep the default


class LocalWorker(Worker):
    """A worker started on this machine; its guard leads the worker's process group."""

    def __init__(self, slot: Slot, process: subprocess.Popen[bytes]) -> None:
        super().__init__(slot)
        self.process = process

    @property
    def pid(self) -> int:
        """Pid of the guard, which is also the id of the worker's process group."""
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def forward_signal(self, signum: int) -> bool:
        """Through the guard's lifeline: the guard passes it to the rank's processes, and survives it."""
        lifeline = self.process.stdin
        try:
            assert lifeline is not None
            lifeline.write(forward_byte(signum))
            lifeline.flush()
        except (OSError, ValueError):  # the guard is gone (or the pipe closed): nothing left to signal
            pass
        return True


class LocalLauncher(Launcher):
    """Runs each worker as ``python guard.py GRACE -- argv`` in a new session.

    The guard's stdin is a pipe that hvdrun never writes to and never closes: if hvdrun
    dies, even by SIGKILL, the kernel closes it and the guard kills the worker's group.
    """

    def endpoint(self, host: Host) -> Endpoint:
        """Every rank is on this machine: rank 0 is reached over loopback."""
        port, master_port = free_ports(2)
        return Endpoint(LOOPBACK, port, master_port)

    def spawn(self, spec: WorkerSpec, remove: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """Start ``spec`` under its guard, with piped stdout and stderr; the guard deletes the paths in
        ``remove`` (files or directories) when the command ends, however hvdrun ends."""
        extra = [word for path in remove for word in ("--remove", path)]
        argv = [sys.executable, GUARD_SCRIPT, str(self.grace_s), *guard_options(spec.env), *extra, "--", *spec.argv]
        try:
            process = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=spec.env, cwd=spec.cwd, start_new_session=True,
            )
        except OSError as e:
            raise LaunchError(f"cannot start rank {spec.slot.rank} on this machine: {e}") from e
        for pipe in (process.stdout, process.stderr):
            assert pipe is not None
            widen_pipe(pipe.fileno())
        return process

    def start(self, spec: WorkerSpec, router: OutputRouter) -> LocalWorker:
        process = self.spawn(spec)
        assert process.stdout is not None and process.stderr is not None
        router.attach(spec.slot.rank, "stdout", os.dup(process.stdout.fileno()))
        router.attach(spec.slot.rank, "stderr", os.dup(process.stderr.fileno()))
        process.stdout.close()
        process.stderr.close()
        return LocalWorker(spec.slot, process)
