"""One host's copy of an environment (``--stage-env``, :mod:`hvdrun.launch.staging`): the unpack line that runs
there, the packed environment, and how the bytes get there.

A remote host reads the packed file itself when it sees it (the job's working directory, on the shared file
system: every host at its own bandwidth, nothing through hvdrun), else it gets it streamed over hvdrun's SSH
connection; this machine copies the environment directly (``tar | tar``, one pass).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from hvdrun.errors import LaunchError, UsageError

if TYPE_CHECKING:
    import paramiko

MARKER = ".hvdrun-staged"
CHUNK_BYTES = 1 << 20
STAGE_TIMEOUT_S = 900.0  # no byte moving for this long on one host's stream: that host failed
_DIR_EXIT, _UNPACK_EXIT, _SPACE_EXIT = 3, 4, 5  # the unpack line's exit codes (see _SCRIPT)

# The unpack line: sh -c SCRIPT hvdrun-stage DIR FP [SOURCE]. It answers on stdout "HAVE PATH" (a complete
# copy is there) or "NEED PATH". Then with SOURCE (the environment itself: hvdrun's own machine) it copies it;
# without, it reads "KIB BYTES TARFILE" from stdin and answers "FILE" when it sees TARFILE (the packed
# environment in the job's working directory on the shared file system) whole, else "STREAM", and reads the tar
# stream from stdin. It ends with "DONE PATH KIB". Its errors go to stderr after "hvdrun-stage: " (the user's
# login shell may write there too: module systems, pyenv); exit 3: the directory, 4: the unpack, 5: space.
# One command per line, the lines joined with "; " (csh and tcsh, the login shell on some clusters,
# refuse line breaks inside quotes): no line may end with "then", "else", "{" or "|".
_SCRIPT_LINES = r"""
dir=$1; fp=$2; src=${3:-}; base="$dir/hvdrun-$(id -u)"; final="$base/env-$fp"; tmp="$base/.env-$fp.partial.$$"
fail() { printf '%s\n' "$2" | sed 's/^/@FAIL@/' >&2; exit "$1"; }
err=$(mkdir -p -- "$dir" 2>&1) || fail 3 "$err"
if [ -L "$base" ]; then fail 3 "$base is a symbolic link; remove it"; fi
if [ -d "$base" ] || err=$(mkdir -m 700 -- "$base" 2>&1); then :; else fail 3 "$err"; fi
[ -O "$base" ] || fail 3 "$base belongs to another user (this one is uid $(id -u))"
chmod 700 -- "$base" 2>/dev/null || fail 3 "cannot make $base private (mode 700)"
[ -w "$base" ] || fail 3 "$base is not writable"
exec 9>"$base/.env-$fp.lock"
if command -v flock >/dev/null 2>&1; then flock -w 600 9 || fail 4 "$base/.env-$fp.lock held for 10 minutes"; fi
if [ -f "$final/@MARKER@" ]; then echo "HAVE $final"; exit 0; fi
rm -rf -- "$final" "$base/.env-$fp.partial."*
err=$(mkdir -- "$tmp" 2>&1) || fail 3 "$err"
echo "NEED $final"
if [ -n "$src" ]; then kib=$(du -sk -- "$src" | cut -f1)
else read -r kib bytes tarfile || { rm -rf -- "$tmp"; exit 1; }; fi
free=$(df -Pk -- "$base" 2>/dev/null | awk 'NR == 2 { print $4 }')
if [ -n "$free" ] && [ "$free" -lt "$kib" ]; then rm -rf -- "$tmp"; fail 5 "$base has $free KiB free, $kib needed"; fi
if [ -n "$src" ]; then err=$( { tar -C "$src" -cf - . || : > "$tmp.unread"; } | tar -xf - -C "$tmp" 2>&1 ); ok=$?
elif [ -f "$tarfile" ] && [ $(wc -c < "$tarfile") = "$bytes" ]; then echo FILE
err=$(tar -xf "$tarfile" -C "$tmp" 2>&1); ok=$?
else echo STREAM; err=$(tar -xf - -C "$tmp" 2>&1); ok=$?; fi
if [ -e "$tmp.unread" ]; then ok=1; err="tar could not read all of $src"; fi
if [ "$ok" != 0 ]; then rm -rf -- "$tmp" "$tmp.unread"; fail 4 "$(printf '%s\n' "$err" | tail -n 3)"; fi
: > "$tmp/@MARKER@" && mv -- "$tmp" "$final" || fail 4 "cannot move $tmp to $final"
echo "DONE $final $kib"
"""
_FAIL_PREFIX = "hvdrun-stage: "  # the unpack line's own errors, told from a login shell's noise on the same stderr
_SCRIPT = "; ".join(_SCRIPT_LINES.strip().splitlines()).replace("@MARKER@", MARKER).replace("@FAIL@", _FAIL_PREFIX)


@dataclass(frozen=True)
class Environment:
    """A Python environment to stage.

    Attributes:
        python: the Python the ranks would run (``/work/venv/bin/python``).
        prefix: the environment's root (``/work/venv``), packed whole.
        fingerprint: 12 hex digits of the path and the modification times of its contents' top entries.
    """

    python: str
    prefix: str
    fingerprint: str

    @property
    def relative_python(self) -> str:
        """The Python inside the environment: ``bin/python``."""
        return os.path.relpath(self.python, self.prefix)


@dataclass(frozen=True)
class HostStaged:
    """One host's staging: where the copy is, its Python, how it got there and what it cost."""

    host: str
    copy: str
    python: str
    copied_bytes: int = 0
    seconds: float = 0.0
    via: str = ""  # copy (this machine) | file (read the packed file) | ssh (streamed) | "" (already there)


def unpack_command(directory: str, environment: Environment, copy: bool = False) -> list[str]:
    """The command that checks for, and makes, ``environment``'s copy under ``directory`` on a host (every word
    separate): from the tar stream on its stdin, or with ``copy`` from the environment itself (this machine)."""
    return ["sh", "-c", _SCRIPT, "hvdrun-stage", directory, environment.fingerprint,
            *([environment.prefix] if copy else [])]


class Tarball:
    """An environment as one uncompressed tar file, packed when the first remote host needs it, for all of them.

    Packed into ``shared_dir`` (the job's working directory, which the ssh launcher needs on every host, so
    usually on the shared file system) when it can be written there: each host then reads the one file itself,
    at its own bandwidth, and nothing goes through hvdrun; a host that does not see it whole gets it streamed
    over its SSH connection. Without ``shared_dir`` (or when it is not writable) the file goes to a temporary
    directory here and every host gets the stream. Use as a context manager: the file is deleted at the end.
    """

    def __init__(self, environment: Environment, shared_dir: str | None = None) -> None:
        self.environment = environment
        self.shared_dir = shared_dir
        self.pack_seconds = 0.0
        self.shared = False
        self._path: str | None = None
        self._lock = threading.Lock()
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> Tarball:
        return self

    def __exit__(self, *_: object) -> None:
        if self.shared and self._path is not None:
            Path(self._path).unlink(missing_ok=True)
        if self._dir is not None:
            self._dir.cleanup()

    def path(self) -> str:
        """The packed file (packed now if no host needed it before).

        Raises:
            LaunchError: tar could not read the environment or write the file.
        """
        with self._lock:
            if self._path is None:
                started = time.monotonic()
                self._path = self._pack()
                self.pack_seconds = time.monotonic() - started
            return self._path

    def _pack(self) -> str:
        """Into the shared directory if it takes it, else into a temporary one."""
        shared = self.shared_dir
        if shared and os.access(shared, os.W_OK) and not _inside(shared, self.environment.prefix):
            path = os.path.join(shared, f".hvdrun-stage-{self.environment.fingerprint}-{os.getpid()}.tar")
            if self._tar(path) is None:
                self.shared = True
                return path
            Path(path).unlink(missing_ok=True)
        self._dir = tempfile.TemporaryDirectory(prefix="hvdrun-pack-")
        path = os.path.join(self._dir.name, "env.tar")
        why = self._tar(path)
        if why is not None:
            raise LaunchError(f"--stage-env: cannot pack {self.environment.prefix} into {path}: {why} (TMPDIR "
                              "sets where the tar file goes)")
        return path

    def _tar(self, path: str) -> str | None:
        """Pack into ``path``; None when it worked, else why not."""
        try:
            done = subprocess.run(["tar", "-C", self.environment.prefix, "-cf", path, "."], capture_output=True,
                                  text=True, check=False)
        except OSError as e:
            return f"cannot run tar: {e}"
        if done.returncode != 0:
            return " ".join(done.stderr.strip().splitlines()[-2:]) or f"tar exited with code {done.returncode}"
        return None


def _inside(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or below it."""
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(prefix)]) == os.path.realpath(prefix)


class _Session(Protocol):
    """The unpack line running on one host: its stdout lines, its stdin, its end."""

    def read_line(self) -> str: ...

    def write(self, data: bytes) -> None: ...

    def finish(self) -> tuple[int, str, str]: ...


_RUNNING: set[subprocess.Popen[bytes]] = set()  # the unpack lines running on this machine


def stop_local_copies() -> int:
    """SIGKILL every unpack line running on this machine, with its ``tar | tar`` (hvdrun was interrupted); how
    many there were."""
    running = list(_RUNNING)
    for process in running:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    return len(running)


class _LocalSession:
    """The unpack line on this machine, in ``sh``, in a session of its own (stopped with hvdrun: see
    :func:`stop_local_copies`)."""

    def __init__(self, argv: Sequence[str]) -> None:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in finish()
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                        start_new_session=True)
        _RUNNING.add(self.process)

    def read_line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().decode(errors="replace")

    def write(self, data: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(data)

    def finish(self) -> tuple[int, str, str]:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        rest = self.process.stdout.read().decode(errors="replace")
        status = self.process.wait()
        _RUNNING.discard(self.process)
        self._stderr.seek(0)
        error = self._stderr.read().decode(errors="replace")
        self._stderr.close()
        return status, rest, error


class _SshSession:
    """The unpack line on a remote host, in an exec channel of the connection the launcher opened."""

    def __init__(self, client: paramiko.SSHClient, argv: Sequence[str]) -> None:
        transport = client.get_transport()
        if transport is None or not transport.is_active():
            raise OSError("the SSH connection is closed")
        self.channel = transport.open_session(timeout=STAGE_TIMEOUT_S)
        self.channel.settimeout(STAGE_TIMEOUT_S)
        self.channel.exec_command(shlex.join(argv))
        self._pending = b""

    def read_line(self) -> str:
        while b"\n" not in self._pending:
            data = self.channel.recv(65536)
            if not data:
                break
            self._pending += data
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode(errors="replace")

    def write(self, data: bytes) -> None:
        self.channel.sendall(data)

    def finish(self) -> tuple[int, str, str]:
        self.channel.shutdown_write()
        rest, error = bytearray(self._pending), bytearray()
        while chunk := self.channel.recv(65536):
            rest += chunk
        while chunk := self.channel.recv_stderr(65536):
            error += chunk
        status = self.channel.recv_exit_status()
        self.channel.close()
        return status, rest.decode(errors="replace"), error.decode(errors="replace")


def copy_on_host(name: str, client: paramiko.SSHClient | None, directory: str, tarball: Tarball) -> HostStaged:
    """Check for, and if needed make, the copy of ``tarball``'s environment under ``directory`` on one host:
    ``client`` None is this machine, which copies the environment itself; a remote host reads the packed file or
    gets it over ``client``.

    Raises:
        UsageError: ``directory`` cannot be used there.
        LaunchError: the copy could not be made (disk full, a dropped connection, ...), naming the host.
    """
    started = time.monotonic()
    argv = unpack_command(directory, tarball.environment, copy=client is None)
    try:
        session: _Session = _LocalSession(argv) if client is None else _SshSession(client, argv)
    except Exception as e:  # noqa: BLE001 - OSError, paramiko's channel errors: named below
        raise LaunchError(f"--stage-env: cannot start the unpack on {name}: {e or type(e).__name__}", name) from e
    answer, via = _read_answer(session), ""
    try:
        if answer.startswith("NEED "):
            via = "copy" if client is None else _deliver(session, tarball)
    finally:
        status, rest, error = _finish(session)
    if status != 0 or not answer.startswith(("HAVE ", "NEED ")):
        raise _failure(name, directory, status, error)
    copy = answer.split(" ", 1)[1]
    copied = int(rest.split()[-1]) * 1024 if via and rest.split() else 0
    return HostStaged(name, copy, f"{copy}/{tarball.environment.relative_python}", copied,
                      time.monotonic() - started, via)


def _read_answer(session: _Session) -> str:
    try:
        return session.read_line().strip()
    except OSError:  # a timeout or a dropped connection: finish() says what happened
        return ""


def _finish(session: _Session) -> tuple[int, str, str]:
    """The unpack line's exit status, the rest of its stdout and its stderr (-1: the connection was lost)."""
    try:
        return session.finish()
    except Exception as e:  # noqa: BLE001 - a dropped connection or a timeout, reported as the cause
        return -1, "", f"{e or type(e).__name__}"


def _deliver(session: _Session, tarball: Tarball) -> str:
    """Offer the packed file; stream it when the host does not see it. How it went: ``file`` or ``ssh``."""
    path = tarball.path()
    size = os.path.getsize(path)
    offered = path if tarball.shared and "\n" not in path else "/"
    try:
        session.write(f"{-(-size // 1024)} {size} {offered}\n".encode())
        if session.read_line().strip() == "FILE":
            return "file"
        with open(path, "rb") as source:
            while chunk := source.read(CHUNK_BYTES):
                session.write(chunk)
    except (OSError, EOFError):
        pass  # the unpack ended early: its exit status and stderr tell why
    return "ssh"


def _failure(name: str, directory: str, status: int, error: str) -> UsageError | LaunchError:
    """The error of a host whose unpack line failed: the directory (a usage error) or the unpack itself. The line's
    own messages are quoted, not what the host's login shell wrote around them; all of stderr when it wrote none."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    own = [line.removeprefix(_FAIL_PREFIX) for line in lines if line.startswith(_FAIL_PREFIX)]
    why = " ".join(own or lines) or (
        f"the unpack exited with code {status}" if status > 0 else "the connection was lost")
    if status == _DIR_EXIT:
        return UsageError(f"--stage-env: cannot use {directory} on {name}: {why}; give a writable directory on "
                          "the node's own disk with --stage-dir DIR (or local_dir: in the cluster YAML)")
    if status == _SPACE_EXIT:
        why += "; free some space there, or give another directory with --stage-dir DIR"
    return LaunchError(f"--stage-env: cannot unpack the environment into {directory} on {name}: {why}", name)


