"""One Python start per host instead of one per rank: a fork server that forks each rank's guard.

``python forkserver.py FD`` serves requests on the ``SOCK_SEQPACKET`` socket ``FD`` (its launcher's end is
:class:`hvdrun.launch.local.ForkServer`). A request is one message, ``marshal((guard_argv, env, cwd))``, carrying
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
import sys
import traceback
from typing import Any

MAX_MESSAGE_BYTES = 8 << 20  # one request: a rank's argv and environment
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
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE_BYTES, FDS_PER_REQUEST)
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
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, ("exited", pid, os.waitstatus_to_exitcode(status)))


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
        ready, _, _ = select.select([sock, wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
        _reap(sock)
        if sock in ready:
            if not _serve_request(sock, (wake_read, wake_write), number):
                return
            number += 1


if __name__ == "__main__":
    serve(int(sys.argv[1]))
