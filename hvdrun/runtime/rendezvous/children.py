"""The hosts a leader admits in a large job's rendezvous tree (:mod:`hvdrun.protocol.tree`), so that rank 0's
admissions, and every leader's, stay at most the tree's fan-out whatever the number of hosts.

An inner host's leader (a host leader, :mod:`.leader`) listens on the port the launcher found free there; its
children (other hosts' leaders, or a host's only rank) join it as they would join rank 0. It sends their records
up as they arrive (rank 0 still names exactly the ranks that never came), hands them the table it receives, and
relays, as for its own host's ranks: down, aborts, signals, barrier releases, goodbyes and report requests; up,
aborts, reports, barrier arrivals (counted for its whole subtree) and a child that drops without a goodbye, named.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from hvdrun.protocol.wire import AuthError, authenticate_client, recv_frame, send_frame
from hvdrun.runtime.peers import Peer
from hvdrun.runtime.rendezvous.common import HANDSHAKE_TIMEOUT_S


class Child:
    """One connection below a leader in the tree: a child host's leader (its subtree's ranks), or a host's only
    rank."""

    def __init__(self, sock: socket.socket, peers: list[Peer]) -> None:
        self.sock, self.peers = sock, peers
        self.said_bye = False

    @property
    def first(self) -> Peer:
        """The rank that connected (a host's leader)."""
        return self.peers[0]


class Children:
    """The child hosts of a leader in the tree (see the module docstring).

    Args:
        listener: where this host's leader admits its children (TCP).
        secret: the job's secret; a connection that does not prove it is refused.
        generation: this process's init() generation; a child of another one is told to retry (as rank 0 does).
    """

    def __init__(self, listener: socket.socket, secret: bytes, generation: int) -> None:
        self.listener, self.secret, self.generation = listener, secret, generation
        self.by_sock: dict[socket.socket, Child] = {}

    def live(self) -> list[socket.socket]:
        """The children that have not said goodbye."""
        return [sock for sock, child in self.by_sock.items() if not child.said_bye]

    def ranks(self) -> list[int]:
        """Every rank below (the children's and their hosts')."""
        return [peer.rank for child in self.by_sock.values() for peer in child.peers]

    def admit(self) -> list[Peer]:
        """Accept one connection: its handshake and records within :data:`HANDSHAKE_TIMEOUT_S`; the ranks it brings
        (none for a connection that is not a child of this job and generation, closed)."""
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return []
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            authenticate_client(sock, self.secret)
            generation, row = recv_frame(sock)
            if generation != self.generation:
                send_frame(sock, ("retry", f"its parent's leader is at init #{self.generation}, not #{generation}"))
                sock.close()
                return []
            peers = [Peer(*r) for r in row] if isinstance(row, list) else [Peer(*row)]
        except (OSError, ValueError, TypeError, EOFError, AuthError, ConnectionError):
            sock.close()
            return []
        sock.settimeout(None)
        self.by_sock[sock] = Child(sock, peers)
        return peers

    def more_rows(self, sock: socket.socket) -> list[Peer]:
        """A child leader's next ranks, as they join it; a child that drops now is forgotten (its ranks stay
        missing, and rank 0 names them at its deadline)."""
        child = self.by_sock[sock]
        try:
            kind, rows = recv_frame(sock)
            if kind != "rows":
                raise ValueError(kind)
            peers = [Peer(*row) for row in rows]
        except (OSError, ValueError, TypeError, EOFError, ConnectionError):
            del self.by_sock[sock]
            sock.close()
            return []
        child.peers += peers
        return peers

    def receive(self, sock: socket.socket) -> tuple[Child, Any]:
        """The next message of a child after the table (None: its connection ended)."""
        try:
            return self.by_sock[sock], recv_frame(sock)
        except (OSError, ConnectionError, EOFError, ValueError):
            return self.by_sock[sock], None

    def send_all(self, message: Any, send: Any = send_frame) -> None:
        """``message`` to every child still here (one that cannot take it is found by the watch)."""
        for sock in self.live():
            try:
                send(sock, message)
            except OSError:
                pass

    def close(self) -> None:
        """Close every connection and the endpoint."""
        for sock in self.by_sock:
            sock.close()
        self.listener.close()


def wait_listen(port: int, deadline: float) -> socket.socket:
    """Where an inner host's leader admits its children: ``port``, every interface (the launcher gave the children
    the address);
    retried until ``deadline`` while the port is still held (the last init()'s leader closing it).

    Raises:
        OSError: the port stays taken.
    """
    while True:
        try:
            return socket.create_server(("", port), backlog=128, reuse_port=False)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
