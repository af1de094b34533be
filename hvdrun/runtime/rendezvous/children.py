"""The hosts a leader admits in a large job's rendezvous tree (:mod:`hvdrun.protocol.tree`), so that rank 0's
admissions, and every leader's, stay at most the tree's fan-out whatever the number of hosts.

An inner host's leader (a host leader, :mod:`.leader`) listens on the port the launcher found free there; its
children (other hosts' leaders, or a host's only rank) join it as they would join rank 0. It sends their records
up as they arrive (rank 0 still names exactly the ranks that never came), hands them the table it receives, and
relays, as for its own host's ranks: down, aborts, signals, barrier releases, goodbyes and report requests; up,
aborts, reports, barrier arrivals (counted for its whole subtree) and a child that drops without a goodbye, named.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from typing import Any

from hvdrun.protocol.wire import AuthError, authenticate_client, recv_frame, send_frame
from hvdrun.runtime.peers import Peer
from hvdrun.runtime.rendezvous.common import HANDSHAKE_TIMEOUT_S, handshake_on_thread, send_to_each

_HANDSHAKES = 64  # unauthenticated connections handled at once; more are refused (a flood cannot stall the gather)


class Child:
    """One connection below a leader in the tree: a child host's leader (its subtree's ranks), or a host's only
    rank. ``lost``: its connection failed while the leader still gathered (its ranks were sent up: once the table
    is out, the leader names it as rank 0 names a rank that dies)."""

    def __init__(self, sock: socket.socket, peers: list[Peer]) -> None:
        self.sock, self.peers = sock, peers
        self.said_bye = self.lost = False

    @property
    def first(self) -> Peer:
        """The rank that connected (a host's leader)."""
        return self.peers[0]


class Children:
    """The child hosts of a leader in the tree (see the module docstring).

    Handshakes run on threads of their own, each dropped after :data:`HANDSHAKE_TIMEOUT_S` (as rank 0's): the
    gather loop only takes the connections that proved the job's secret (:meth:`take_admitted`), woken by a pipe.

    Args:
        listener: where this host's leader admits its children (TCP).
        secret: the job's secret; a connection that does not prove it is refused.
        generation: this process's init() generation; a child of another one is told to retry (as rank 0 does).
        size: the job's ranks; a child that brings a rank outside it, or one already here, is refused.
    """

    def __init__(self, listener: socket.socket, secret: bytes, generation: int, size: int) -> None:
        self.listener, self.secret, self.generation, self.size = listener, secret, generation, size
        self.by_sock: dict[socket.socket, Child] = {}
        self._admitted: queue.SimpleQueue[tuple[socket.socket, list[Peer]]] = queue.SimpleQueue()
        self._handshakes = threading.BoundedSemaphore(_HANDSHAKES)
        self.wake_fd, self._wake_write = os.pipe()
        os.set_blocking(self.wake_fd, False)
        self.table_sent = False  # after it, a connection is refused (rank 0 refuses late ranks alike)

    def gather_fds(self) -> list[Any]:
        """What the gather loop watches: new connections, finished handshakes, the children's next rows."""
        return [self.listener, self.wake_fd, *(sock for sock, child in self.by_sock.items() if not child.lost)]

    def live(self) -> list[socket.socket]:
        """The children still watched (neither said goodbye nor lost)."""
        return [sock for sock, child in self.by_sock.items() if not (child.said_bye or child.lost)]

    def lost(self) -> list[Child]:
        """The children whose connection failed during the gather."""
        return [child for child in self.by_sock.values() if child.lost]

    def ranks(self) -> list[int]:
        """Every rank below (the children's and their hosts')."""
        return [peer.rank for child in self.by_sock.values() for peer in child.peers]

    def accept(self) -> None:
        """Take one connection and start its handshake on a thread of its own (refused past the limit)."""
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        handshake_on_thread(sock, self._handshakes, self._admit)

    def _admit(self, sock: socket.socket) -> None:
        """A child's handshake (on its own thread): handed to the gather loop, woken by the pipe."""
        peers = self._handshake(sock)
        if peers:
            self._admitted.put((sock, peers))
            os.write(self._wake_write, b"\0")

    def _handshake(self, sock: socket.socket) -> list[Peer]:
        """The job's secret and the child's records; none (closed) for a connection that is not a child of this job
        and generation."""
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            authenticate_client(sock, self.secret)
            generation, row = recv_frame(sock)
            if generation != self.generation:
                send_frame(sock, ("retry", f"its parent's leader is at init #{self.generation}, not #{generation}"))
                sock.close()
                return []
            return [Peer(*r) for r in row] if isinstance(row, list) else [Peer(*row)]
        except (OSError, ValueError, TypeError, EOFError, AuthError, ConnectionError):
            sock.close()
            return []

    def take_admitted(self) -> list[Peer]:
        """The children whose handshakes finished since the last call, now watched; their ranks."""
        try:
            os.read(self.wake_fd, 4096)
        except BlockingIOError:
            pass
        joined: list[Peer] = []
        while not self._admitted.empty():
            sock, peers = self._admitted.get()
            if self._refuse(sock, peers):
                continue
            sock.settimeout(None)
            self.by_sock[sock] = Child(sock, peers)
            joined += peers
        return joined

    def _refuse(self, sock: socket.socket, peers: list[Peer]) -> bool:
        """Refuse (and close) a child that comes after the table, or brings a rank this job does not expect or
        that is here already."""
        here = set(self.ranks())
        for peer in peers:
            if self.table_sent or not 0 < peer.rank < self.size or peer.rank in here:
                try:
                    send_frame(sock, ("error", f"rank {peer.rank} is not expected by its parent's leader"))
                except OSError:
                    pass
                sock.close()
                return True
            here.add(peer.rank)
        return False

    def more_rows(self, sock: socket.socket) -> list[Peer]:
        """A child leader's next ranks, as they join it; a child whose connection fails now is marked lost."""
        child = self.by_sock[sock]
        try:
            kind, rows = recv_frame(sock)
            if kind != "rows":
                raise ValueError(kind)
            peers = [Peer(*row) for row in rows]
        except (OSError, ValueError, TypeError, EOFError, ConnectionError):
            child.lost = True
            return []
        child.peers += peers
        return peers

    def receive(self, sock: socket.socket) -> tuple[Child, Any]:
        """The next message of a child after the table (None: its connection ended, or it sent no message)."""
        try:
            message = recv_frame(sock)
        except (OSError, ConnectionError, EOFError, ValueError, TypeError):
            message = None
        return self.by_sock[sock], message if isinstance(message, tuple) and message else None

    def send_all(self, message: Any, send: Any = send_frame) -> None:
        """``message`` to every child still watched (one that cannot take it is found by the watch)."""
        send_to_each(self.live(), message, send)

    def close(self) -> None:
        """Close every connection, the endpoint and the wake pipe."""
        for sock in self.by_sock:
            sock.close()
        self.listener.close()
        for fd in (self.wake_fd, self._wake_write):
            try:
                os.close(fd)
            except OSError:
                pass

