"""The native backend's connections: the ring's two channels and the links of the hierarchical collectives.

Every TCP connection is dialled to a rank's data port and authenticated with the job's secret; its
first frame says what it is: ``("ring", rank)`` (the previous rank of the ring) or ``("link", rank)``
(a duplex link, dialled by the lower rank). One acceptor thread per rank takes every expected
connection. A link between ranks of one host is two shared-memory segments instead, one each way,
named after the reader and the writer (:class:`~hvdrun.runtime.transport.shm.ShmSegment`).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable

from hvdrun.errors import RendezvousError
from hvdrun.protocol.wire import AuthError, authenticate_client, authenticate_server, recv_frame, send_frame
from hvdrun.runtime.collectives.pairwise import Link
from hvdrun.runtime.peers import Peer
from hvdrun.runtime.transport.shm import ShmRx, ShmSegment, ShmTx
from hvdrun.runtime.transport.tcp import TcpRx, TcpTx, tune

CONNECT_TIMEOUT_S = 30.0
RING, LINK = "ring", "link"


class Acceptor:
    """Accepts, in a thread, the connections this rank expects: ``(purpose, rank)`` pairs."""

    def __init__(self, listener: socket.socket, expected: Iterable[tuple[str, int]], secret: bytes) -> None:
        self.expected, self.secret = set(expected), secret
        self.accepted: dict[tuple[str, int], socket.socket] = {}
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, args=(listener,), name="hvdrun-accept", daemon=True)
        if self.expected:
            self._thread.start()

    def _run(self, listener: socket.socket) -> None:
        listener.settimeout(CONNECT_TIMEOUT_S)
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while time.monotonic() < deadline and set(self.accepted) != self.expected:
            try:
                sock, _ = listener.accept()
            except OSError as e:
                if listener.fileno() < 0:
                    return  # set-up failed and closed the listener: nobody waits for the rest
                self.error = str(e)
                continue
            try:
                sock.settimeout(CONNECT_TIMEOUT_S)
                authenticate_client(sock, self.secret)
                frame = tuple(recv_frame(sock))
                if frame not in self.expected or frame in self.accepted:
                    raise ValueError(f"unexpected connection {frame}")
                tune(sock)
            except (OSError, ConnectionError, ValueError, EOFError, AuthError, TypeError) as e:
                self.error = str(e)
                sock.close()
                continue
            self.accepted[frame] = sock  # type: ignore[index]

    def take(self, purpose: str, peer: Peer) -> socket.socket:
        """The connection of ``peer`` for ``purpose``, waiting for it.

        Raises:
            RendezvousError: it did not connect in time.
        """
        self._thread.join(CONNECT_TIMEOUT_S + 1)
        sock = self.accepted.get((purpose, peer.rank))
        if sock is None:
            raise RendezvousError(f"{peer.describe()} did not connect to this rank's data port within "
                                  f"{CONNECT_TIMEOUT_S:.0f} s" + (f" (last error: {self.error})" if self.error else ""))
        return sock


def dial(me: Peer, peer: Peer, secret: bytes, purpose: str) -> socket.socket:
    """Connect to ``peer``'s data port for ``purpose``.

    Raises:
        RendezvousError: it cannot be reached or does not authenticate.
    """
    try:
        sock = socket.create_connection((peer.data_addr, peer.data_port), timeout=CONNECT_TIMEOUT_S)
    except OSError as e:
        raise RendezvousError(f"cannot connect to {peer.describe()} at {peer.data_addr}:{peer.data_port}: {e}") from e
    try:
        authenticate_server(sock, secret, peer.describe())
        send_frame(sock, (purpose, me.rank))
    except AuthError:
        sock.close()
        raise
    except OSError as e:
        sock.close()
        raise RendezvousError(f"cannot connect to {peer.describe()} at {peer.data_addr}:{peer.data_port}: {e}") from e
    tune(sock)
    return sock


def tcp_link(sock: socket.socket, peer: Peer) -> Link:
    """Both directions of one connected socket."""
    return Link(TcpTx(sock, peer.describe()), TcpRx(sock, peer.describe()))


def shm_link(job_key: str, me: int, peer: int, own: ShmSegment, capacity: int) -> tuple[Link, ShmSegment]:
    """The link to ``peer`` on this host: ``own`` is the segment ``peer`` writes to us (created by us before the
    exchange of names); the one we write to is opened here. Returns the link and the opened segment."""
    theirs = ShmSegment(job_key, peer, capacity, create=False, sender=me)
    return Link(ShmTx(theirs, own.bell_fd), ShmRx(own, theirs.bell)), theirs
