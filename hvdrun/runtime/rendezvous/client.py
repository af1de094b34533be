"""A rank's side of the rendezvous: join rank 0 (or this host's leader), then listen for aborts."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import astuple
from typing import Any

from hvdrun.errors import RendezvousError
from hvdrun.protocol.inspection import SIGNAL
from hvdrun.protocol.wire import AuthError, authenticate_server, recv_frame, send_frame
from hvdrun.runtime.peers import Peer, PeerTable
from hvdrun.runtime.rendezvous.common import (
    HANDSHAKE_TIMEOUT_S,
    Barriers,
    Reporter,
    Upstream,
    report_or_none,
    report_request,
    signal_self,
)
from hvdrun.runtime.transport.channels import AbortFlag


class Client:
    """A non-zero rank's side: joins rank 0 (or its host's leader, which joins rank 0 for it), then listens for
    aborts."""

    def __init__(self, upstream: Upstream, secret: bytes, abort: AbortFlag, generation: int) -> None:
        self.upstream, self.secret, self.abort = upstream, secret, abort
        self.addr = upstream.addr
        self.generation = generation
        self.sock: socket.socket | None = None
        self._closing = False
        self.lost = upstream.lost()  # why this rank stops if upstream goes unannounced
        self.reporter: Reporter | None = None  # this rank's report (set by the runtime)
        self._send_lock = threading.Lock()
        self.barriers = Barriers(abort)

    def connect(self, deadline: float) -> socket.socket:
        """Connect upstream and authenticate, retrying until ``deadline``.

        A connection that is refused, or that closes or falls silent during the handshake (another
        process held the port for a moment, or rank 0 is not listening yet), is tried again; a peer
        that proves it does not know the job's secret (:class:`AuthError`) is not.
        """
        where = self.upstream.describe()
        it = "rank 0" if self.upstream.is_rank0 else "it"
        while True:
            try:
                sock = self.upstream.open()
            except OSError as e:
                self._retry_or_fail(deadline, f"cannot reach {where}: {e.strerror or e}; is {it} running and the "
                                              "address reachable?", e)  # errors.RENDEZVOUS_UNREACHED for rank 0
                continue
            try:
                authenticate_server(sock, self.secret, where)
            except (OSError, ConnectionError) as e:
                sock.close()
                self._retry_or_fail(deadline, f"{where} did not complete the handshake: {e}", e)
                continue
            except AuthError:
                sock.close()
                raise
            self.sock = sock
            return sock

    @staticmethod
    def _retry_or_fail(deadline: float, message: str, cause: BaseException) -> None:
        if time.monotonic() > deadline:
            raise RendezvousError(message) from cause
        time.sleep(0.05)

    def join(self, me: Peer | list[Peer], deadline: float) -> tuple[Any, ...]:
        """Send our record (a host leader: its host's records), wait for the table (or an error).

        Returns:
            The table message, ``("table", layout, rows[, leader])``.
        """
        record: Any = [astuple(p) for p in me] if isinstance(me, list) else astuple(me)
        while True:
            if self.sock is None:
                self.connect(deadline)
            assert self.sock is not None
            send_frame(self.sock, (self.generation, record))
            self.sock.settimeout(max(deadline - time.monotonic(), 0.1) + HANDSHAKE_TIMEOUT_S)
            message = self.receive_answer()
            if message[0] != "retry" or time.monotonic() > deadline:
                break
            self.sock.close()
            self.sock = None
            time.sleep(0.02)
        if message[0] != "table":
            why = str(message[1]) if message[0] == "error" and len(message) > 1 else \
                f"{self.upstream.describe()} left the rendezvous ({message[0]})"
            raise RendezvousError(why)
        self.sock.settimeout(None)
        return tuple(message)

    def receive_answer(self) -> tuple[Any, ...]:
        """The next message from upstream; its end is a RendezvousError."""
        assert self.sock is not None
        try:
            message = recv_frame(self.sock)
        except (OSError, ConnectionError, EOFError, ValueError) as e:
            raise RendezvousError(f"{self.upstream.describe()} closed the rendezvous: {e}") from e
        return tuple(message)

    def join_table(self, me: Peer, deadline: float) -> PeerTable:
        """Join and start listening for aborts; the table this rank was sent."""
        message = self.join(me, deadline)
        if len(message) > 3:  # through a leader (the host's, or a parent host's in the tree): name it if it goes
            self.lost = self.upstream.lost(message[3])
        threading.Thread(target=self._watch, name="hvdrun-rendezvous", daemon=True).start()
        return PeerTable.decode(message[1], message[2])

    def _watch(self) -> None:
        assert self.sock is not None
        try:
            while True:
                message = recv_frame(self.sock)
                kind = message[0]
                if kind == "abort":
                    self.abort.set(message[1])
                    return
                if kind == "bye":  # rank 0 shut down cleanly; our own shutdown is finishing
                    return
                if kind == SIGNAL:
                    signal_self(message[1])
                    continue
                if kind == "report?":
                    request, _, what = report_request(message)
                    self.send(("report", request, report_or_none(self.reporter, what) or {}))
                elif kind == "go":
                    self.barriers.release(message[1])
        except (OSError, ConnectionError, EOFError, ValueError, IndexError, TypeError):
            if not self._closing:
                self.abort.set(self.lost)

    def send(self, message: Any) -> None:
        """One frame upstream: the watch thread's answers and the caller's messages never interleave."""
        assert self.sock is not None
        with self._send_lock:
            send_frame(self.sock, message)

    def barrier(self, number: int, deadline: float) -> None:
        """Set-up barrier ``number``: tell upstream this rank reached it, wait until every rank did."""
        self.send(("ready", number, 1))
        self.barriers.wait(number, deadline)

    def report_failure(self, reason: str) -> None:
        """Ask rank 0 to abort every rank with ``reason``; where rank 0 is gone already (its own rendezvous timed
        out and it exited), nothing: the report must never hide the error it reports."""
        if self.sock is not None:
            try:
                self.send(("abort", reason))
            except OSError:
                pass

    def close(self) -> None:
        """Say goodbye so rank 0 does not report us as crashed."""
        self._closing = True
        if self.sock is not None:
            try:
                self.send(("bye",))
            except OSError:
                pass
            self.sock.close()


