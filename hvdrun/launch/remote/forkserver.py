"""One Python start per host instead of one per rank: a fork server that forks each rank's guard.

``python forkserver.py FD`` serves requests on the ``SOCK_SEQPACKET`` socket ``FD`` (its launcher's end is
:class:`ForkServer`: the local launcher spawns the server, a host agent forks it at its start,
:mod:`hvdrun.launch.remote.host_agent.main`). A request is one message, ``marshal((guard_argv, env, cwd))``, carrying
four file descriptors: the rank's lifeline (the guard's stdin), its stdout and stderr, and the guard's status pipe
(``guard.py --status-fd``: the rank's status comes back there, also when this server is gone). The server forks;
the child becomes that rank's guard exactly as ``python guard.py GUARD_ARGV`` would be (its own session, the
lifeline on its stdin, see ``guard.py``), without paying an interpreter start and the guard's imports again. Every
teardown guarantee is the guard's own: each rank keeps its own lifeline and process group; and when a guard
ends, even killed, the server SIGKILLs what is left of its process group (and its rank's cgroup) before it reaps
it: a guard killed by SIGKILL leaves no rank behind.

Answers, one message each: ``("started", request, pid)`` or ``("failed", request, why)`` per request, in order;
``("importing", request, module)`` before each module the first request preloads (the launcher bounds that wait by
the job's start timeout and names the module that did not come back); ``("exited", pid, returncode)`` when a guard
ends (returncode as :attr:`subprocess.Popen.returncode`: negative for a signal). The server is the parent of every
guard it started, so it alone can reap them and report their status. When the launcher's end closes (hvdrun ended
or was killed), the server exits; its guards then see their own lifelines end and stop their ranks. The kernel
kills the server when its launcher dies (``PR_SET_PDEATHSIG``), even in the middle of an import that would hold it
for minutes. When the server dies first (killed), the launcher says so at once (``on_gone``); its guards go on, and
their ranks' statuses still come back through their status pipes.
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

from hvdrun.errors import LaunchError, StartCancelled
from hvdrun.launch.remote import guard, proctitle, zygote
from hvdrun.launch.remote.escapees import kill_rank_cgroups, parent_death_killer
from hvdrun.launch.remote.inprocess import flush_standard_streams
from hvdrun.launch.remote.preload import preload

MAX_MESSAGE_BYTES = 8 << 20  # one request at most (the socket's send buffer bounds it further, see request())
ANSWER_BYTES = 4096  # one answer of the server
SOCKET_BUFFER_BYTES = 8 << 20
FDS_PER_REQUEST = 4
CANCEL_CHECK_S = 0.05  # how often a wait for the server's answer looks at its deadline and at a stop


def _send(sock: socket.socket, message: tuple[Any, ...]) -> None:
    try:
        sock.send(marshal.dumps(message))
    except OSError:
        pass  # the launcher is gone: nobody to tell


def _become_guard(sock: socket.socket, wakeup: tuple[int, int], fds: list[int], request: tuple[Any, ...]) -> None:
    """In the forked child: take the rank's descriptors as 0, 1, 2 (the status pipe stays where it is, named to
    the guard by ``--status-fd``) and run the guard; never returns."""
    code = 1
    try:
        os.setsid()  # first: the launcher may signal the guard's group as soon as it knows the pid
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in wakeup:
            os.close(fd)
        status = os.dup(fds[3])  # above 2: fds 0..2 are open in the server
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2 and fd != status:
                os.close(fd)
        guard_argv, env, cwd = request
        guard_argv = [guard_argv[0], "--status-fd", str(status), *guard_argv[1:]]
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        guard.main(list(guard_argv))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a guard must never fall back into the server's loop
        traceback.print_exc()
    finally:
        flush_standard_streams()
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
        # the first rank's environment: import what the ranks will import, once
        preload(guard.command_env(request[1]), lambda module: _send(sock, ("importing", number, module)))
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
    """Report every guard that ended, once what is left of its process group and its rank's cgroup is SIGKILLed
    (a guard killed before its rank ended leaves the rank's processes behind). The group is killed while the
    guard's zombie still holds its id: the id cannot be someone else's yet."""
    while True:
        try:
            ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if ended is None:
            return
        try:
            os.killpg(ended.si_pid, signal.SIGKILL)
        except OSError:
            pass  # the common case: the guard left nothing
        kill_rank_cgroups(ended.si_pid)
        _, status = os.waitpid(ended.si_pid, 0)
        _send(sock, ("exited", ended.si_pid, os.waitstatus_to_exitcode(status)))


def serve(fd: int, launcher: int | None = None) -> None:
    """Serve requests on socket ``fd`` until the launcher closes it, or until ``launcher`` (the pid of the parent
    that started this server: the kernel then kills it with that parent) dies."""
    if launcher is not None:
        parent_death_killer(launcher)()
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
    """Our ends of a requested guard's pipes: write to (or close) its lifeline, read its rank's output and its
    status pipe (see :class:`GuardStatus`)."""

    request: int
    lifeline: int
    stdout: int
    stderr: int
    status: int


class GuardStatus:
    """Our end of a guard's status pipe (``guard.py --status-fd``): the rank's status once the guard reports it.

    The guard alone holds the other end: an end of the pipe without a status means the guard died before its
    rank's end (killed), or failed before starting it.
    """

    def __init__(self, fd: int) -> None:
        self.fd, self.ended = fd, fd < 0
        self._data = b""
        if fd >= 0:
            os.set_blocking(fd, False)  # polled without select(): a launcher of hundreds of ranks has fds past 1024

    def read(self, block: bool = False) -> int | None:
        """The rank's status (negative: a signal), or None: not yet (or never: then :attr:`ended`).
        ``block``: wait for the guard's end."""
        while not self.ended:
            if block:
                waiter = select.poll()
                waiter.register(self.fd, select.POLLIN)
                waiter.poll()
            try:
                chunk = os.read(self.fd, 64)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            self._data += chunk
            if not chunk:
                self.close()
        head, newline, _ = self._data.partition(b"\n")
        return int(head) if newline and head.lstrip(b"-").isdigit() else None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.ended = True


def describe_status(returncode: int) -> str:
    """``exited with code 3`` or ``was killed by signal 9 (SIGKILL)`` (a :attr:`subprocess.Popen.returncode`)."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "?"
    return f"was killed by signal {-returncode} ({name})"


class ForkServer:
    """The launcher's end of a fork server: starts guards by fork, learns how they end.

    Make one with :meth:`spawn` (a fresh interpreter) or :meth:`fork` (this process, while it has one thread).

    Args:
        sock: our end of the server's socket.
        server: the server: our child (its process, or its pid), or a zygote's (``zygote.py``).
        where: the host, for error messages (``this machine``, ``h3``).
        on_exit: called with ``(pid, returncode)`` when a guard ends, from the thread that reads the answers.
        on_gone: called once with what happened (``hvdrun's fork server on h3 (pid 12) was killed by signal 9
            (SIGKILL)``) if the server ends before :meth:`close`, from that thread.
    """

    def __init__(self, sock: socket.socket, server: subprocess.Popen[bytes] | zygote.AdoptedServer | int,
                 where: str, on_exit: Callable[[int, int], None] | None = None,
                 on_gone: Callable[[str], None] | None = None) -> None:
        self._sock, self._server, self.where, self._on_exit = sock, server, where, on_exit
        self.on_gone = on_gone
        self._answers: dict[int, tuple[str, int | str]] = {}  # request -> ("started", pid) | ("failed", why)
        self.exited: dict[int, int] = {}  # pid -> returncode
        self.gone = False  # the server's end closed
        self.death = ""  # how the server died, when it ended before close()
        self._closing = False
        self.importing: tuple[str, float] | None = None  # (module, since when) while the server preloads it
        self._changed = threading.Condition()
        self._requests = 0
        threading.Thread(target=self._read_answers, name="hvdrun-forkserver", daemon=True).start()

    @classmethod
    def spawn(cls, where: str = "this machine", on_exit: Callable[[int, int], None] | None = None,
              on_gone: Callable[[str], None] | None = None, modules: Sequence[str] = ()) -> ForkServer:
        """Start the server as ``python forkserver.py FD`` in a session of its own (or have the zygote at
        ``HVDRUN_FORK_SERVER_FROM`` fork it, see ``zygote.py``; ``modules``: what its ranks want preloaded).

        Raises:
            LaunchError: it could not be started.
        """
        ours, theirs = _socket_pair()
        adopted = zygote.adopt(theirs, modules)
        if adopted is not None:
            theirs.close()
            return cls(ours, adopted, where, on_exit, on_gone)
        try:
            pad, pad_env = proctitle.room()  # what ps shows of a forked rank is written over these strings
            process = subprocess.Popen([sys.executable, __file__, str(theirs.fileno()), str(os.getpid()), pad],
                                       stdin=subprocess.DEVNULL, env={**os.environ, **pad_env},
                                       pass_fds=(theirs.fileno(),), start_new_session=True)
        except OSError as e:
            ours.close()
            raise LaunchError(f"cannot start hvdrun's fork server on {where}: {e}") from e
        finally:
            theirs.close()
        return cls(ours, process, where, on_exit, on_gone)

    @classmethod
    def fork(cls, where: str, on_exit: Callable[[int, int], None] | None = None,
             on_gone: Callable[[str], None] | None = None) -> ForkServer:
        """Fork this process into the server: no interpreter start. Call it before this process starts a thread
        (a fork copies only the calling thread, and the locks the others held). The server's standard streams
        become /dev/null: it holds nothing of ours open (an SSH channel would never end)."""
        ours, theirs = _socket_pair()
        launcher = os.getpid()
        pid = os.fork()
        if pid == 0:  # the server
            ours.close()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(null)
            try:
                serve(theirs.detach(), launcher)
            finally:
                os._exit(0)
        theirs.close()
        return cls(ours, pid, where, on_exit, on_gone)

    def request(self, guard_argv: Sequence[str], env: dict[str, str], cwd: str, fds: Sequence[int], rank: int) -> int:
        """Ask for a guard (``guard.py GUARD_ARGV`` in ``cwd`` with ``env``) with ``fds`` as its lifeline, stdout
        and stderr; the request's number.

        Raises:
            LaunchError: the request does not fit, or the server is gone.
        """
        message = marshal.dumps((list(guard_argv), env, cwd))
        try:
            fits = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) - 32  # a datagram: the kernel's bound
        except OSError as e:  # closed: the server was stopped
            raise LaunchError(f"cannot start rank {rank} on {self.where}: hvdrun's fork server was stopped") from e
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
        """Make the rank's lifeline, stdout, stderr and status pipes and ask for its guard with their far ends
        (closed here once sent); our ends come back.

        Raises:
            LaunchError: as :meth:`request` (our ends are closed then too).
        """
        lifeline_read, lifeline = os.pipe()
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        status_read, status_write = os.pipe()
        try:
            request = self.request(guard_argv, env, cwd, (lifeline_read, out_write, err_write, status_write), rank)
        except BaseException:
            for fd in (lifeline, out_read, err_read, status_read):
                os.close(fd)
            raise
        finally:
            for fd in (lifeline_read, out_write, err_write, status_write):
                os.close(fd)
        return GuardPipes(request, lifeline, out_read, err_read, status_read)

    def pid_of(self, request: int, rank: int, deadline: float | None = None,
               cancelled: Callable[[], bool] = lambda: False) -> int:
        """The pid of the guard started for ``request`` (waits for the server's answer until the monotonic
        ``deadline``, looking at ``cancelled`` every :data:`CANCEL_CHECK_S`: a flag a signal handler may set).

        Raises:
            StartCancelled: ``cancelled()`` said so first.
            LaunchError: the server could not fork it, is gone, or did not answer by ``deadline`` (the server is
                killed then: it is stuck, most likely in a preloaded module's import, which the error names).
        """
        with self._changed:
            while not self._changed.wait_for(lambda: request in self._answers or self.gone, CANCEL_CHECK_S):
                if cancelled():
                    raise StartCancelled(f"the start of rank {rank} on {self.where} was cancelled")
                if deadline is not None and time.monotonic() > deadline:
                    raise LaunchError(self._overdue(rank, deadline))
            answer = self._answers.get(request)
        if answer is None or answer[0] != "started":
            why = answer[1] if answer is not None else "it ended"
            if self.death:
                why = f"it {self.death.split(') ', 1)[1]} earlier; no new rank can start on {self.where}"
            raise LaunchError(f"cannot start rank {rank} on {self.where}: hvdrun's fork server: {why}")
        return int(answer[1])

    def _overdue(self, rank: int, deadline: float) -> str:
        """Why the start of ``rank`` is past ``deadline`` (the server is killed on the way out: see :meth:`close`)."""
        start = f"cannot start rank {rank} on {self.where}: hvdrun's fork server"
        if self.importing is None:
            return f"{start} did not answer within the job's start timeout (--start-timeout); stopped it"
        module, since = self.importing
        return (f"{start} has been importing '{module}' for {time.monotonic() - since:.1f} s (it preloads it "
                "for the ranks, --preload), past the job's start timeout (--start-timeout); stopped it "
                "(--preload none starts the ranks without it)")

    def _read_answers(self) -> None:
        while True:
            try:
                data = self._sock.recv(ANSWER_BYTES)
            except OSError:
                data = b""
            if not data:
                self._went()
                return
            with self._changed:
                kind, key, value = marshal.loads(data)
                if kind == "exited":
                    self.exited[key] = value
                elif kind == "importing":
                    self.importing = (value, time.monotonic())
                else:
                    self.importing = None
                    self._answers[key] = (kind, value)
                    if kind == "started":  # a pid used again (pids wrap in long jobs): its old end is not this one
                        self.exited.pop(value, None)
                self._changed.notify_all()
            if kind == "exited" and self._on_exit is not None:
                self._on_exit(key, value)

    def _went(self) -> None:
        """The server's end closed: by :meth:`close`, or the server died (then named through ``on_gone``)."""
        death = "" if self._closing else f"hvdrun's fork server on {self.where} (pid {self.pid}) {self._end()}"
        with self._changed:
            self.gone, self.death = True, death
            self._changed.notify_all()
        if death and self.on_gone is not None:
            self.on_gone(death)

    @property
    def pid(self) -> int:
        """The server's pid."""
        return self._server if isinstance(self._server, int) else self._server.pid

    def _end(self, wait_s: float = 2.0) -> str:
        """How the server ended, as :func:`describe_status` says it (its socket closes just before it ends)."""
        if not isinstance(self._server, int):
            try:
                return describe_status(self._server.wait(wait_s))
            except subprocess.TimeoutExpired:
                return "closed its socket"
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                pid, status = os.waitpid(self._server, os.WNOHANG)
            except ChildProcessError:
                return "ended"
            if pid:
                return describe_status(os.waitstatus_to_exitcode(status))
            time.sleep(0.01)
        return "closed its socket"

    def close(self) -> None:
        """Let the server go (its guards stay with their lifelines) and reap it. A server that has not answered
        every request (stuck in a preload's import, or about to fork guards nobody will take) is killed at once:
        no guard starts after this."""
        self._closing = True
        with self._changed:
            pending = len(self._answers) < self._requests and not self.gone
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes our reader; a plain close would wait for its recv()
        except OSError:
            pass
        self._sock.close()
        if isinstance(self._server, int):
            _reap_child(self._server, 0.0 if pending else 5.0)
            return
        try:
            self._server.wait(0.0 if pending else 5.0)
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
    serve(int(sys.argv[1]), int(sys.argv[2]))
