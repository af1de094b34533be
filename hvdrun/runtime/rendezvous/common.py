"""What every role of the rendezvous shares: constants, rank 0's kept listening socket, local sockets and helpers."""

from __future__ import annotations

import errno
import hashlib
import marshal
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hvdrun import envvars
from hvdrun.errors import RendezvousError
from hvdrun.protocol.inspection import REPORT_TIMEOUT_S, STACKS
from hvdrun.protocol.sockets import MIN_BACKLOG, listen
from hvdrun.protocol.wire import send_frame
from hvdrun.runtime.peers import Peer
from hvdrun.runtime.transport.channels import AbortFlag

HANDSHAKE_TIMEOUT_S = 5.0  # an unauthenticated connection is dropped after this, whatever it sends
Reporter = Callable[[str], dict[str, Any]]  # what (STACKS or VITALS) -> this rank's report
# Rank 0 keeps its listening socket for the life of the process: between a shutdown() and the
# next init() the kernel could otherwise hand the port to another socket (an ephemeral port).
_listeners: dict[tuple[str, int], socket.socket] = {}


def reserve_listener(addr: str, port: int, sock: socket.socket) -> None:
    """Keep ``sock`` (listening on ``addr:port``) for a later rank 0 of this process to serve on."""
    _listeners[(addr, port)] = sock


def listener_for(addr: str, port: int, size: int) -> socket.socket:
    """Rank 0's listening socket on ``addr:port``: the one this process kept from an earlier init(), else a new one."""
    sock = _listeners.get((addr, port))
    if sock is None or sock.fileno() < 0:
        sock = _listeners[(addr, port)] = listen(addr, port, size)
    else:
        sock.listen(max(size, MIN_BACKLOG))  # a larger job than last time: room for all its ranks at once
    return sock


def report_request(message: tuple[Any, ...]) -> tuple[int, float, str]:
    """A ``("report?", request, timeout_s, what)`` message's request number, how long its asker waits, and what it
    asks for (older peers send neither of the last two: stacks, within :data:`REPORT_TIMEOUT_S`)."""
    timeout_s = float(message[2]) if len(message) > 2 else REPORT_TIMEOUT_S
    return int(message[1]), timeout_s, str(message[3]) if len(message) > 3 else STACKS


def report_or_none(reporter: Reporter | None, what: str = STACKS) -> dict[str, Any] | None:
    """The reporter's report of ``what`` (:data:`~hvdrun.protocol.inspection.STACKS` or
    :data:`~hvdrun.protocol.inspection.VITALS`), or None when there is none or it failed: a report never breaks the
    control plane."""
    if reporter is None:
        return None
    try:
        report = reporter(what)
        marshal.dumps(report)  # what travels must marshal
        return report
    except Exception:  # noqa: BLE001
        return None


def signal_self(signum: Any) -> None:
    """Pass a forwarded signal to this rank's process (its handler runs in the main thread)."""
    try:
        os.kill(os.getpid(), int(signum))
    except (OSError, ValueError, TypeError):
        pass


def send_to_each(socks: Iterable[socket.socket], message: Any,
                 send: Callable[[socket.socket, Any], None] = send_frame) -> None:
    """``message`` to every one of ``socks``; one that cannot take it is left to whatever watches it."""
    for sock in socks:
        try:
            send(sock, message)
        except OSError:
            pass


def disconnected(peer: Peer) -> str:
    """Why the job stops when ``peer``'s control connection ends without a goodbye (as rank 0 and leaders say it)."""
    return f"{peer.describe()} disconnected without shutting down: it exited or crashed"


def drop_handshake(sock: socket.socket) -> None:
    """End a handshake that took too long (the admitting thread's recv then fails)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def handshake_on_thread(sock: socket.socket, handshakes: threading.BoundedSemaphore,
                        handshake: Callable[[socket.socket], object]) -> None:
    """Run ``handshake(sock)`` for an accepted connection on a thread of its own, dropped after
    :data:`HANDSHAKE_TIMEOUT_S`; with every one of ``handshakes`` taken, refuse it (a flood of connections that never
    authenticate must not stop the serving loop, nor hold it up)."""
    if not handshakes.acquire(blocking=False):
        sock.close()
        return

    def within_deadline() -> None:
        watchdog = threading.Timer(HANDSHAKE_TIMEOUT_S, drop_handshake, args=(sock,))
        watchdog.name = "hvdrun-handshake-watchdog"
        watchdog.start()
        try:
            handshake(sock)
        finally:
            watchdog.cancel()
            handshakes.release()

    threading.Thread(target=within_deadline, name="hvdrun-admit", daemon=True).start()


def local_socket_name(secret: bytes, generation: int, host_key: str) -> str:
    """The abstract Unix socket (Linux) where a host's leader gathers that host's ranks: derived from the job's
    secret (not revealing it), the init generation and the host, so jobs and hosts never share one."""
    digest = hashlib.sha256(secret + f"/{generation}/{host_key}".encode()).hexdigest()[:32]
    return f"\0hvdrun-rdv-{digest}"


def try_listen_local(name: str) -> socket.socket | None:
    """Listen on the abstract Unix socket ``name``; None when another rank of this host listens there already
    (it leads the host: the first rank of a host to bind leads it, whatever its local rank).

    Raises:
        RendezvousError: the socket cannot be made for another reason.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(name)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            return None
        raise RendezvousError(f"cannot gather this host's ranks on a local socket: {e.strerror}") from e
    sock.listen(MIN_BACKLOG)
    return sock


def same_user(sock: socket.socket) -> bool:
    """Whether the peer of a Unix socket runs as this process's user (other users may connect to an abstract
    socket: they are turned away before the handshake, so that they cannot hold up the host's ranks)."""
    try:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                               struct.calcsize("3i")))
    except OSError:
        return False
    return uid == os.getuid()


def route_to(addr: str, port: int) -> str:
    """This host's address on the route to ``addr`` (a UDP socket's source address: nothing is sent).

    Raises:
        RendezvousError: no route (the address does not resolve, or no interface reaches it).
    """
    try:
        family, kind, proto, _, target = socket.getaddrinfo(addr, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(target)
            return str(probe.getsockname()[0])
    except (OSError, IndexError) as e:
        raise RendezvousError(f"cannot find this host's address on the route to rank 0 at {addr}: {e}") from e


@dataclass(frozen=True)
class Upstream:
    """Where a rank joins: rank 0 over TCP, its parent host's leader in the rendezvous tree over TCP
    (``tree_parent``), or its host's leader over a local socket (``local_name``)."""

    addr: str
    port: int
    local_name: str | None = None
    tree_parent: bool = False

    @property
    def is_rank0(self) -> bool:
        """Whether this is rank 0 itself (over TCP)."""
        return not (self.local_name or self.tree_parent)

    def describe(self) -> str:
        """``rank 0 at ADDR:PORT``, ``its parent in the rendezvous tree at ADDR:PORT`` or ``this host's leader``
        (whichever local rank bound the host's socket first)."""
        if self.local_name:
            return "this host's leader"
        who = "rank 0" if self.is_rank0 else "its parent in the rendezvous tree"
        return f"{who} at {self.addr}:{self.port}"

    def lost(self, leader: str | None = None) -> str:
        """Why a rank stops when its connection upstream ends unannounced; ``leader``: the rank that leads, as the
        table it sent named it."""
        named = f", {leader}," if leader else ""
        if self.local_name and leader:  # (rank 0's host: rank 0 leads it, and its table names no leader)
            return f"lost the connection to this host's leader, {leader}: it exited or crashed"
        if self.tree_parent:
            return f"lost the connection to its parent in the rendezvous tree{named} at {self.addr}:{self.port}: " \
                "it exited or crashed"
        return f"lost the connection to rank 0 at {self.addr}: rank 0 exited or crashed"

    def open(self) -> socket.socket:
        """A connected socket (not yet authenticated)."""
        if self.local_name is None:
            return socket.create_connection((self.addr, self.port), timeout=HANDSHAKE_TIMEOUT_S)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            sock.connect(self.local_name)
        except OSError:
            sock.close()
            raise
        return sock




class Barriers:
    """Set-up barriers over the control connections (the data plane's links are not all usable yet): how many
    ranks reached barrier N so far, and whether N was released. Waits end on release, abort or deadline."""

    def __init__(self, abort: AbortFlag) -> None:
        self.abort = abort
        self._changed = threading.Condition()
        self._counts: dict[int, int] = {}
        self._released: set[int] = set()

    def add(self, number: int, count: int) -> int:
        """``count`` more ranks reached barrier ``number``; the total so far."""
        with self._changed:
            self._counts[number] = self._counts.get(number, 0) + count
            self._changed.notify_all()
            return self._counts[number]

    def release(self, number: int) -> None:
        """Barrier ``number`` is complete everywhere."""
        with self._changed:
            self._released.add(number)
            self._changed.notify_all()

    def wait(self, number: int, deadline: float, reached: int | None = None) -> None:
        """Until barrier ``number`` is released (or, with ``reached``, until that many ranks reached it).

        Raises:
            CollectiveError: the job was aborted meanwhile (a rank died).
            RendezvousError: the deadline passed.
        """
        with self._changed:
            while not (number in self._released if reached is None else self._counts.get(number, 0) >= reached):
                self.abort.check()
                if time.monotonic() > deadline:
                    raise RendezvousError(f"set-up barrier {number}: not every rank arrived before the start "
                                          f"deadline (raise {envvars.START_TIMEOUT} if they start slowly)")
                self._changed.wait(0.05)
