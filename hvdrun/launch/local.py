"""Start workers on this machine, each under its own guard process (see ``remote/guard.py``).

The guards are forked by one fork server per job (``remote/forkserver.py``): one Python start for the
host instead of one per rank, every guard still its rank's own process with its own lifeline. A rank's status
comes from its guard's status pipe; a guard that ends without reporting one was killed (its rank with it:
the rank's parent-death signal and the fork server), and the rank's failure names the guard's death. A fork
server that dies is named at once; the running ranks go on, and a restart starts a new server.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

from hvdrun.envvars import guard_options, start_timeout_s
from hvdrun.errors import LaunchError, StartCancelled
from hvdrun.hosts import Host
from hvdrun.launch.launcher import GUARD_SCRIPT, Endpoint, Launcher, Worker, WorkerSpec
from hvdrun.launch.output import OutputRouter
from hvdrun.launch.remote.forkserver import ForkServer, GuardPipes, GuardStatus, describe_status
from hvdrun.launch.remote.guard import forward_byte
from hvdrun.launch.remote.hostfacts import free_ports
from hvdrun.launch.remote.preload import wanted_modules
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


class ForkedWorker(Worker):
    """A worker whose guard the fork server started; its guard leads the worker's process group."""

    def __init__(self, slot: Slot, pid: int, server: ForkServer, lifeline: int, status: int) -> None:
        super().__init__(slot)
        self.pid, self._server, self._lifeline = pid, server, lifeline
        self._status = GuardStatus(status)
        self._ended: int | None = None
        self._note = ""

    def poll(self) -> int | None:
        if self._ended is None:
            reported = self._status.read()
            self._ended = reported if reported is not None else self._guard_end()
        if self._ended is not None and self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        return self._ended

    def _guard_end(self) -> int | None:
        """The guard ended without reporting its rank's status (killed, or it could not start the rank): its own
        status, as the fork server reports it; None while the guard lives or that report is on its way."""
        if not self._status.ended:
            return None
        status = self._server.exited.get(self.pid)
        if status is None and not self._server.gone:
            return None
        if status is None:
            self._note = (f"lost its guard (pid {self.pid}), which ended without reporting the rank's status while "
                          "hvdrun's fork server that reports the guard's own was gone; its rank was stopped")
            return 1
        if status < 0:
            self._note = f"lost its guard: the guard (pid {self.pid}) {describe_status(status)}; its rank was stopped"
        return status

    def failure_note(self) -> str:
        return self._note

    def signal_group(self, signum: int) -> None:
        if self._status.ended or self.pid in self._server.exited:
            return  # the guard ended: the fork server killed what it left; the pid may already be someone else's
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def forward_signal(self, signum: int) -> bool:
        """Through the guard's lifeline: the guard passes it to the rank's processes, and survives it."""
        if self._lifeline >= 0:
            try:
                os.write(self._lifeline, forward_byte(signum))
            except OSError:  # the guard is gone: nothing left to signal
                pass
        return True


class LocalLauncher(Launcher):
    """Runs each worker under its own guard (``guard.py GRACE -- argv``, in a session of its own), forked by the
    job's fork server.

    The guard's stdin is its lifeline, a pipe hvdrun writes only signal bytes to and closes only once the guard
    ended: if hvdrun dies, even by SIGKILL, the kernel closes it and the guard kills the worker's group.
    """

    def __init__(self, grace_s: float) -> None:
        super().__init__(grace_s)
        self._server: ForkServer | None = None

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

    def start(self, spec: WorkerSpec, router: OutputRouter) -> Worker:
        return next(self.start_all([spec], router))

    def start_all(self, specs: Sequence[WorkerSpec], router: OutputRouter) -> Iterator[Worker]:
        """Ask the fork server for every rank's guard at once, then yield the workers in order."""
        if self._server is not None and self._server.gone:  # it died (named then): a restart starts a new one
            self._server.close()
            self._server = None
        if self._server is None:
            self._server = ForkServer.spawn(on_gone=lambda death: router.say(
                f"hvdrun: warning: {death}; the running ranks go on (their guards report how they end)"),
                modules=wanted_modules(specs[0].env) if specs else ())
        server = self._server
        requested: list[tuple[WorkerSpec, GuardPipes]] = []
        try:
            for spec in specs:
                if self.starts_cancelled:
                    raise StartCancelled("the job's stop cancelled the ranks' start")
                if not os.path.isdir(spec.cwd):
                    raise LaunchError(f"cannot start rank {spec.slot.rank} on this machine: its working directory "
                                      f"{spec.cwd} does not exist")
                argv = [str(self.grace_s), *guard_options(spec.env), "--", *spec.argv]
                pipes = server.start_guard(argv, dict(spec.env), spec.cwd, spec.slot.rank)
                requested.append((spec, pipes))
                for stream, fd in (("stdout", pipes.stdout), ("stderr", pipes.stderr)):
                    widen_pipe(fd)
                    router.attach(spec.slot.rank, stream, fd)
            deadline = time.monotonic() + start_timeout_s(specs[0].env) if specs else None
            for handed, (spec, pipes) in enumerate(requested):
                pid = server.pid_of(pipes.request, spec.slot.rank, deadline, lambda: self.starts_cancelled)
                worker = ForkedWorker(spec.slot, pid, server, pipes.lifeline, pipes.status)
                requested[handed] = (spec, replace(pipes, lifeline=-1, status=-1))  # the worker's now
                yield worker
        finally:  # a failed or abandoned start: the guards not handed out see their lifelines end and stop
            abandoned = False
            for _, pipes in requested:
                for fd in (pipes.lifeline, pipes.status):
                    if fd >= 0:
                        abandoned = True
                        os.close(fd)
            if abandoned:  # requests still in flight: the server is killed before it forks them (close() does)
                self.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
