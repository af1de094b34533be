"""One host's end of ``--stage-env``'s tree (:mod:`hvdrun.launch.stage_tree`): this host's copy of the environment,
taken from a parent host and passed on to its children while it unpacks.

Started on every host by the launcher (over SSH, or by ``mpiexec`` with one process per host) as
``python -I -S stage_relay.py ADDR PORT INDEX DIR``: isolated and without ``site``, it reads nothing but the
interpreter's own standard library from the shared file system, and imports nothing of hvdrun (this file is run
by path). The job's staging token comes from ``$HVDRUN_STAGE_TOKEN``, else the first line of stdin (never argv,
which ``ps`` shows to every user); INDEX ``env:NAME`` means the rank the MPI launcher put in ``$NAME`` (one process
a host).

Every connection starts with a handshake both ways (:func:`handshake_as_client`, :func:`handshake_as_server`: an
HMAC of the other side's nonce with the token, tagged with the prover's role), so a relay takes commands only
from hvdrun and bytes only from its parent. The conversation with hvdrun (the coordinator at ADDR:PORT) is then
JSON lines:

1. the hello (in the handshake): this host, and the identity of DIR (boot id, device, inode): hosts that share
   one directory get one copy, made by the first of them;
2. ``check``: run the unpack line (its shell text comes from hvdrun), answer HAVE, BUSY (another job holds the
   copy's lock: asked again later), NEED (and where this relay listens for its children), or how it failed;
3. ``feed``: where the bytes come from (the environment itself on this host, read once for the whole job; the
   coordinator's connection; or a parent relay) and how many children connect; every chunk goes to this host's
   unpack and to each child, framed (a 4-byte length, 0 at the end, so that a parent's death is seen as one);
4. ``end``: the unpack's exit status, its output, the bytes taken.

A relay whose coordinator goes away stops at once (it watches the connection between chunks), with its unpack.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

TOKEN_VARIABLE = "HVDRUN_STAGE_TOKEN"  # hvdrun.envvars.STAGE_TOKEN (this file imports nothing of hvdrun)
LOCK_WAIT_VARIABLE = "HVDRUN_STAGE_LOCK_WAIT"  # the unpack line's flock wait: 0 answers BUSY at once
LOCK_WAIT_S = 600  # the wait for another job's lock on a copy, but in a tree's first round (the unpack line's -w)
CHUNK = 1 << 20
MAX_FRAME = 4 * CHUNK  # a longer frame is no relay's
MAX_LINE = 1 << 16  # a longer line is no relay's (the unpack line's text is the longest, about 3 kB)
IO_TIMEOUT_S = 120.0  # no byte moving for this long: the peer is taken as dead
HANDSHAKE_TIMEOUT_S = 10.0  # a peer proves the token within this, or is not one
CHILDREN_WAIT_S = 60.0  # children reach their parent as soon as they are fed; one not there by then failed
_FRAME = struct.Struct("!I")
_SIOCGIFADDR = 0x8915


class AuthError(Exception):
    """A peer that did not prove the job's staging token."""


def proof(token: str, role: str, nonce: str) -> str:
    """What ``role`` (relay, hvdrun, parent, child) answers to ``nonce`` to prove the staging token."""
    return hmac.new(token.encode(), f"{role}:{nonce}".encode(), hashlib.sha256).hexdigest()


def send_json(sock: socket.socket, message: dict) -> None:
    """One JSON line to ``sock``."""
    sock.sendall(json.dumps(message).encode() + b"\n")


class LineReader:
    """JSON lines from a socket (at most :data:`MAX_LINE` bytes), then its framed chunks."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.pending = sock, b""

    def line(self, deadline: float | None = None) -> dict:
        """The next JSON object; ValueError for a line too long or not an object, TimeoutError past ``deadline``."""
        while b"\n" not in self.pending:
            if len(self.pending) > MAX_LINE:
                raise ValueError(f"a line of more than {MAX_LINE} bytes")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("no whole line in time")
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("the connection closed")
            self.pending += data
        line, _, self.pending = self.pending.partition(b"\n")
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError("a line that is not a JSON object")
        return message

    def exact(self, count: int) -> bytes | bytearray:
        """``count`` bytes, received straight into one buffer (a chunk is never copied piece by piece)."""
        if len(self.pending) >= count:
            taken, self.pending = self.pending[:count], self.pending[count:]
            return taken
        buffer = bytearray(count)
        have = len(self.pending)
        buffer[:have], self.pending = self.pending, b""
        view = memoryview(buffer)
        while have < count:
            received = self.sock.recv_into(view[have:], count - have)
            if not received:
                raise EOFError("the stream ended early")
            have += received
        return buffer

    def frame(self) -> bytes | bytearray:
        """The next framed chunk; b'' at the end of the stream."""
        (length,) = _FRAME.unpack(self.exact(_FRAME.size))
        if length > MAX_FRAME:
            raise ValueError(f"a frame of {length} bytes")
        return self.exact(length) if length else b""


def frame_header(chunk: bytes | bytearray) -> bytes:
    """The header sent before ``chunk`` on a relay's connection (an empty chunk ends the stream)."""
    return _FRAME.pack(len(chunk))


def handshake_as_client(sock: socket.socket, token: str, role: str, peer_role: str,
                        hello: dict | None = None) -> LineReader:
    """Prove the token to the server of ``sock`` as ``role`` (with ``hello``), and have it prove it as
    ``peer_role``; the reader of the connection after.

    Raises:
        AuthError: the server did not prove the token. OSError, EOFError, ValueError: the connection failed.
    """
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    reader = LineReader(sock)
    challenge = str(reader.line(deadline).get("nonce", ""))
    mine = os.urandom(16).hex()
    send_json(sock, {**(hello or {}), "proof": proof(token, role, challenge), "nonce": mine})
    answer = reader.line(deadline)
    if not hmac.compare_digest(str(answer.get("proof", "")), proof(token, peer_role, mine)):
        raise AuthError(f"the {peer_role} did not prove the job's staging token")
    return reader


def handshake_as_server(sock: socket.socket, token: str, role: str, peer_role: str) -> tuple[LineReader, dict]:
    """Have the client of ``sock`` prove the token as ``peer_role``, then prove it as ``role``; the reader and
    the client's hello.

    Raises:
        AuthError: the client did not prove the token. OSError, EOFError, ValueError: the connection failed.
    """
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    reader = LineReader(sock)
    nonce = os.urandom(16).hex()
    send_json(sock, {"nonce": nonce})
    hello = reader.line(deadline)
    if not hmac.compare_digest(str(hello.get("proof", "")), proof(token, peer_role, nonce)):
        raise AuthError(f"the {peer_role} did not prove the job's staging token")
    send_json(sock, {"proof": proof(token, role, str(hello.get("nonce", "")))})
    return reader, hello


def keep_alive(sock: socket.socket) -> None:
    """No timeout on ``sock`` (a wait on it may last a whole tree), but the kernel's keepalive probes: a peer gone
    without a word is seen within about a minute."""
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def directory_identity(directory: str) -> str:
    """Which directory ``directory`` is, across hosts: the kernel's boot id, and the device and inode of it or of
    its nearest existing parent (nothing is made before hvdrun proved itself); hosts that print the same share it.
    Unique to this process when it cannot be read: the unpack line then says why."""
    path = os.path.abspath(directory)
    try:
        while not os.path.exists(path) and path != os.path.dirname(path):
            path = os.path.dirname(path)
        stat = os.stat(path)
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}:{stat.st_dev}:{stat.st_ino}:{os.path.relpath(directory, path)}"
    except OSError:
        return f"{socket.gethostname()}:{os.getpid()}:{time.time()}"


def address_towards(addr: str) -> str:
    """This host's address on the route to ``addr`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((addr, 9))
        return str(probe.getsockname()[0])


def interface_ipv4(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` on this host (Linux's SIOCGIFADDR), or None without one."""
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


def own_address(interface: str | None, coordinator: str) -> str:
    """Where this relay's children reach it: its address on the job's network interface (``--network-interface``)
    when it has one, else on the route to hvdrun."""
    return (interface_ipv4(interface) if interface else None) or address_towards(coordinator)


class Unpack:
    """The unpack line (``sh -c SCRIPT hvdrun-stage DIR FP``) of this host, fed through its stdin."""

    def __init__(self, argv: list[str], lock_wait_s: int = LOCK_WAIT_S, new_session: bool = False) -> None:
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - read and closed in finish()
        env = {**os.environ, LOCK_WAIT_VARIABLE: str(lock_wait_s)}
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                        env=env, start_new_session=new_session)

    @functools.cached_property
    def answer(self) -> str:
        """Its first line: HAVE, BUSY or NEED and the copy's path ('' when it failed before saying one)."""
        return self.read_line()

    def write(self, data: bytes | bytearray) -> bool:
        """Feed ``data``; False once the unpack stopped reading (it ended)."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(data)
            return True
        except OSError:
            return False

    def start_stream(self, kib: int) -> bool:
        """Say how much space the copy needs; whether the line then takes the stream (False: it refused)."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(f"{kib} 0 -\n".encode())
            self.process.stdin.flush()
        except OSError:
            return False
        return self.read_line() == "STREAM"

    def read_line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().decode(errors="replace").strip()

    def finish(self) -> tuple[int, str, str]:
        """Its exit status, the rest of its stdout, its stderr."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.close()
        except OSError:
            pass
        rest = self.process.stdout.read().decode(errors="replace")
        status = self.process.wait()
        self.stderr.seek(0)
        error = self.stderr.read().decode(errors="replace")
        self.stderr.close()
        return status, rest, error

    def kill(self) -> None:
        self.process.kill()


class Source:
    """The chunks of this host's tar stream, and what they are read from (a tar here, or a socket)."""

    def __init__(self, chunks: Iterator[bytes | bytearray], tar: subprocess.Popen | None = None,
                 sock: socket.socket | None = None) -> None:
        self.chunks, self.tar, self.sock = chunks, tar, sock

    @property
    def reads_environment(self) -> bool:
        """Whether this host reads the environment itself (the job's one read of the shared source)."""
        return self.tar is not None

    def failed(self) -> bool:
        """Whether the local tar ended with an error."""
        return self.tar is not None and self.tar.wait() != 0

    def close(self) -> None:
        if self.tar is not None:
            self.tar.kill()
            self.tar.wait()
        if self.sock is not None:
            self.sock.close()


class Relay:
    """This host's relay: see the module docstring."""

    def __init__(self, coordinator: socket.socket, token: str, index: int, directory: str) -> None:
        self.coordinator, self.token, self.index, self.directory = coordinator, token, index, directory
        self.reader = LineReader(coordinator)
        self.listener: socket.socket | None = None
        self.unpack: Unpack | None = None

    def run(self) -> int:
        hello = {"index": self.index, "host": socket.gethostname(), "identity": directory_identity(self.directory)}
        self.reader = handshake_as_client(self.coordinator, self.token, "relay", "hvdrun", hello)
        keep_alive(self.coordinator)
        while True:
            message = self.reader.line()
            if message.get("do") == "check":
                self.check(message)
            elif message.get("do") == "feed":
                self.feed(message)
            else:
                return 0

    def check(self, message: dict) -> None:
        """Run the unpack line; answer HAVE, BUSY, NEED (and where this relay listens) or how it failed."""
        self.unpack = Unpack(list(message["argv"]), int(message["lock_wait"]))
        if not self.unpack.answer.startswith("NEED "):
            self.end(self.unpack.finish(), 0, 0, 0.0)
            return
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("0.0.0.0", 0))  # noqa: S104 - children connect from their hosts, with the token
        self.listener.listen(64)
        prefix = str(message["prefix"])  # a venv's or a conda environment's root, as hvdrun's machine sees it
        sees = os.path.isfile(os.path.join(prefix, "pyvenv.cfg")) or os.path.isdir(os.path.join(prefix, "conda-meta"))
        addr = own_address(message.get("interface"), str(message["peer"]))
        send_json(self.coordinator, {"answer": self.unpack.answer, "addr": addr,
                                     "port": self.listener.getsockname()[1], "sees_source": sees})

    def feed(self, message: dict) -> None:
        """Take the stream, unpack it here and pass it on to the children."""
        assert self.unpack is not None and self.listener is not None
        started, feeder = time.monotonic(), str(message.get("from_host", "hvdrun"))
        try:  # the parent first: every host reaches its parent before it waits for its children (top-down)
            source = self.open_source(message)
            children = self.accept_children(int(message["children"]))
        except (OSError, EOFError, ValueError, AuthError) as e:
            self.listener.close()
            self.unpack.kill()
            self.end(self.failed(f"cannot reach {feeder}: {e}"), 0, 0, time.monotonic() - started)
            return
        if not self.unpack.start_stream(int(message["kib"])):  # it refused (no space): the children see the end
            source.close()
            self.close_all(children)
            self.end(self.unpack.finish(), 0, 0, time.monotonic() - started)
            return
        taken, error = self.stream(source, children, feeder, watch=message["source"] != "coordinator")
        if error:
            self.unpack.kill()
        status, rest, stderr = self.unpack.finish()
        if error:
            status, stderr = status or 4, f"hvdrun-stage: {error}\n{stderr}"
        self.end((status, rest, stderr), taken, taken if source.reads_environment else 0, time.monotonic() - started)

    def stream(self, source: Source, children: list[socket.socket], feeder: str, watch: bool) -> tuple[int, str]:
        """Every chunk to the unpack and the children; the bytes taken and what went wrong ('' when nothing)."""
        taken, error = 0, ""
        try:
            while chunk := next(source.chunks, b""):
                if watch and self.coordinator_gone():
                    raise OSError("hvdrun went away")
                taken += len(chunk)
                children = self.pass_on(children, chunk)
                if not self.unpack.write(chunk):  # type: ignore[union-attr]
                    break  # the unpack ended: its status says why
            else:
                if source.failed():
                    error = "tar could not read all of the environment on this host"
                else:
                    children = self.pass_on(children, b"")
        except (OSError, EOFError, ValueError) as e:
            error = f"the stream from {feeder} ended early: {e}"
        source.close()
        self.close_all(children)
        return taken, error

    def coordinator_gone(self) -> bool:
        """Whether hvdrun's connection closed (or said anything: mid-stream it only ever says to stop)."""
        readable, _, _ = select.select([self.coordinator], [], [], 0)
        return bool(readable)

    def failed(self, why: str) -> tuple[int, str, str]:
        """The unpack's end after it was killed for ``why``."""
        assert self.unpack is not None
        status, rest, stderr = self.unpack.finish()
        return status or 4, rest, f"hvdrun-stage: {why}\n{stderr}"

    @staticmethod
    def close_all(children: list[socket.socket]) -> None:
        for child in children:
            child.close()

    def accept_children(self, count: int) -> list[socket.socket]:
        """The ``count`` children, each once the token was proven both ways (those not there within
        :data:`CHILDREN_WAIT_S` are left out; a connection that proves nothing within
        :data:`HANDSHAKE_TIMEOUT_S` is dropped)."""
        assert self.listener is not None
        deadline = time.monotonic() + CHILDREN_WAIT_S
        children: list[socket.socket] = []
        while len(children) < count and time.monotonic() < deadline:
            self.listener.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                child, _ = self.listener.accept()
            except TimeoutError:
                break  # a child that did not come is dropped: its own host says why
            child.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                handshake_as_server(child, self.token, "parent", "child")
            except (OSError, EOFError, ValueError, AuthError):
                child.close()
                continue
            child.settimeout(IO_TIMEOUT_S)
            children.append(child)
        self.listener.close()
        return children

    def open_source(self, message: dict) -> Source:
        """Where this host's stream comes from: the environment itself, hvdrun, or the parent host."""
        if message["source"] == "env":
            tar = subprocess.Popen(["tar", "-C", str(message["prefix"]), "-cf", "-", "."], stdout=subprocess.PIPE)
            out = tar.stdout
            assert out is not None
            return Source(iter(lambda: out.read(CHUNK), b""), tar=tar)
        if message["source"] == "coordinator":
            return Source(iter(self.reader.frame, b""))
        addr, port = message["parent"]
        parent = socket.create_connection((str(addr), int(port)), timeout=HANDSHAKE_TIMEOUT_S)
        reader = handshake_as_client(parent, self.token, "child", "parent")
        parent.settimeout(IO_TIMEOUT_S)
        return Source(iter(reader.frame, b""), sock=parent)

    @staticmethod
    def pass_on(children: list[socket.socket], chunk: bytes | bytearray) -> list[socket.socket]:
        """Send ``chunk`` (framed) to every child; those that fail are dropped (their hosts say why)."""
        kept = []
        header = frame_header(chunk)
        for child in children:
            try:
                child.sendall(header)
                child.sendall(chunk)
                kept.append(child)
            except OSError:
                child.close()
        return kept

    def end(self, finished: tuple[int, str, str], taken: int, source_bytes: int, seconds: float) -> None:
        status, rest, stderr = finished
        answer = self.unpack.answer if self.unpack else ""
        send_json(self.coordinator, {"end": status, "answer": answer, "stdout": rest, "stderr": stderr[-4000:],
                                     "bytes": taken, "source_bytes": source_bytes, "seconds": seconds})


def _index(given: str) -> int:
    """INDEX: a number, or ``env:NAME`` for the rank the MPI launcher put in ``$NAME``."""
    if not given.startswith("env:"):
        return int(given)
    name = given.removeprefix("env:")
    if not os.environ.get(name, "").isdigit():
        raise SystemExit(f"hvdrun-stage: ${name} does not say which host this is (the launcher sets it)")
    return int(os.environ[name])


def main(argv: list[str]) -> int:
    """``ADDR PORT INDEX DIR``: relay this host's part of the job's staging (see the module docstring)."""
    addr, port, index, directory = argv
    token = os.environ.pop(TOKEN_VARIABLE, "") or sys.stdin.readline().strip()
    coordinator = socket.create_connection((addr, int(port)), timeout=HANDSHAKE_TIMEOUT_S)
    relay = Relay(coordinator, token, _index(index), directory)
    try:
        return relay.run()
    except Exception as e:  # noqa: BLE001 - hvdrun went away or misspoke: nothing here may outlive it
        if relay.unpack is not None:
            relay.unpack.kill()
        print(f"hvdrun-stage: lost hvdrun at {addr}:{port}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
