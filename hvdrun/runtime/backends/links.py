"""The native backend's connections: the ring's two channels and the links of the hierarchical collectives.

Every TCP connection is dialled to a rank's data port and authenticated with the job's secret; its
first frame says what it is: ``("ring", rank)`` (the previous rank of the ring) or ``("link", rank)``
(a duplex link, dialled by the lower rank). One acceptor thread per rank takes every expected
connection. A link between ranks of one host is two shared-memory segments instead, one each way,
named after the reader and the writer (:class:`~hvdrun.runtime.transport.shm.ShmSegment`).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterable, Sequence

from hvdrun.errors import RendezvousError
from hvdrun.protocol.wire import AuthError, authenticate_client, authenticate_server, recv_frame, send_frame
from hvdrun.runtime.collectives.pairwise import Link
from hvdrun.runtime.peers import Peer
from hvdrun.runtime.transport.channels import AbortFlag
from hvdrun.runtime.transport.shm import ShmRx, ShmSegment, ShmTx
from hvdrun.runtime.transport.tcp import TcpRx, TcpTx, tune

CONNECT_TIMEOUT_S = 30.0
RING, LINK = "ring", "link"
_ABORT_POLL_S = 0.05  # how often a wait for a peer's connection looks at the abort flag


class Acceptor:
    """Accepts, in a thread, the connections this rank expects: ``(purpose, rank)`` pairs, until they have all come
    or ``deadline`` (``time.monotonic()``) passes. ``abort``: a wait for a connection ends as soon as it is set (a
    peer that failed will never dial)."""

    def __init__(self, listener: socket.socket, expected: Iterable[tuple[str, int]], secret: bytes,
                 deadline: float, abort: AbortFlag | None = None) -> None:
        self.expected, self.secret, self.deadline, self.abort = set(expected), secret, deadline, abort
        self.accepted: dict[tuple[str, int], socket.socket] = {}
        self.error: str | None = None
        self._closed = False
        self._arrived = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(listener,), name="hvdrun-accept", daemon=True)
        if self.expected:
            self._thread.start()

    def _run(self, listener: socket.socket) -> None:
        while (left := self.deadline - time.monotonic()) > 0 and set(self.accepted) != self.expected:
            try:
                listener.settimeout(min(left, CONNECT_TIMEOUT_S))
                sock, _ = listener.accept()
            except OSError as e:
                if listener.fileno() < 0:
                    return  # set-up failed and closed the listener: nobody waits for the rest
                self.error = str(e)
                continue
            try:
                sock.settimeout(min(time_left(self.deadline), CONNECT_TIMEOUT_S))
                authenticate_client(sock, self.secret)
                frame = tuple(recv_frame(sock))
                if frame not in self.expected or frame in self.accepted:
                    raise ValueError(f"unexpected connection {frame}")
                tune(sock)
            except (OSError, ConnectionError, ValueError, EOFError, AuthError, TypeError) as e:
                self.error = str(e)
                sock.close()
                continue
            with self._arrived:
                if self._closed:  # set-up failed meanwhile: nobody will take it
                    sock.close()
                    return
                self.accepted[frame] = sock  # type: ignore[index]
                self._arrived.notify_all()

    def close(self) -> None:
        """Set-up failed: close every connection accepted (taken or not), and any that completes from now on."""
        with self._arrived:
            self._closed = True
            for sock in self.accepted.values():
                sock.close()

    def take(self, purpose: str, peer: Peer) -> socket.socket:
        """The connection of ``peer`` for ``purpose``, waiting for it until the deadline.

        Raises:
            RendezvousError: it did not connect in time.
        """
        return self.take_all(purpose, [peer])[peer.rank]

    def take_all(self, purpose: str, peers: Sequence[Peer]) -> dict[int, socket.socket]:
        """The connections of ``peers`` for ``purpose`` by rank, each waited for until the deadline.

        Raises:
            RendezvousError: some did not connect in time; names every one of them.
            CollectiveError: the job was aborted meanwhile (its reason).
        """
        keys = [(purpose, peer.rank) for peer in peers]
        with self._arrived:
            while not all(key in self.accepted for key in keys) and time.monotonic() < self.deadline:
                if self.abort is not None:
                    self.abort.check()
                self._arrived.wait(min(max(self.deadline - time.monotonic(), 0), _ABORT_POLL_S))
            missing = [peer for peer, key in zip(peers, keys, strict=True) if key not in self.accepted]
            if missing:
                raise RendezvousError(
                    f"{', '.join(peer.describe() for peer in missing)} did not connect to this rank's data port "
                    "before the start deadline (HVDRUN_START_TIMEOUT)"
                    + (f" (last error: {self.error})" if self.error else ""))
            return {peer.rank: self.accepted[key] for peer, key in zip(peers, keys, strict=True)}


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``), at least 0.1: a last try still gets a moment."""
    return max(deadline - time.monotonic(), 0.1)


def dial(me: Peer, peer: Peer, secret: bytes, purpose: str, timeout_s: float) -> socket.socket:
    """Connect to ``peer``'s data port for ``purpose`` (connecting and authenticating within ``timeout_s``).

    Raises:
        RendezvousError: it cannot be reached or does not authenticate.
    """
    try:
        sock = socket.create_connection((peer.data_addr, peer.data_port), timeout=timeout_s)
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


def dial_all(me: Peer, peers: Sequence[Peer], secret: bytes, purpose: str, deadline: float) -> dict[int, socket.socket]:
    """Connect to every one of ``peers`` at once (a thread each past the first), each within the time left before
    ``deadline`` (``time.monotonic()``): a peer that is slow to answer delays none of the others.

    Raises:
        RendezvousError: some could not be reached in time or did not authenticate; names every one of them (the
            connections made are closed).
    """
    dialled: dict[int, socket.socket] = {}
    failures: dict[int, str] = {}

    def connect(peer: Peer) -> None:
        try:
            dialled[peer.rank] = dial(me, peer, secret, purpose, time_left(deadline))
        except (RendezvousError, AuthError) as e:
            failures[peer.rank] = str(e)
        except Exception as e:  # noqa: BLE001 - a thread's error is reported by the caller, naming the peer
            failures[peer.rank] = f"cannot connect to {peer.describe()}: {e!r}"

    threads = [threading.Thread(target=connect, args=(peer,), name="hvdrun-dial", daemon=True) for peer in peers[1:]]
    for thread in threads:
        thread.start()
    try:
        if peers:
            connect(peers[0])
    finally:  # an interrupt too: every dial ends before its sockets are closed or kept
        for thread in threads:
            thread.join()
        for peer in peers:  # a dial that ended without a word (a thread's BaseException)
            if peer.rank not in dialled and peer.rank not in failures:
                failures[peer.rank] = f"cannot connect to {peer.describe()}: the dial ended without a connection"
        if failures or sys.exc_info()[0] is not None:
            for sock in dialled.values():
                sock.close()
    if failures:
        raise RendezvousError("; ".join(failures[rank] for rank in sorted(failures)))
    return dialled


def tcp_link(sock: socket.socket, peer: Peer) -> Link:
    """Both directions of one connected socket."""
    return Link(TcpTx(sock, peer.describe()), TcpRx(sock, peer.describe()))


def shm_link(job_key: str, me: int, peer: int, own: ShmSegment, capacity: int) -> tuple[Link, ShmSegment]:
    """The link to ``peer`` on this host: ``own`` is the segment ``peer`` writes to us (created by us before the
    exchange of names); the one we write to is opened here. Returns the link and the opened segment."""
    theirs = ShmSegment(job_key, peer, capacity, create=False, sender=me)
    return Link(ShmTx(theirs, own.bell_fd), ShmRx(own, theirs.bell)), theirs
