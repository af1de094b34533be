"""Ranks that ``spawn_ranks`` starts, forked from one process per pytest worker that imported torch once.

A rank started as ``python script.py`` spends about 2 CPU-s importing torch before it does anything; the suite
starts hundreds of them. hvdrun's own launchers start ranks by fork from a preloaded fork server
(``hvdrun/launch/remote/preload.py``); this is the same for the ranks the tests start without a launcher: a
server (``python tests/zygote.py SOCKET PAD``) imports numpy and torch once, and for each request forks a child
that runs the rank's command as a new interpreter would, through the preload's own ``start`` (fresh streams,
signals, environment; its command line and environment shown in ``/proc``). :class:`Zygote` asks for a rank and
gets a :class:`ForkedRank`, which behaves as the :class:`subprocess.Popen` the tests used before (``pid``,
``poll``, ``wait``, ``kill``, ``communicate``, ``returncode``). A request whose command or environment a fresh
interpreter would start otherwise (another Python, an interpreter option, ``PYTHON*``/``LD_*`` variables) is
refused, and the caller starts the rank the ordinary way.

It also forks the fork servers of hvdrun's local jobs (``hvdrun/launch/remote/zygote.py``): a job whose ranks
want ``torch._dynamo`` preloaded too (a script that builds an optimizer) gets its server from the zygote's
template, a child that imported it as well (:class:`_Template`), never one with a module its ranks did not ask
for.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Sequence
from pathlib import Path

from hvdrun.launch.remote.zygote import FORK_SERVER, HEADER_BYTES, ask_for_pid

_IGNORED = {"PYTEST_CURRENT_TEST"}  # set per test by pytest; no import reads it
# families of variables that torch, numpy, their thread pools or the interpreter read when they load: one a test
# adds keeps a job's fork server from the zygote; any other it adds is a parameter its workers read after start-up
_READ_AT_IMPORT = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "NUMPY_", "CUDA_", "LD_",
                   "PYTHON", "MALLOC_", "LC_", "LANG")


_BASE = ("numpy", "torch")  # what the zygote imports
# what a job whose script builds an optimizer preloads beyond them (1.9 CPU-s): its fork server is forked by the
# zygote's template, a child that imported these too (see _Template)
_FULL = ("torch._dynamo",)


class ForkedRank:
    """A rank forked by the zygote: the parts of :class:`subprocess.Popen` the tests use."""

    def __init__(self, args: Sequence[str], pid: int, control: socket.socket, pending: bytes, stdout: int,
                 stderr: int) -> None:
        self.args, self.pid, self.returncode = list(args), pid, None
        self._control, self._pending = control, pending  # pending: what came after the pid line
        self.stdout = open(stdout, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed by communicate
        self.stderr = open(stderr, encoding="utf-8", errors="replace")  # noqa: SIM115
        self._readers: list[threading.Thread] = []
        self._output: dict[str, str] = {}

    def _collect(self, timeout: float | None) -> int | None:
        """The exit status the zygote sends once it reaped the rank; None if it did not come within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None and b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._control], [], [], left)[0]:
                return None
            chunk = self._control.recv(64)
            if not chunk:
                raise RuntimeError(f"the zygote ended before rank pid {self.pid} did")
            self._pending += chunk
        if self.returncode is None:
            self.returncode = int(self._pending.split(b"\n", 1)[0].split()[1])
            self._control.close()
        return self.returncode

    def poll(self) -> int | None:
        """The rank's exit status, or None while it runs."""
        return self._collect(0)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the rank's end (:class:`subprocess.TimeoutExpired` after ``timeout`` seconds)."""
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, signum: int) -> None:
        """Signal the rank unless it already ended."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL, as :meth:`subprocess.Popen.kill`."""
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM, as :meth:`subprocess.Popen.terminate`."""
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Everything the rank wrote to stdout and stderr, once it ended (as :meth:`subprocess.Popen.communicate`;
        it may be called again after a :class:`subprocess.TimeoutExpired`)."""
        if not self._readers:
            for name in ("stdout", "stderr"):
                reader = threading.Thread(target=self._read_all, args=(name,), daemon=True)
                reader.start()
                self._readers.append(reader)
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._output["stdout"], self._output["stderr"]

    def _read_all(self, name: str) -> None:
        stream = getattr(self, name)
        with stream:
            self._output[name] = stream.read()


class Zygote:
    """The client of one zygote server (see the module's doc)."""

    def __init__(self, path: Path, pid: int) -> None:
        self.path, self.pid = path, pid

    @classmethod
    def start(cls, path: Path, timeout_s: float = 120) -> Zygote:
        """Start a server at ``path`` and wait until it imported torch and listens. The server is no child of
        this process (it forks away at once): a test that makes this process a subreaper and looks at its
        children sees only its own."""
        from hvdrun.launch.remote import proctitle

        for stale in (path, _pid_file(path)):
            stale.unlink(missing_ok=True)
        pad, pad_env = proctitle.room()  # what /proc shows of a rank is written over these strings
        subprocess.run([sys.executable, __file__, str(path), str(os.getpid()), pad], stdin=subprocess.DEVNULL,
                       env={**os.environ, **pad_env, "OMP_NUM_THREADS": "1"}, start_new_session=True, check=True)
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the zygote did not start within {timeout_s} s")
            time.sleep(0.05)
        return cls(path, int(_pid_file(path).read_text()))

    def stop(self) -> None:
        """End the server (ranks it forked are the tests' to end)."""
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        for stale in (self.path, _pid_file(self.path)):
            stale.unlink(missing_ok=True)

    def spawn(self, command: Sequence[str], env: dict[str, str], cwd: str | os.PathLike[str],
              job_names: Collection[str] = ()) -> ForkedRank | None:
        """Fork ``command`` (``python [-u] SCRIPT ...``) with ``env`` in ``cwd``; None if the zygote cannot run it
        as a new interpreter would (start it the ordinary way then). ``job_names``: the variables of ``env`` that
        hvdrun's launcher would set for the job (``envvars.worker_env``), read after start-up, never at import."""
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        try:
            answer = ask_for_pid(str(self.path), {"command": list(command), "env": env, "cwd": str(cwd),
                                                  "job_names": sorted(job_names)}, [out_write, err_write])
        finally:
            os.close(out_write)
            os.close(err_write)
        if answer is None:
            os.close(out_read)
            os.close(err_read)
            return None
        pid, control, pending = answer
        return ForkedRank(command, pid, control, pending, out_read, err_read)


# -- the server -------------------------------------------------------------------------------------------


def _pid_file(path: Path) -> Path:
    return path.with_name(path.name + ".pid")


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, HEADER_BYTES, 3)
    while len(header) < HEADER_BYTES:
        header += conn.recv(HEADER_BYTES - len(header))
    length, payload = int.from_bytes(header, "big"), b""
    while len(payload) < length:
        chunk = conn.recv(length - len(payload))
        if not chunk:
            raise OSError("request cut short")
        payload += chunk
    return json.loads(payload), fds


def _fork(request: dict, fds: list[int], imported_under: dict[str, str]) -> int | str:
    """The forked rank's pid, or why it cannot be forked: hvdrun's own verdict (``preload.why_not``), on the
    request's environment with the variables no import reads (the job's, pytest's) taken as imported."""
    from hvdrun.launch.remote import preload

    command, env = request["command"], request["env"]
    exempt = _IGNORED | set(request["job_names"])
    compared = {name: value for name, value in env.items() if name not in exempt}
    compared.update({name: imported_under[name] for name in exempt if name in imported_under})
    parsed = preload.why_not(command, compared, bound=False)
    if isinstance(parsed, str):
        return parsed

    def prepare() -> None:
        signal.set_wakeup_fd(-1)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        os.chdir(request["cwd"])

    return preload.start(command, parsed, env, (), prepare).pid


def _fork_server(request: dict, fds: list[int], imported_under: dict[str, str],
                 modules: tuple[str, ...] = _BASE) -> int | str:
    """Fork a child that becomes a job's local fork server (``hvdrun/launch/remote/zygote.py``): in a session of
    its own, with the launcher's environment, working directory, stdout and stderr, shown in /proc as ``python
    forkserver.py FD``, its preload taken as this process's (with pytest's variables and those the test added as
    the launcher's, see ``_READ_AT_IMPORT``). Its pid, or why not: the launcher's environment differs from the one
    torch was imported under here, so the ranks would start as new interpreters; hvdrun then spawns a server that
    imports torch under the job's environment."""
    from hvdrun.envvars import OMP_NUM_THREADS
    from hvdrun.launch.remote import forkserver, preload, proctitle

    env = request["env"]
    imported = {name: value for name, value in imported_under.items() if name not in _IGNORED}
    imported.update({name: env[name] for name in _IGNORED if name in env})
    imported.update({name: value for name, value in env.items()  # a test's parameters to its workers
                     if name not in imported_under and not name.startswith(_READ_AT_IMPORT)})
    launcher = dict(env)
    if OMP_NUM_THREADS in imported:  # hvdrun sets each rank's unless the launcher has one: the server compares those
        launcher.setdefault(OMP_NUM_THREADS, imported[OMP_NUM_THREADS])
    different = preload.environment_difference(launcher, imported)
    if different:  # the job's ranks could not be forked from what this process imported: hvdrun spawns its own
        return f"environment differs from the zygote's: {', '.join(different[:5])}"
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: never returns
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock, out, err = fds
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
        os.closerange(3, sock)
        os.closerange(sock + 1, _open_limit())
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(env)
        preload.adopt(modules, imported)
        proctitle.show_as([sys.executable, forkserver.__file__, str(sock)], env)
        forkserver.serve(sock)
    finally:
        os._exit(0)


class _Template:
    """A child of the zygote that also imported :data:`_FULL`: it forks the fork servers of jobs whose ranks want
    those preloaded, so that each such job does not import them again. The zygote hands it a request with its
    descriptors and relays the answers; ``pid N`` or ``refused WHY`` comes back, later ``exit PID CODE``."""

    def __init__(self, imported_under: dict[str, str]) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for end in (self.sock, theirs):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        self.pid = os.fork()
        if self.pid == 0:
            try:
                self.sock.close()
                _serve_template(theirs, imported_under)
            finally:
                os._exit(0)
        theirs.close()
        self.relayed: dict[int, socket.socket] = {}  # pid of a server it forked -> the client's connection
        self.ended = False

    def wants(self, request: dict) -> bool:
        """The request's ranks want every module of :data:`_FULL` preloaded (a rank must not find a module
        imported that a new interpreter would not have), and the template still serves; the server imports any
        other module they want itself."""
        return not self.ended and set(_FULL) <= set(request.get("modules", ()))

    def fork_server(self, request: dict, fds: list[int]) -> int | str:
        """Have the template fork the server; its pid or why not."""
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            while True:
                words = self._message(0)
                if words is None:
                    return "the template ended"
                if words[0] != "exit":
                    return int(words[1]) if words[0] == "pid" else words[-1]
                self._relay_exit(words[1])
        except (OSError, ValueError, IndexError) as e:
            return f"the template failed: {e}"

    def relay(self) -> None:
        """Pass on every end of a server the template reported (the zygote's loop calls it while :attr:`ended`
        is False: the template's socket is readable)."""
        try:
            while (words := self._message(socket.MSG_DONTWAIT)) is not None:
                if words[0] == "exit":
                    self._relay_exit(words[1])
        except BlockingIOError:
            return

    def _message(self, flags: int) -> list[str] | None:
        """The template's next message, split in its word and the rest; None once it ended (then every client
        whose server it forked is told by the end of its connection, as by a zygote that ended)."""
        data = self.sock.recv(1 << 16, flags)
        if data:
            return data.decode().split(" ", 1)
        self.ended = True
        for conn in self.relayed.values():
            conn.close()
        self.relayed.clear()
        return None

    def _relay_exit(self, text: str) -> None:
        pid, code = text.split()
        _report_exit(self.relayed.pop(int(pid), None), int(code))


def _serve_template(sock: socket.socket, imported_under: dict[str, str]) -> None:
    """The template's life: import :data:`_FULL`, then fork a server for each request until the zygote ends."""
    import gc
    import importlib

    for module in _FULL:
        importlib.import_module(module)
    gc.freeze()
    wake_read = _wake_on_child_end()
    while True:
        ready = select.select([sock, wake_read], [], [])[0]
        if wake_read in ready:
            _drain(wake_read)
            for pid, code in _ended_children():
                sock.send(f"exit {pid} {code}".encode())
        if sock in ready:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 22, 3)
            if not data:
                return  # the zygote ended
            try:
                forked = _fork_server(json.loads(data), fds, imported_under, (*_BASE, *_FULL))
            finally:
                for fd in fds:
                    os.close(fd)
            sock.send((f"pid {forked}" if isinstance(forked, int) else f"refused {forked}").encode())


def _wake_on_child_end() -> int:
    """A pipe that SIGCHLD writes to (for select); its read end."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return wake_read


def _drain(fd: int) -> None:
    """Read everything ``fd`` (non-blocking) holds."""
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _ended_children() -> list[tuple[int, int]]:
    """(pid, exit code) of every child that ended, reaped."""
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, os.waitstatus_to_exitcode(status)))


def _answer(conn: socket.socket, children: dict[int, socket.socket], imported_under: dict[str, str],
            template: _Template) -> None:
    fds: list[int] = []
    try:
        request, fds = _receive(conn)
        if request.get("kind") == FORK_SERVER and len(fds) != 3:
            forked: int | str = "no socket, stdout and stderr"
        elif request.get("kind") == FORK_SERVER and template.wants(request):
            forked = template.fork_server(request, fds)
            if isinstance(forked, int):
                template.relayed[forked] = conn
        elif request.get("kind") == FORK_SERVER:
            forked = _fork_server(request, fds, imported_under)
        else:
            forked = _fork(request, fds, imported_under) if len(fds) == 2 else "no stdout and stderr"
    except (OSError, ValueError, KeyError, IndexError) as e:
        forked = f"bad request: {e}"
    finally:
        for fd in fds:
            os.close(fd)
    try:
        if isinstance(forked, int):
            if forked not in template.relayed:
                children[forked] = conn
            conn.sendall(f"pid {forked}\n".encode())
        else:
            conn.sendall(f"refused {forked}\n".encode())
            conn.close()
    except OSError:
        pass


def _open_limit() -> int:
    """One past the highest descriptor this process may have open."""
    limit = os.sysconf("SC_OPEN_MAX")
    return limit if limit > 0 else 1 << 16


def _reap(children: dict[int, socket.socket]) -> None:
    for pid, code in _ended_children():
        _report_exit(children.pop(pid, None), code)


def _report_exit(conn: socket.socket | None, code: int) -> None:
    """Tell the client on ``conn`` (if any) that what it asked for ended with ``code``, and close it."""
    if conn is None:
        return
    try:
        conn.sendall(f"exit {code}\n".encode())
    except OSError:
        pass
    conn.close()


def serve(path: str, client_pid: int) -> None:
    """Import torch, then fork a rank for each request on the Unix socket at ``path`` until SIGTERM or the end of
    the process ``client_pid``."""
    if os.fork():
        os._exit(0)  # away from the client: the server's parent becomes init
    client = os.pidfd_open(client_pid)
    from hvdrun.envvars import PRELOAD
    from hvdrun.launch.remote import preload

    imported_under = {**os.environ, PRELOAD: "numpy,torch"}
    preload.preload(imported_under)  # as a host's fork server does: imported once, then frozen out of the GC
    template = _Template(imported_under)
    wake_read = _wake_on_child_end()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    Path(path + ".new").unlink(missing_ok=True)
    listener.bind(path + ".new")
    listener.listen(64)
    _pid_file(Path(path)).write_text(str(os.getpid()))
    os.rename(path + ".new", path)  # the client waits for the path: it appears once requests are taken
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    selector.register(client, selectors.EVENT_READ)
    selector.register(template.sock, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj == client:
                return  # the pytest worker ended
            if key.fileobj is listener:
                _answer(listener.accept()[0], children, imported_under, template)
            elif key.fileobj is template.sock:
                template.relay()
                if template.ended:
                    selector.unregister(template.sock)
            else:
                _drain(wake_read)
        _reap(children)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
