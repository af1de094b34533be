"""A rendezvous group: hosts that join a group leader instead of rank 0, so that rank 0's admissions grow with
the number of groups, not of hosts.

The launcher cuts a large job's hosts into groups (:mod:`hvdrun.protocol.groups`). Group 0 joins rank 0 (it runs
there); in group g > 0 the leader of the group's first host listens on the group's endpoint, and the group's
other hosts (their leaders, or a host's only rank) join it there, as they would join rank 0. The group leader is
a host leader (:mod:`.leader`) with :class:`Children` below it: it sends their records up as they arrive (rank 0
still names exactly the ranks that never came), hands them the table rank 0 sent, and relays, as for its own
host's ranks: down, aborts, signals, barrier releases, goodbyes and report requests; up, aborts, reports, barrier
arrivals (counted for the whole group) and a child that drops without a goodbye, named. Rank 0 holds one
connection per group: about H / G + G admissions in a row instead of H.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from hvdrun.protocol.wire import AuthError, authenticate_client, recv_frame, send_frame
from hvdrun.runtime.peers import Peer
from hvdrun.runtime.rendezvous.common import HANDSHAKE_TIMEOUT_S


class Child:
    """One connection below a group leader: another host's leader (its host's ranks), or a host's only rank."""

    def __init__(self, sock: socket.socket, peers: list[Peer]) -> None:
        self.sock, self.peers = sock, peers
        self.said_bye = False

    @property
    def first(self) -> Peer:
        """The rank that connected (a host's leader)."""
        return self.peers[0]


class Children:
    """The connections below a group leader (see the module docstring).

    Args:
        listener: the group's TCP endpoint, bound by this host's leader.
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
                send_frame(sock, ("retry", f"the group's leader is at init #{self.generation}, not #{generation}"))
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
    """The group leader's endpoint on ``port``, every interface (its address is how the members reach it);
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
