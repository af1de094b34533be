"""``--stage-env`` as a tree: the environment read once from the shared file system, then passed host to host.

Every remote host runs a relay (:mod:`hvdrun.launch.remote.stage_relay`), started over SSH or by ``mpiexec``
with one process per host, which calls back to hvdrun (this module, the coordinator); both prove the job's
staging token to each other. Then, in rounds until every host has its copy:

1. Hosts whose staging directory is one directory (the same boot id, device and inode: containers or network
   namespaces of one machine) are grouped: the first of each group checks, the others wait for a later round.
2. Each checking host runs the unpack line (:mod:`hvdrun.launch.stage_unpack`) and answers HAVE (a copy is there),
   BUSY (another job holds the copy's lock: in the first round nobody waits for a lock, so two jobs never wait
   on each other), or NEED. The hosts that NEED form a tree in host order, ``fanout`` children a host
   (``HVDRUN_STAGE_FANOUT``, default :data:`DEFAULT_FANOUT`; :func:`tree_depth` levels). Ten hosts, fan-out 3::

       0 -> 1 2 3        1 -> 4 5 6        2 -> 7 8 9

3. The root reads the environment itself (``tar -cf -`` of its directory, which it sees on the shared file
   system: the only read of the source for the tree), or, where it cannot see it, hvdrun streams it over the
   root's connection. Each host unpacks what it receives while it passes it on to its children, so the copy
   moves down the tree as a pipeline: time is about the environment's size over one link's bandwidth (shared
   among ``fanout`` children) plus a chunk's delay a level.

A host that fails is named with its cause; its subtree fails with "the stream from PARENT ended early", and the
error is the failed host nearest the root.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import signal
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
from hvdrun.launch.remote import stage_relay
from hvdrun.launch.remote.stage_relay import (
    LOCK_WAIT_S,
    AuthError,
    LineReader,
    frame_header,
    handshake_as_server,
    keep_alive,
    send_json,
)
from hvdrun.launch.stage_unpack import Environment, HostStaged, unpack_command, unpack_failure
from hvdrun.protocol.tree import parent_of

FANOUT_VARIABLE = "HVDRUN_STAGE_FANOUT"
DEFAULT_FANOUT = 4
RELAY_PATH = Path(stage_relay.__file__)
REPORT_TIMEOUT_S = 120.0  # for every relay to call back after it was started
STOP_WAIT_S = 10.0  # for the relays to end once their connections closed


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


def tree_depth(count: int, fanout: int) -> int:
    """Levels below the root of a tree of ``count`` hosts in host order, ``fanout`` children a host."""
    depth, position = 0, count - 1
    while position > 0:
        position = parent_of(position, fanout)
        depth += 1
    return depth


def children_count(position: int, count: int, fanout: int) -> int:
    """How many of a tree of ``count`` hosts the host at ``position`` feeds (positions fanout * p + 1 ...)."""
    return max(0, min(fanout, count - 1 - fanout * position))


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
        """Let the relays end (they end once the coordinator closed their connections), bounded in time."""
        ...


@dataclass
class _Peer:
    """One host's relay, as the coordinator knows it."""

    index: int
    name: str
    sock: socket.socket
    reader: LineReader
    identity: str = ""
    answer: dict[str, Any] = field(default_factory=dict)  # NEED: where it listens, whether it sees the source
    end: dict[str, Any] = field(default_factory=dict)  # how its unpack line ended (HAVE, BUSY, DONE, a failure)

    @property
    def busy(self) -> bool:
        """Another job held the copy's lock when it checked."""
        return str(self.end.get("answer", "")).startswith("BUSY ")

    def send(self, message: dict[str, Any]) -> None:
        try:
            send_json(self.sock, message)
        except OSError as e:
            raise LaunchError(f"--stage-env: lost the staging relay on {self.name}: {e}", self.name) from None

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

    def __init__(self, names: Sequence[str], environment: Environment, directory: str, fanout: int,
                 interface: str | None = None) -> None:
        self.names, self.environment, self.directory, self.fanout = list(names), environment, directory, fanout
        self.interface = interface  # --network-interface: where the relays listen for their children
        self.token = secrets.token_hex(16)
        self._listener = socket.create_server(("0.0.0.0", 0), backlog=min(len(names), 1024))  # noqa: S104
        self.port = self._listener.getsockname()[1]
        self._peers: dict[int, _Peer] = {}
        self._trees: list[TreeReport] = []

    def run(self, starter: RelayStarter, addr: str) -> TreeReport:
        """Start the relays with ``starter`` (they call back to ``addr``), stage every host, and report.

        Raises:
            UsageError: the staging directory cannot be used on a host (named).
            LaunchError: a host's relay or unpack failed (the one nearest the root is named).
        """
        try:
            starter.start(addr, self.port, self.token)
            self._gather(starter)
            pending, lock_wait = [self._peers[i] for i in sorted(self._peers)], 0
            while pending:
                leaders, later = self._groups(pending)
                busy = self._round(leaders, addr, lock_wait, starter)
                pending, lock_wait = later + busy, LOCK_WAIT_S
            return self._report()
        finally:
            for peer in self._peers.values():
                peer.close()
            self._listener.close()
            starter.stop()

    def _gather(self, starter: RelayStarter) -> None:
        """Every relay's hello, each with the token's proof, within :data:`REPORT_TIMEOUT_S`."""
        deadline, checked = time.monotonic() + REPORT_TIMEOUT_S, 0.0
        self._listener.settimeout(0.2)
        while len(self._peers) < len(self.names):
            if time.monotonic() - checked > 1.0:  # once a second: a relay that ended before it called back
                checked = time.monotonic()
                self._raise_ended(starter)
            if time.monotonic() > deadline:
                missing = [name for i, name in enumerate(self.names) if i not in self._peers]
                raise LaunchError(f"--stage-env: no word within {REPORT_TIMEOUT_S:.0f} s from the staging relay on "
                                  f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}", missing[0])
            with contextlib.suppress(TimeoutError):
                self._admit(self._listener.accept()[0])

    def _raise_ended(self, starter: RelayStarter) -> None:
        for index, name in enumerate(self.names):
            why = None if index in self._peers else starter.failure(index)
            if why is not None:
                raise LaunchError(f"--stage-env: the staging relay on {name} ended: {why}", name)

    def _admit(self, sock: socket.socket) -> None:
        """One relay, kept when it proves the token (within the handshake's bound) and names a host of the job not
        yet seen."""
        sock.settimeout(stage_relay.HANDSHAKE_TIMEOUT_S)
        try:
            reader, hello = handshake_as_server(sock, self.token, "hvdrun", "relay")
        except (OSError, EOFError, ValueError, AuthError):
            sock.close()
            return
        index = hello.get("index")
        if not isinstance(index, int) or not 0 <= index < len(self.names) or index in self._peers:
            sock.close()
            return
        keep_alive(sock)
        self._peers[index] = _Peer(index, self.names[index], sock, reader, str(hello.get("identity", "")))

    @staticmethod
    def _groups(peers: Sequence[_Peer]) -> tuple[list[_Peer], list[_Peer]]:
        """The first host of each shared directory (it checks this round), and the others (a later round)."""
        leaders: dict[str, _Peer] = {}
        later = []
        for peer in peers:
            if peer.identity in leaders:
                later.append(peer)
            else:
                leaders[peer.identity] = peer
        return list(leaders.values()), later

    def _round(self, leaders: Sequence[_Peer], addr: str, lock_wait: int, starter: RelayStarter) -> list[_Peer]:
        """One round: ``leaders`` check; those that NEED get their copy down a tree; the BUSY ones, to ask again."""
        self._check(leaders, addr, lock_wait, starter)
        busy = [peer for peer in leaders if peer.busy]
        needing = [peer for peer in leaders if peer.answer]
        for peer in leaders:
            if peer not in busy and peer not in needing:
                self._raise_failure(peer)
        if needing:
            self._trees.append(self._tree(needing, starter))
        return busy

    def _check(self, peers: Sequence[_Peer], addr: str, lock_wait: int, starter: RelayStarter) -> None:
        """Each of ``peers`` runs the unpack line and answers (HAVE, BUSY and failures come as an end)."""
        argv = unpack_command(self.directory, self.environment)
        for peer in peers:
            peer.answer, peer.end = {}, {}
            peer.send({"do": "check", "argv": argv, "prefix": self.environment.prefix, "peer": addr,
                       "lock_wait": lock_wait, "interface": self.interface})
        for peer in peers:
            message = self._read(peer, starter)
            if "end" in message:
                peer.end = message
            else:
                peer.answer = message

    def _tree(self, needing: Sequence[_Peer], starter: RelayStarter) -> TreeReport:
        """The hosts that need a copy get it down a tree; the report of that tree."""
        kib = _kib(self.environment.prefix)
        root = needing[0]
        from_env = bool(root.answer.get("sees_source"))
        for position, peer in enumerate(needing):
            peer.send(self._feed(needing, position, kib, from_env))
        failed = "" if from_env else self._stream_to(root)
        for peer in needing:
            peer.end = self._read(peer, starter)
        if failed:
            raise LaunchError(f"--stage-env: hvdrun could not read {self.environment.prefix} to send it to "
                              f"{root.name} (which cannot see it): {failed}", root.name)
        for peer in needing:  # parents before children: the failure nearest the root is the cause
            self._raise_failure(peer)
        read = int(root.end.get("source_bytes" if from_env else "bytes") or 0)
        return TreeReport([self._staged(peer, "tree") for peer in needing], root.name if from_env else None, read,
                          self.fanout, tree_depth(len(needing), self.fanout))

    def _feed(self, needing: Sequence[_Peer], position: int, kib: int, from_env: bool) -> dict[str, Any]:
        """The feed message of the host at ``position``: its source and how many children it serves."""
        message: dict[str, Any] = {"do": "feed", "children": children_count(position, len(needing), self.fanout),
                                   "kib": kib, "prefix": self.environment.prefix}
        if position == 0:
            return {**message, "source": "env" if from_env else "coordinator", "from_host": "hvdrun"}
        feeder = needing[parent_of(position, self.fanout)]
        return {**message, "source": "parent", "parent": [feeder.answer["addr"], feeder.answer["port"]],
                "from_host": feeder.name}

    def _stream_to(self, root: _Peer) -> str:
        """The environment as a framed tar stream over the root's connection (it cannot see the source); what went
        wrong reading it here ('' when nothing: the root's end says the rest)."""
        with tempfile.TemporaryFile() as errors:
            tar = subprocess.Popen(["tar", "-C", self.environment.prefix, "-cf", "-", "."], stdout=subprocess.PIPE,
                                   stderr=errors)
            assert tar.stdout is not None
            try:
                while chunk := tar.stdout.read(stage_relay.CHUNK):
                    root.sock.sendall(frame_header(chunk))
                    root.sock.sendall(chunk)
                if tar.wait() == 0:
                    root.sock.sendall(frame_header(b""))
                    return ""
                root.sock.shutdown(socket.SHUT_WR)  # no end frame: the root sees the stream end early
            except OSError:
                return ""
            finally:
                tar.kill()
                tar.wait()
            errors.seek(0)
            return " ".join(errors.read().decode(errors="replace").split()[-30:]) or f"tar exited {tar.returncode}"

    def _read(self, peer: _Peer, starter: RelayStarter) -> dict[str, Any]:
        """The next message of ``peer``; a lost relay reads as a failed end naming it (and why, where known)."""
        try:
            return peer.reader.line()
        except (OSError, EOFError, ValueError) as e:
            why = starter.failure(peer.index) or str(e) or type(e).__name__
            return {"end": -1, "stderr": f"hvdrun-stage: lost the staging relay on {peer.name}: {why}"}

    def _raise_failure(self, peer: _Peer) -> None:
        """The host's error when its unpack failed (or left no copy)."""
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

    def _report(self) -> TreeReport:
        """Every host's staging (those made down a tree, and those that had it), the trees' reads and shape."""
        made = {staged.host: staged for tree in self._trees for staged in tree.staged}
        staged = [made.get(peer.name) or self._staged(peer, "") for _, peer in sorted(self._peers.items())]
        first = self._trees[0] if self._trees else TreeReport([])
        return TreeReport(staged, first.source_host, sum(tree.source_bytes for tree in self._trees), self.fanout,
                          max((tree.depth for tree in self._trees), default=0))


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
            channel = client.get_transport().open_session(timeout=stage_relay.HANDSHAKE_TIMEOUT_S)
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
        deadline = time.monotonic() + STOP_WAIT_S
        for channel in self._channels.values():  # paramiko's recv_exit_status() has no bound: poll instead
            while not channel.exit_status_ready() and time.monotonic() < deadline:
                time.sleep(0.05)
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
        """The relays end with their connections; then the launcher gets SIGTERM, and SIGKILL after a while."""
        if self._process is not None:
            for signum, wait_s in ((None, STOP_WAIT_S), (signal.SIGTERM, 5.0), (signal.SIGKILL, None)):
                if signum is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self._process.pid, signum)
                try:
                    self._process.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._output.close()
