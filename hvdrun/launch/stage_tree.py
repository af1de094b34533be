"""``--stage-env`` as a tree: the environment read once from the shared file system, then passed host to host.

Every remote host runs a relay (:mod:`hvdrun.launch.remote.stage_relay`), started over SSH or by ``mpiexec``
with one process per host, which calls back to hvdrun (this module, the coordinator) with the job's staging
token. Then:

1. Hosts whose staging directory is one directory (the same boot id, device and inode: containers or network
   namespaces of one machine) are grouped: the first of each group stages, the others check after it.
2. Each staging host runs the unpack line (:mod:`hvdrun.launch.envcopy`) and answers HAVE (a copy is there) or
   NEED. The hosts that NEED form a tree in host order, ``fanout`` children a host (``HVDRUN_STAGE_FANOUT``,
   default :data:`DEFAULT_FANOUT`): depth ``ceil(log_fanout(hosts))``. Ten hosts, fan-out 3::

       0 -> 1 2 3        1 -> 4 5 6        2 -> 7 8 9

3. The root reads the environment itself (``tar -cf -`` of its directory, which it sees on the shared file
   system: the only read of the source for the whole job), or, where it cannot see it, hvdrun streams it over
   the root's connection. Each host unpacks what it receives while it passes it on to its children, so the
   copy moves down the tree as a pipeline: time is about the environment's size over one link's bandwidth
   (shared among ``fanout`` children) plus a chunk's delay a level.

A host that fails is named with its cause; its subtree fails with "the stream from PARENT ended early" and the
error is the failed host nearest the root.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hvdrun.errors import LaunchError, UsageError
from hvdrun.launch.envcopy import Environment, HostStaged, unpack_command, unpack_failure
from hvdrun.launch.remote import stage_relay
from hvdrun.launch.remote.stage_relay import LineReader, frame, proof, send_json

FANOUT_VARIABLE = "HVDRUN_STAGE_FANOUT"
DEFAULT_FANOUT = 4
RELAY_PATH = Path(stage_relay.__file__)
REPORT_TIMEOUT_S = 120.0  # for every relay to call back after it was started
IO_TIMEOUT_S = stage_relay.IO_TIMEOUT_S
HELLO_TIMEOUT_S = 10.0  # a relay says hello as soon as it connected


def stage_fanout(environ: Mapping[str, str]) -> int:
    """The tree's fan-out: ``HVDRUN_STAGE_FANOUT`` (at least 1), else :data:`DEFAULT_FANOUT`.

    Raises:
        UsageError: it is not a whole number of at least 1.
    """
    value = environ.get(FANOUT_VARIABLE, "")
    if not value:
        return DEFAULT_FANOUT
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"{FANOUT_VARIABLE}={value!r}: expected a whole number of children a host, at least 1")
    return int(value)


def parent_of(position: int, fanout: int) -> int | None:
    """The position of the host that feeds the host at ``position`` of the tree (None: the root)."""
    return None if position == 0 else (position - 1) // fanout


def tree_depth(count: int, fanout: int) -> int:
    """Levels below the root for ``count`` hosts."""
    depth, position = 0, count - 1
    while position > 0:
        position = (position - 1) // fanout
        depth += 1
    return depth


def relay_command(python: str, addr: str, port: int, index: str, directory: str) -> list[str]:
    """The command that runs one host's relay with ``python`` (isolated: only the standard library is read)."""
    return [python, "-I", "-S", str(RELAY_PATH), addr, str(port), index, directory]


class RelayStarter(Protocol):
    """Starts the relays on the hosts, one a host, and says when one ended before it called back."""

    def start(self, addr: str, port: int, token: str) -> None:
        """Start every host's relay, calling back to ``addr:port`` with ``token``."""
        ...

    def failure(self, index: int) -> str | None:
        """Why host ``index``'s relay ended, when it did; None while it runs (or may still start)."""
        ...

    def stop(self) -> None:
        """Wait for the relays to end (they end once the coordinator closes their connection), then let go."""
        ...


@dataclass
class _Peer:
    """One host's relay, as the coordinator knows it."""

    index: int
    name: str
    sock: socket.socket
    reader: LineReader
    identity: str = ""
    answer: dict[str, Any] = field(default_factory=dict)
    end: dict[str, Any] = field(default_factory=dict)

    def send(self, message: dict[str, Any]) -> None:
        send_json(self.sock, message)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            send_json(self.sock, {"do": "quit"})
        self.sock.close()


@dataclass(frozen=True)
class TreeReport:
    """What the tree did: its hosts' staging, who read the source and how many bytes, its shape."""

    staged: list[HostStaged]
    source_host: str | None = None  # the root, which read the environment (None: hvdrun streamed it)
    source_bytes: int = 0
    fanout: int = DEFAULT_FANOUT
    depth: int = 0


class StageTree:
    """The coordinator of one job's staging tree over ``names`` (the remote hosts, in host order)."""

    def __init__(self, names: Sequence[str], environment: Environment, directory: str, fanout: int) -> None:
        self.names, self.environment, self.directory, self.fanout = list(names), environment, directory, fanout
        self.token = secrets.token_hex(16)
        self._listener = socket.create_server(("0.0.0.0", 0), backlog=min(len(names), 1024))  # noqa: S104
        self.port = self._listener.getsockname()[1]
        self._peers: dict[int, _Peer] = {}

    def run(self, starter: RelayStarter, addr: str) -> TreeReport:
        """Start the relays with ``starter`` (they call back to ``addr``), stage every host, and report.

        Raises:
            UsageError: the staging directory cannot be used on a host (named).
            LaunchError: a host's relay or unpack failed (the one nearest the root is named).
        """
        try:
            starter.start(addr, self.port, self.token)
            self._gather(starter)
            leaders, followers = self._groups()
            report = self._stage(leaders, addr)
            self._check(followers, addr)
            for peer in followers:
                self._raise_failure(peer)
            return TreeReport([*report.staged, *(self._staged(p, "") for p in followers)], report.source_host,
                              report.source_bytes, self.fanout, report.depth)
        finally:
            for peer in self._peers.values():
                peer.close()
            self._listener.close()
            starter.stop()

    def _gather(self, starter: RelayStarter) -> None:
        """Every relay's hello, each with the token's proof, within :data:`REPORT_TIMEOUT_S`."""
        deadline = time.monotonic() + REPORT_TIMEOUT_S
        self._listener.settimeout(0.5)
        while len(self._peers) < len(self.names):
            for index in range(len(self.names)):
                why = None if index in self._peers else starter.failure(index)
                if why is not None:
                    raise LaunchError(f"--stage-env: the staging relay on {self.names[index]} ended: {why}",
                                      self.names[index])
            if time.monotonic() > deadline:
                missing = [name for i, name in enumerate(self.names) if i not in self._peers]
                raise LaunchError(f"--stage-env: no word within {REPORT_TIMEOUT_S:.0f} s from the staging relay on "
                                  f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}", missing[0])
            with contextlib.suppress(TimeoutError):
                self._admit(*self._listener.accept())

    def _admit(self, sock: socket.socket, _: object) -> None:
        """One relay's hello, kept when it proves the token and names a host of the job not yet seen."""
        sock.settimeout(HELLO_TIMEOUT_S)  # a connection that says nothing does not hold up the others for long
        nonce = secrets.token_hex(16)
        reader = LineReader(sock)
        try:
            send_json(sock, {"nonce": nonce})
            hello = reader.line()
        except (OSError, EOFError, ValueError):
            sock.close()
            return
        index = hello.get("index")
        if (not secrets.compare_digest(str(hello.get("proof", "")), proof(self.token, nonce))
                or not isinstance(index, int) or not 0 <= index < len(self.names) or index in self._peers):
            sock.close()
            return
        sock.settimeout(IO_TIMEOUT_S)
        self._peers[index] = _Peer(index, self.names[index], sock, reader, str(hello.get("identity", "")))

    def _groups(self) -> tuple[list[_Peer], list[_Peer]]:
        """The first host of each shared directory (it stages), and the others (they check after it)."""
        leaders: dict[str, _Peer] = {}
        followers = []
        for index in sorted(self._peers):
            peer = self._peers[index]
            if peer.identity in leaders:
                followers.append(peer)
            else:
                leaders[peer.identity] = peer
        return list(leaders.values()), followers

    def _check(self, peers: Sequence[_Peer], addr: str) -> None:
        """Each of ``peers`` runs the unpack line and answers (HAVE and failures come as an end)."""
        argv = unpack_command(self.directory, self.environment)
        for peer in peers:
            peer.send({"do": "check", "argv": argv, "prefix": self.environment.prefix, "peer": addr})
        for peer in peers:
            message = self._read(peer)
            if "end" in message:
                peer.end = message
            else:
                peer.answer = message

    def _stage(self, leaders: Sequence[_Peer], addr: str) -> TreeReport:
        """The leaders that need a copy get it down the tree."""
        self._check(leaders, addr)
        for peer in leaders:
            self._raise_failure(peer)
        needing = [peer for peer in leaders if peer.answer]
        if not needing:
            return TreeReport([self._staged(peer, "") for peer in leaders])
        kib = _kib(self.environment.prefix)
        root = needing[0]
        from_env = bool(root.answer.get("sees_source"))
        for position, peer in enumerate(needing):
            peer.send(self._feed(needing, position, kib, from_env))
        if not from_env:
            self._stream_to(root)
        for peer in needing:
            peer.end = self._read(peer)
        for peer in needing:  # parents before children: the failure nearest the root is the cause
            self._raise_failure(peer)
        via = {peer.index: "tree" for peer in needing}
        return TreeReport([self._staged(peer, via.get(peer.index, "")) for peer in leaders],
                          root.name if from_env else None, int(root.end.get("source_bytes") or 0)
                          if from_env else int(root.end.get("bytes") or 0), self.fanout,
                          tree_depth(len(needing), self.fanout))

    def _feed(self, needing: Sequence[_Peer], position: int, kib: int, from_env: bool) -> dict[str, Any]:
        """The feed message of the host at ``position``: its source and how many children it serves."""
        children = sum(1 for p in range(1, len(needing)) if parent_of(p, self.fanout) == position)
        message: dict[str, Any] = {"do": "feed", "children": children, "kib": kib, "prefix": self.environment.prefix}
        parent = parent_of(position, self.fanout)
        if parent is None:
            return {**message, "source": "env" if from_env else "coordinator", "from_host": "hvdrun"}
        feeder = needing[parent]
        return {**message, "source": "parent", "parent": [feeder.answer["addr"], feeder.answer["port"]],
                "from_host": feeder.name}

    def _stream_to(self, root: _Peer) -> None:
        """The environment as a framed tar stream over the root's connection (it cannot see the source)."""
        tar = subprocess.Popen(["tar", "-C", self.environment.prefix, "-cf", "-", "."], stdout=subprocess.PIPE)
        assert tar.stdout is not None
        try:
            while chunk := tar.stdout.read(stage_relay.CHUNK):
                root.sock.sendall(frame(chunk))
                root.sock.sendall(chunk)
            if tar.wait() == 0:
                root.sock.sendall(frame(b""))
        except OSError:
            pass  # the root's end says what happened
        finally:
            tar.kill()
            tar.wait()

    def _read(self, peer: _Peer) -> dict[str, Any]:
        try:
            return peer.reader.line()
        except (OSError, EOFError, ValueError) as e:
            raise LaunchError(f"--stage-env: lost the staging relay on {peer.name}: {e or type(e).__name__}",
                              peer.name) from None

    def _raise_failure(self, peer: _Peer) -> None:
        """The host's error when its unpack failed."""
        if not peer.end and not peer.answer:
            raise LaunchError(f"--stage-env: the staging relay on {peer.name} gave no answer", peer.name)
        if peer.end and (peer.end["end"] != 0 or _copy_of(peer.end) is None):
            raise unpack_failure(peer.name, self.directory, int(peer.end["end"]), str(peer.end.get("stderr", "")))

    def _staged(self, peer: _Peer, via: str) -> HostStaged:
        """What ``peer`` ended with: where its copy is, its Python, what it took."""
        copy = _copy_of(peer.end) or ""
        words = str(peer.end.get("stdout", "")).split()
        copied = int(words[-1]) * 1024 if via and words and words[-1].isdigit() else 0
        return HostStaged(peer.name, copy, f"{copy}/{self.environment.relative_python}", copied,
                          float(peer.end.get("seconds") or 0.0), via)


def _copy_of(end: Mapping[str, Any]) -> str | None:
    """Where a relay's end says the copy is: ``HAVE PATH`` (it was there) or ``DONE PATH KIB`` (made now)."""
    for line in (str(end.get("answer", "")), *str(end.get("stdout", "")).splitlines()):
        words = line.split()
        if len(words) >= 2 and words[0] in ("HAVE", "DONE"):
            return words[1]
    return None


def _kib(prefix: str) -> int:
    """The environment's size in KiB, as ``du -sk`` counts it (what each host needs free)."""
    done = subprocess.run(["du", "-sk", "--", prefix], capture_output=True, text=True, check=False)
    words = done.stdout.split()
    return int(words[0]) if done.returncode == 0 and words and words[0].isdigit() else 0


class SshRelays:
    """Relays started in an exec channel of each host's SSH connection (the launcher's, or one opened for it)."""

    def __init__(self, hosts: Sequence[tuple[Any, str]], directory: str,
                 connection: Callable[[Any], contextlib.AbstractContextManager[Any]]) -> None:
        self.hosts, self.directory, self.connection = list(hosts), directory, connection
        self._stack = contextlib.ExitStack()
        self._channels: dict[int, Any] = {}
        self._errors: dict[int, str] = {}

    def start(self, addr: str, port: int, token: str) -> None:
        threads = [threading.Thread(target=self._start_one, args=(index, host, python, addr, port, token),
                                    daemon=True) for index, (host, python) in enumerate(self.hosts)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _start_one(self, index: int, host: Any, python: str, addr: str, port: int, token: str) -> None:
        try:
            client = self._stack.enter_context(self.connection(host))
            transport = client.get_transport()
            channel = transport.open_session(timeout=IO_TIMEOUT_S)
            channel.exec_command(shlex.join(relay_command(python, addr, port, str(index), self.directory)))
            channel.sendall(f"{token}\n".encode())
            self._channels[index] = channel
        except Exception as e:  # noqa: BLE001 - LaunchError, paramiko's and socket errors: the host's cause
            self._errors[index] = str(e) or type(e).__name__

    def failure(self, index: int) -> str | None:
        if index in self._errors:
            return self._errors[index]
        channel = self._channels.get(index)
        if channel is None or not channel.exit_status_ready():
            return None
        error = b""
        while channel.recv_stderr_ready():
            error += channel.recv_stderr(65536)
        lines = error.decode(errors="replace").strip().splitlines()
        return f"exit code {channel.recv_exit_status()}" + (f": {lines[-1]}" if lines else "")

    def stop(self) -> None:
        for channel in self._channels.values():
            channel.settimeout(10.0)
            with contextlib.suppress(Exception):
                channel.recv_exit_status()
            channel.close()
        self._stack.close()


class ProcessRelays:
    """Relays started by one command on this machine that starts one per host (``mpiexec``, one rank a host)."""

    def __init__(self, argv_env: Callable[[str, int, str], tuple[list[str], dict[str, str]]]) -> None:
        self.argv_env = argv_env
        self._program = ""
        self._process: subprocess.Popen[bytes] | None = None
        self._output = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()

    def start(self, addr: str, port: int, token: str) -> None:
        argv, env = self.argv_env(addr, port, token)
        self._program = Path(argv[0]).name
        self._process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=self._output,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def failure(self, index: int) -> str | None:
        if self._process is None or self._process.poll() is None:
            return None
        self._output.seek(0)
        lines = self._output.read().decode(errors="replace").strip().splitlines()
        return f"{self._program} exited with code {self._process.returncode}" + (f": {lines[-1]}" if lines else "")

    def stop(self) -> None:
        if self._process is not None:
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, 9)
                self._process.wait()
        self._output.close()
