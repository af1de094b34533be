"""One host's end of ``--stage-env``'s tree (:mod:`hvdrun.launch.stage_tree`): this host's copy of the environment,
taken from a parent host and passed on to its children while it unpacks.

Started on every host by the launcher (over SSH, or by ``mpiexec`` with one process per host) as
``python -I -S stage_relay.py ADDR PORT INDEX DIR``: isolated and without ``site``, it reads nothing but the
interpreter's own standard library from the shared file system, and imports nothing of hvdrun (this file is run
by path). The job's staging token comes from ``$HVDRUN_STAGE_TOKEN``, else the first line of stdin (never argv,
which ``ps`` shows to every user); INDEX ``-`` means the rank of the MPI launcher (one per host).

The conversation with hvdrun (the coordinator at ADDR:PORT) is JSON lines after an HMAC proof of the token:

1. ``hello``: this host, and the identity of DIR (boot id, device, inode): hosts that share one directory
   (a shared ``/tmp`` of containers, namespace hosts) get one copy, made by the first of them;
2. ``check``: run the unpack line (its shell text comes from hvdrun), answer HAVE or NEED, and where this relay
   listens for its children;
3. ``feed``: where the bytes come from (the environment itself on this host, read once for the whole job; the
   coordinator's connection; or a parent relay) and how many children connect; every chunk goes to this host's
   unpack and to each child, framed (4-byte length, 0 at the end, so that a parent's death is seen as one);
4. ``end``: the unpack's exit status, its output, the bytes taken and passed on.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

TOKEN_VARIABLE = "HVDRUN_STAGE_TOKEN"  # hvdrun.envvars.STAGE_TOKEN (this file imports nothing of hvdrun)
MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "PMIX_RANK", "SLURM_PROCID")
CHUNK = 1 << 20
IO_TIMEOUT_S = 900.0  # no byte moving for this long: the peer is taken as dead
CHILDREN_WAIT_S = 60.0  # children reach their parent as soon as they are fed; one not there by then failed
_FRAME = struct.Struct("!I")


def proof(token: str, nonce: str) -> str:
    """The answer to a nonce that proves the staging token."""
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def send_json(sock: socket.socket, message: dict) -> None:
    """One JSON line to ``sock``."""
    sock.sendall(json.dumps(message).encode() + b"\n")


class LineReader:
    """JSON lines from a socket, then its raw bytes (the reader keeps what it read ahead)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.pending = sock, b""

    def line(self) -> dict:
        while b"\n" not in self.pending:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("the connection closed")
            self.pending += data
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

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
        return self.exact(length) if length else b""


def frame(chunk: bytes | bytearray) -> bytes:
    """``chunk``'s header as it goes over a relay's connection, before the chunk itself (length 0 ends the stream)."""
    return _FRAME.pack(len(chunk))


def directory_identity(directory: str) -> str:
    """Which directory ``directory`` is, across hosts: the kernel's boot id, its device and inode (hosts that print
    the same share it). Unique to this process when it cannot be made or read: the unpack line then says why."""
    try:
        os.makedirs(directory, exist_ok=True)
        stat = os.stat(directory)
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}:{stat.st_dev}:{stat.st_ino}"
    except OSError:
        return f"{socket.gethostname()}:{os.getpid()}:{time.time()}"


def address_towards(addr: str) -> str:
    """This host's address on the route to ``addr`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((addr, 9))
        return str(probe.getsockname()[0])


class Unpack:
    """The unpack line (``sh -c SCRIPT hvdrun-stage DIR FP``) of this host, fed through its stdin."""

    def __init__(self, argv: list[str]) -> None:
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - read in finish()
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr)
        self.answer = self.read_line()

    def write(self, data: bytes | bytearray) -> bool:
        """Feed ``data``; False once the unpack stopped reading (it ended)."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(data)
            return True
        except OSError:
            return False

    def flush(self) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.flush()
        except OSError:
            pass

    def read_line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().decode(errors="replace").strip()

    def finish(self) -> tuple[int, str, str]:
        """Its exit status, the rest of its stdout, its stderr."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        rest = self.process.stdout.read().decode(errors="replace")
        status = self.process.wait()
        self.stderr.seek(0)
        return status, rest, self.stderr.read().decode(errors="replace")

    def kill(self) -> None:
        self.process.kill()


class Source:
    """The chunks of this host's tar stream, and what they are read from (a tar here, or the parent's socket)."""

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
        self.coordinator, self.reader = coordinator, LineReader(coordinator)
        self.token, self.index, self.directory = token, index, directory
        self.listener: socket.socket | None = None
        self.unpack: Unpack | None = None

    def run(self) -> int:
        nonce = self.reader.line()["nonce"]
        send_json(self.coordinator, {"index": self.index, "proof": proof(self.token, nonce),
                                     "host": socket.gethostname(), "identity": directory_identity(self.directory)})
        while True:
            message = self.reader.line()
            if message["do"] == "check":
                self.check(message)
            elif message["do"] == "feed":
                self.feed(message)
            else:
                return 0

    def check(self, message: dict) -> None:
        """Run the unpack line; answer HAVE, NEED (and where this relay listens) or how it failed."""
        self.unpack = Unpack(message["argv"])
        if not self.unpack.answer.startswith("NEED "):
            self.end(self.unpack.finish(), 0, 0, 0.0)
            return
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("0.0.0.0", 0))  # noqa: S104 - children connect from their hosts, with the token
        self.listener.listen(64)
        prefix = message["prefix"]  # a venv's or a conda environment's root, as hvdrun's machine sees it
        sees = os.path.isfile(os.path.join(prefix, "pyvenv.cfg")) or os.path.isdir(os.path.join(prefix, "conda-meta"))
        send_json(self.coordinator, {"answer": self.unpack.answer, "addr": address_towards(message["peer"]),
                                     "port": self.listener.getsockname()[1], "sees_source": sees})

    def feed(self, message: dict) -> None:
        """Take the stream, unpack it here and pass it on to the children."""
        assert self.unpack is not None and self.listener is not None
        started = time.monotonic()
        try:  # the parent first: every host reaches its parent before it waits for its children (top-down)
            source = self.open_source(message)
            children = self.accept_children(message["children"])
        except (OSError, EOFError, ValueError) as e:
            self.listener.close()
            self.unpack.kill()
            status, rest, stderr = self.unpack.finish()
            self.end((status or 4, rest, f"hvdrun-stage: cannot reach {message.get('from_host')}: {e}\n{stderr}"),
                     0, 0, time.monotonic() - started, message["children"])
            return
        self.unpack.write(f"{message['kib']} 0 -\n".encode())
        self.unpack.flush()
        if self.unpack.read_line() != "STREAM":  # it refused (no space): the children see the stream end early
            source.close()
            self.close_children(children)
            self.end(self.unpack.finish(), 0, 0, time.monotonic() - started, message["children"])
            return
        taken, error = 0, ""
        try:
            while chunk := next(source.chunks, b""):
                taken += len(chunk)
                children = self.pass_on(children, chunk)
                if not self.unpack.write(chunk):
                    break  # the unpack ended: its status says why
            else:
                if source.failed():
                    error = "tar could not read all of the environment on this host"
                else:
                    children = self.pass_on(children, b"")
        except (OSError, EOFError, ValueError) as e:
            error = f"the stream from {message.get('from_host', 'hvdrun')} ended early: {e}"
        source.close()
        if error:
            self.unpack.kill()
        self.close_children(children)
        status, rest, stderr = self.unpack.finish()
        if error:
            status, stderr = status or 4, f"hvdrun-stage: {error}\n{stderr}"
        self.end((status, rest, stderr), taken, taken if source.reads_environment else 0,
                 time.monotonic() - started, message["children"] - len(children))

    @staticmethod
    def close_children(children: list[socket.socket]) -> None:
        for child in children:
            child.close()

    def accept_children(self, count: int) -> list[socket.socket]:
        """The ``count`` children, each once it proved the token (those not there within
        :data:`CHILDREN_WAIT_S` are left out)."""
        assert self.listener is not None
        deadline = time.monotonic() + CHILDREN_WAIT_S
        children: list[socket.socket] = []
        while len(children) < count:
            self.listener.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                child, _ = self.listener.accept()
            except TimeoutError:
                break  # a child that did not come is dropped: its own host says why

            child.settimeout(IO_TIMEOUT_S)
            nonce = os.urandom(16).hex()
            send_json(child, {"nonce": nonce})
            try:
                answer = LineReader(child).line()
            except (OSError, EOFError, ValueError):
                child.close()
                continue
            if hmac.compare_digest(str(answer.get("proof", "")), proof(self.token, nonce)):
                children.append(child)
            else:
                child.close()
        self.listener.close()
        return children

    def open_source(self, message: dict) -> Source:
        """Where this host's stream comes from: the environment itself, hvdrun, or the parent host."""
        if message["source"] == "env":
            tar = subprocess.Popen(["tar", "-C", message["prefix"], "-cf", "-", "."], stdout=subprocess.PIPE)
            out = tar.stdout
            assert out is not None
            return Source(iter(lambda: out.read(CHUNK), b""), tar=tar)
        if message["source"] == "coordinator":
            return Source(iter(self.reader.frame, b""))
        parent = socket.create_connection(tuple(message["parent"]), timeout=IO_TIMEOUT_S)
        reader = LineReader(parent)
        send_json(parent, {"proof": proof(self.token, reader.line()["nonce"])})
        return Source(iter(reader.frame, b""), sock=parent)

    @staticmethod
    def pass_on(children: list[socket.socket], chunk: bytes | bytearray) -> list[socket.socket]:
        """Send ``chunk`` (framed) to every child; those that fail are dropped (their hosts say why)."""
        kept = []
        header = frame(chunk)
        for child in children:
            try:
                child.sendall(header)
                child.sendall(chunk)
                kept.append(child)
            except OSError:
                child.close()
        return kept

    def end(self, finished: tuple[int, str, str], taken: int, source_bytes: int, seconds: float,
            dropped: int = 0) -> None:
        status, rest, stderr = finished
        answer = self.unpack.answer if self.unpack else ""
        send_json(self.coordinator, {"end": status, "answer": answer, "stdout": rest, "stderr": stderr[-4000:],
                                     "bytes": taken, "source_bytes": source_bytes, "seconds": seconds,
                                     "dropped": dropped})


def _index(given: str) -> int:
    if given != "-":
        return int(given)
    for name in MPI_RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    raise SystemExit(f"hvdrun-stage: no rank variable ({', '.join(MPI_RANK_VARIABLES)}) says which host this is")


def main(argv: list[str]) -> int:
    """``ADDR PORT INDEX DIR``: relay this host's part of the job's staging (see the module docstring)."""
    addr, port, index, directory = argv
    token = os.environ.pop(TOKEN_VARIABLE, "") or sys.stdin.readline().strip()
    coordinator = socket.create_connection((addr, int(port)), timeout=IO_TIMEOUT_S)
    relay = Relay(coordinator, token, _index(index), directory)
    try:
        return relay.run()
    except (OSError, EOFError, ValueError) as e:  # the coordinator went away: nothing here may outlive it
        if relay.unpack is not None:
            relay.unpack.kill()
        print(f"hvdrun-stage: lost hvdrun at {addr}:{port}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
