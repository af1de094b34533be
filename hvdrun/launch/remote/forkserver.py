"""One Python start per host instead of one per rank: a fork server that forks each rank's guard.

``python forkserver.py FD`` serves requests on the ``SOCK_SEQPACKET`` socket ``FD`` (its launcher's end is
:class:`ForkServer`: the local launcher spawns the server, a host agent forks it at its start,
:mod:`hvdrun.launch.remote.host_agent.main`). A request is one message, ``marshal((guard_argv, env, cwd))``, carrying
three file descriptors: the rank's lifeline (the guard's stdin) and its stdout and stderr. The server forks; the
child becomes that rank's guard exactly as ``python guard.py GUARD_ARGV`` would be (its own session, the lifeline
on its stdin, see ``guard.py``), without paying an interpreter start and the guard's imports again. Every
teardown guarantee is the guard's own: each rank keeps its own lifeline and process group.

Answers, one message each: ``("started", request, pid)`` or ``("failed", request, why)`` per request, in order;
``("exited", pid, returncode)`` when a guard ends (returncode as :attr:`subprocess.Popen.returncode`: negative for
a signal). The server is the parent of every guard it started, so it alone can reap them and report their status.
When the launcher's end closes (hvdrun ended or was killed), the server exits; its guards then see their own
lifelines end and stop their ranks.
"""

from __future__ import annotations

import marshal
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hvdrun.errors import LaunchError
from hvdrun.launch.remote.escapees import reap_children

MAX_MESSAGE_BYTES = 8 << 20  # one request at most (the socket's send buffer bounds it further, see request())
ANSWER_BYTES = 4096  # one answer of the server
SOCKET_BUFFER_BYTES = 8 << 20
FDS_PER_REQUEST = 3


def _send(sock: socket.socket, message: tuple[Any, ...]) -> None:
    try:
        sock.send(marshal.dumps(message))
    except OSError:
        pass  # the launcher is gone: nobody to tell


def _become_guard(sock: socket.socket, wakeup: tuple[int, int], fds: list[int], request: tuple[Any, ...]) -> None:
    """In the forked child: take the rank's descriptors as 0, 1, 2 and run the guard; never returns."""
    code = 1
    try:
        os.setsid()  # first: the launcher may signal the guard's group as soon as it knows the pid
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in wakeup:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        guard_argv, env, cwd = request
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        from hvdrun.launch.remote import guard  # noqa: PLC0415 - already imported by the server: no cost

        guard.main(list(guard_argv))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a guard must never fall back into the server's loop
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _serve_request(sock: socket.socket, wakeup: tuple[int, int], number: int) -> bool:
    """Receive one request and fork its guard; False when the launcher's end closed."""
    try:
        limit = min(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF), MAX_MESSAGE_BYTES)
        data, fds, _flags, _addr = socket.recv_fds(sock, limit, FDS_PER_REQUEST)
    except OSError:
        return False
    if not data:
        return False
    try:
        if len(fds) != FDS_PER_REQUEST:
            raise ValueError(f"expected {FDS_PER_REQUEST} file descriptors, got {len(fds)}")
        request = marshal.loads(data)
        pid = os.fork()
    except (OSError, ValueError, EOFError, TypeError) as e:
        _send(sock, ("failed", number, str(e)))
    else:
        if pid == 0:
            _become_guard(sock, wakeup, fds, request)
        _send(sock, ("started", number, pid))
    for fd in fds:
        os.close(fd)
    return True


def _reap(sock: socket.socket) -> None:
    """Report every guard that ended."""
    reap_children(lambda pid, status: _send(sock, ("exited", pid, os.waitstatus_to_exitcode(status))))


def serve(fd: int) -> None:
    """Serve requests on socket ``fd`` until the launcher closes it."""
    from hvdrun.launch.remote import guard  # noqa: F401, PLC0415 - imported once here, inherited by every fork

    sock = socket.socket(fileno=fd)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    number = 0
    while True:
        waiting: list[Any] = [sock, wake_read]
        ready, _, _ = select.select(waiting, [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
        _reap(sock)
        if sock in ready:
            if not _serve_request(sock, (wake_read, wake_write), number):
                return
            number += 1


def _socket_pair() -> tuple[socket.socket, socket.socket]:
    pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for sock in pair:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    return pair


@dataclass(frozen=True)
class GuardPipes:
    """Our ends of a requested guard's pipes: write to (or close) its lifeline, read its rank's output."""

    request: int
    lifeline: int
    stdout: int
    stderr: int


class ForkServer:
    """The launcher's end of a fork server: starts guards by fork, learns how they end.

    Make one with :meth:`spawn` (a fresh interpreter) or :meth:`fork` (this process, while it has one thread).

    Args:
        sock: our end of the server's socket.
        server: the server, our child: its process, or its pid.
        where: the host, for error messages (``this machine``, ``h3``).
        on_exit: called with ``(pid, returncode)`` when a guard ends, from the thread that reads the answers.
    """

    def __init__(self, sock: socket.socket, server: subprocess.Popen[bytes] | int, where: str,
                 on_exit: Callable[[int, int], None] | None = None) -> None:
        self._sock, self._server, self.where, self._on_exit = sock, server, where, on_exit
        self._answers: dict[int, tuple[str, int | str]] = {}  # request -> ("started", pid) | ("failed", why)
        self.exited: dict[int, int] = {}  # pid -> returncode
        self.gone = False  # the server's end closed
        self._changed = threading.Condition()
        self._requests = 0
        threading.Thread(target=self._read_answers, name="hvdrun-forkserver", daemon=True).start()

    @classmethod
    def spawn(cls, where: str = "this machine", on_exit: Callable[[int, int], None] | None = None) -> ForkServer:
        """Start the server as ``python forkserver.py FD`` in a session of its own.

        Raises:
            LaunchError: it could not be started.
        """
        ours, theirs = _socket_pair()
        try:
            process = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], stdin=subprocess.DEVNULL,
                                       pass_fds=(theirs.fileno(),), start_new_session=True)
        except OSError as e:
            ours.close()
            raise LaunchError(f"cannot start hvdrun's fork server on {where}: {e}") from e
        finally:
            theirs.close()
        return cls(ours, process, where, on_exit)

    @classmethod
    def fork(cls, where: str, on_exit: Callable[[int, int], None] | None = None) -> ForkServer:
        """Fork this process into the server: no interpreter start. Call it before this process starts a thread
        (a fork copies only the calling thread, and the locks the others held). The server's standard streams
        become /dev/null: it holds nothing of ours open (an SSH channel would never end)."""
        ours, theirs = _socket_pair()
        pid = os.fork()
        if pid == 0:  # the server
            ours.close()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(null)
            try:
                serve(theirs.detach())
            finally:
                os._exit(0)
        theirs.close()
        return cls(ours, pid, where, on_exit)

    def request(self, guard_argv: Sequence[str], env: dict[str, str], cwd: str, fds: Sequence[int], rank: int) -> int:
        """Ask for a guard (``guard.py GUARD_ARGV`` in ``cwd`` with ``env``) with ``fds`` as its lifeline, stdout
        and stderr; the request's number.

        Raises:
            LaunchError: the request does not fit, or the server is gone.
        """
        message = marshal.dumps((list(guard_argv), env, cwd))
        fits = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) - 32  # a datagram: the kernel's bound
        if len(message) > fits:
            raise LaunchError(f"cannot start rank {rank} on {self.where}: its command and environment take "
                              f"{len(message)} bytes; at most {fits} fit (leave large values out of the environment)")
        try:
            socket.send_fds(self._sock, [message], list(fds))
        except OSError as e:
            raise LaunchError(f"cannot start rank {rank} on {self.where}: hvdrun's fork server: {e}") from e
        self._requests += 1
        return self._requests - 1

    def start_guard(self, guard_argv: Sequence[str], env: dict[str, str], cwd: str, rank: int) -> GuardPipes:
        """Make the rank's lifeline, stdout and stderr pipes and ask for its guard with their far ends (closed here
        once sent); our ends come back.

        Raises:
            LaunchError: as :meth:`request` (our ends are closed then too).
        """
        lifeline_read, lifeline = os.pipe()
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        try:
            request = self.request(guard_argv, env, cwd, (lifeline_read, out_write, err_write), rank)
        except LaunchError:
            for fd in (lifeline, out_read, err_read):
                os.close(fd)
            raise
        finally:
            for fd in (lifeline_read, out_write, err_write):
                os.close(fd)
        return GuardPipes(request, lifeline, out_read, err_read)

    def pid_of(self, request: int, rank: int) -> int:
        """The pid of the guard started for ``request`` (waits for the server's answer).

        Raises:
            LaunchError: the server could not fork it, or is gone.
        """
        with self._changed:
            self._changed.wait_for(lambda: request in self._answers or self.gone)
            answer = self._answers.get(request)
        if answer is None or answer[0] != "started":
            why = answer[1] if answer is not None else "it ended"
            raise LaunchError(f"cannot start rank {rank} on {self.where}: hvdrun's fork server: {why}")
        return int(answer[1])

    def _read_answers(self) -> None:
        while True:
            try:
                data = self._sock.recv(ANSWER_BYTES)
            except OSError:
                data = b""
            with self._changed:
                if not data:
                    self.gone = True
                    self._changed.notify_all()
                    return
                kind, key, value = marshal.loads(data)
                if kind == "exited":
                    self.exited[key] = value
                else:
                    self._answers[key] = (kind, value)
                    if kind == "started":  # a pid used again (pids wrap in long jobs): its old end is not this one
                        self.exited.pop(value, None)
                self._changed.notify_all()
            if kind == "exited" and self._on_exit is not None:
                self._on_exit(key, value)

    def close(self) -> None:
        """Let the server go (its guards stay with their lifelines) and reap it."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes our reader; a plain close would wait for its recv()
        except OSError:
            pass
        self._sock.close()
        if isinstance(self._server, int):
            _reap_child(self._server)
            return
        try:
            self._server.wait(5)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()


def _reap_child(pid: int, timeout_s: float = 5.0) -> None:
    """Wait up to ``timeout_s`` for our child ``pid`` to end, SIGKILL it then, and reap it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        time.sleep(0.01)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


if __name__ == "__main__":
    serve(int(sys.argv[1]))
