"""A host's leader (its local rank 0, when it is not rank 0): one connection to rank 0 for the whole host.

The host's other ranks join the leader on a local socket (:mod:`.host_ranks`; authenticated with the job's
secret, as rank 0's TCP socket is). The leader joins rank 0 with its own record, then sends each local rank's
record as it arrives (so rank 0 still names exactly the ranks that never came), hands its ranks the table rank 0
sent for the host, and from then on relays:

* down, from rank 0: aborts, signals, goodbyes and report requests (answered with every local rank's report,
  and why some have none, in one message: :mod:`.report_requests`);
* up, from its ranks: aborts, and a rank that disconnects without a goodbye, named as rank 0 would name it.

If rank 0 goes, the leader tells its ranks with the words every rank used when it watched rank 0 itself.

In a large job's rendezvous tree (:mod:`hvdrun.protocol.tree`) a leader's ``up`` is its parent host's leader
(rank 0 for the first hosts), and an inner host's leader admits its child hosts (:mod:`.children`) over TCP as
rank 0 would, and joins for its whole subtree, relaying as it does for its own host.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import astuple
from typing import Any

from hvdrun.errors import RendezvousError
from hvdrun.protocol.inspection import SIGNAL
from hvdrun.protocol.wire import recv_frame, send_frame
from hvdrun.runtime.peers import Peer, PeerTable
from hvdrun.runtime.readiness import readable
from hvdrun.runtime.rendezvous.children import Child, Children
from hvdrun.runtime.rendezvous.client import Client
from hvdrun.runtime.rendezvous.common import (
    HANDSHAKE_TIMEOUT_S,
    Barriers,
    Reporter,
    disconnected,
    report_or_none,
    report_request,
    send_to_each,
    signal_self,
)
from hvdrun.runtime.rendezvous.host_ranks import HostRanks
from hvdrun.runtime.rendezvous.report_requests import RelayedReports


class HostLeader:
    """The leader of one host's ranks (see the module docstring).

    Args:
        up: this rank's connection to rank 0, or to its parent host's leader in the tree (not yet joined).
        listener: the local socket the host's ranks join (this rank bound it first: it leads the host).
        children: the hosts this host admits in the tree (None: a leaf, or no tree).
    """

    def __init__(self, up: Client, listener: socket.socket, children: Children | None = None) -> None:
        self.up, self.abort = up, up.abort
        self.host_ranks, self.children = HostRanks(listener, up.secret, up.generation), children
        self._send_lock = threading.Lock()
        self.reports = RelayedReports(self.host_ranks, children, self._own_report, self._send, self._up_send)
        self._closing = False
        self._wake_read, self._wake_write = os.pipe()
        self._watcher: threading.Thread | None = None
        self.reporter: Reporter | None = None
        self.me: Peer | None = None
        self.barriers = Barriers(self.abort)

    # -- joining ------------------------------------------------------------------------------------------
    def exchange(self, me: Peer, deadline: float) -> PeerTable:
        """Join rank 0 for the host: gather local ranks until rank 0 answers with the table (or an error). Whatever
        ends this rank's part early, its local ranks hear it at once rather than at their deadline."""
        self.me = me
        try:
            return self._gather(me, deadline)
        except BaseException as e:
            self._fail_locals(f"this host's leader, {me.describe()}, failed in the rendezvous: {e}")
            raise

    def _gather(self, me: Peer, deadline: float) -> PeerTable:
        rows: list[tuple[Any, ...]] = [astuple(me)]
        sock = self.up.connect(deadline)
        send_frame(sock, (self.up.generation, [list(row) for row in rows]))
        while True:
            remaining = deadline + HANDSHAKE_TIMEOUT_S - time.monotonic()
            if remaining <= 0:
                self._fail_locals(f"{self.up.upstream.describe()} did not answer the rendezvous in time")
                raise RendezvousError(f"{self.up.upstream.describe()} did not answer the rendezvous in time")
            below = self.children.gather_fds() if self.children is not None else []
            ready = readable([self.host_ranks.listener, sock, *below], min(remaining, 0.5))
            joined = [self.host_ranks.admit()] if self.host_ranks.listener in ready else []
            joined += self._children_rows(ready)
            for peer in joined:
                if peer is not None:
                    rows.append(astuple(peer))
                    send_frame(sock, ("rows", [list(astuple(peer))]))
            if sock in ready:
                message = self._answer_of_rank0()
                if message[0] == "retry":  # rank 0 of an earlier init(): join its next one
                    sock = self._rejoin(rows, deadline)
                    continue
                return self._hand_out(message)

    def _children_rows(self, ready: list[Any]) -> list[Peer]:
        """The ranks that joined through this host's children in ``ready`` (nothing without children)."""
        children = self.children
        if children is None:
            return []
        if children.listener in ready:
            children.accept()
        joined = children.take_admitted() if children.wake_fd in ready else []
        for sock in [sock for sock in ready if sock in children.by_sock]:
            joined += children.more_rows(sock)
        return joined

    def _answer_of_rank0(self) -> tuple[Any, ...]:
        try:
            return self.up.receive_answer()
        except RendezvousError as e:
            self._fail_locals(str(e))
            raise

    def _rejoin(self, rows: list[tuple[Any, ...]], deadline: float) -> socket.socket:
        assert self.up.sock is not None
        self.up.sock.close()
        self.up.sock = None
        time.sleep(0.02)
        sock = self.up.connect(deadline)
        send_frame(sock, (self.up.generation, [list(row) for row in rows]))
        return sock

    def _hand_out(self, message: tuple[Any, ...]) -> PeerTable:
        """Pass rank 0's answer to every local rank; the table, or the error raised."""
        if message[0] != "table":
            self._fail_locals(str(message[1]))
            raise RendezvousError(str(message[1]))
        assert self.me is not None and self.up.sock is not None
        if len(message) > 3:  # from its parent's leader: name it if it goes
            self.up.lost = self.up.upstream.lost(message[3])
        for sock in list(self.host_ranks.by_sock):
            try:
                self._send(sock, ("table", message[1], message[2], self.me.describe()))
            except OSError:  # it died waiting: the watch reports it, named
                pass
        if self.children is not None:  # the subtree's table (every rank's needs): each host takes its own part
            self.children.send_all(("table", message[1], message[2], self.me.describe()), self._send)
            self.children.table_sent = True
            for child in self.children.lost():  # went during the gather: named now, as rank 0 names a dead rank
                self._from_child(child, None)
        self.up.sock.settimeout(None)
        self._watcher = threading.Thread(target=self._watch, name="hvdrun-host-leader", daemon=True)
        self._watcher.start()
        return PeerTable.decode(message[1], message[2])

    def _fail_locals(self, why: str) -> None:
        send_to_each([*self.host_ranks.by_sock, *(self.children.by_sock if self.children is not None else ())],
                     ("error", why))

    # -- relaying -----------------------------------------------------------------------------------------
    def _watch(self) -> None:
        up = self.up.sock
        assert up is not None
        while not self._closing:
            below = [self.children.listener, self.children.wake_fd, *self.children.live()] if self.children else []
            watched: list[Any] = [up, self._wake_read, *self.host_ranks.live(), *below]
            try:
                ready = readable(watched, self.reports.next_timeout())
            except (OSError, ValueError):
                return
            if self._wake_read in ready:
                return
            if up in ready and not self._from_rank0(up):
                return
            for sock in ready:
                if sock in self.host_ranks.by_sock:
                    self._from_local(sock)
                elif self.children is not None:
                    self._from_below(self.children, sock)
            self.reports.answer_due()

    def _from_below(self, children: Children, ready: Any) -> None:
        """After the table: a child's message, or a late connection (refused once its handshake is done)."""
        if ready in children.by_sock:
            self._from_child(*children.receive(ready))
        elif ready is children.listener:
            children.accept()
        elif ready == children.wake_fd:
            children.take_admitted()

    def _from_rank0(self, up: socket.socket) -> bool:
        """Relay one message of rank 0; False when watching rank 0 is over."""
        try:
            message = recv_frame(up)
            kind = message[0]
        except (OSError, ConnectionError, EOFError, ValueError, IndexError, TypeError):
            if not self._closing:
                self._abort_all(self.up.lost)
            return False
        if kind == "abort":
            self._abort_all(str(message[1]))
        elif kind == "bye":  # rank 0 shut down cleanly: so does everyone
            self._to_locals(("bye",))
            return False
        elif kind == SIGNAL:
            self._to_locals(message)
            signal_self(message[1])
        elif kind == "report?":
            self.reports.ask(*report_request(message))
        elif kind == "go":
            self._to_locals(message)
            self.barriers.release(message[1])
        return True

    def _from_local(self, sock: socket.socket) -> None:
        peer = self.host_ranks.by_sock[sock]
        try:
            message = recv_frame(sock)
            kind = message[0]
        except (OSError, ConnectionError, EOFError, ValueError, IndexError, TypeError):
            message, kind = None, None
        if kind == "bye":
            self.host_ranks.said_bye.add(sock)
        elif kind == "report":
            self.reports.take(message[1], peer.rank, message[2])
        elif kind == "abort":  # this host and the subtree at once, without waiting for rank 0 (which may be gone)
            self.report_failure(str(message[1]))
        elif kind == "ready":
            self._reached(message[1], message[2])
        elif not self._closing:
            self.host_ranks.said_bye.add(sock)  # no longer watched
            self.report_failure(disconnected(peer))

    def _from_child(self, child: Child, message: tuple[Any, ...] | None) -> None:
        """One message of a child host, as rank 0 would take it (None: its connection ended). Reports go up as they
        come, a frame per child, so that no frame holds a whole subtree's stacks."""
        try:
            if message is None:
                raise ValueError("its connection ended")
            kind = message[0]
            if kind == "bye":
                child.said_bye = True
            elif kind == "report":
                self._up_send(("reports", message[1], {child.first.rank: message[2]}, {}))
            elif kind == "reports":
                self._up_send(message)
            elif kind == "abort":  # as a local rank's
                self.report_failure(str(message[1]))
            elif kind == "ready":
                self._reached(message[1], message[2])
            else:
                raise ValueError(kind)
        except (ValueError, IndexError, TypeError):
            if not self._closing:
                child.said_bye = True  # no longer watched
                self.report_failure(disconnected(child.first))

    def _own_report(self, what: str) -> tuple[int, dict[str, Any]] | None:
        """This rank's own report of ``what``, with its rank (None: it has none), for :attr:`reports`."""
        own = report_or_none(self.reporter, what)
        return (self.me.rank, own) if own is not None and self.me is not None else None

    def _abort_all(self, reason: str) -> None:
        self.abort.set(reason)
        self._to_locals(("abort", reason))

    def _to_locals(self, message: Any) -> None:
        """``message`` to this host's ranks and to its child hosts."""
        self.host_ranks.send_all(message, self._send)
        if self.children is not None:
            self.children.send_all(message, self._send)

    def _send(self, sock: socket.socket, message: Any) -> None:
        with self._send_lock:
            send_frame(sock, message)

    def _up_send(self, message: Any) -> None:
        try:
            self.up.send(message)
        except (OSError, AssertionError):
            pass

    def barrier(self, number: int, deadline: float) -> None:
        """Set-up barrier ``number``: once this rank and every local rank reached it, rank 0 hears it for the host."""
        self._reached(number, 1)
        self.barriers.wait(number, deadline)

    def _reached(self, number: int, count: int) -> None:
        behind = len(self.host_ranks.by_sock) + 1 + (len(self.children.ranks()) if self.children is not None else 0)
        if self.barriers.add(number, count) == behind:
            self._up_send(("ready", number, behind))

    # -- leaving ------------------------------------------------------------------------------------------
    def report_failure(self, reason: str) -> None:
        """Ask rank 0 to abort every rank with ``reason``, and tell this host's ranks at once (rank 0 may be the
        rank that is gone, and this rank may exit as soon as it returns)."""
        self._up_send(("abort", reason))
        self._abort_all(reason)

    def close(self) -> None:
        """Leave cleanly: goodbye to rank 0 and to this host's ranks."""
        if self._closing:
            return
        self._closing = True
        os.write(self._wake_write, b"\0")
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(2.0)
        os.close(self._wake_read)
        os.close(self._wake_write)
        self._to_locals(("bye",))
        self.host_ranks.close()
        if self.children is not None:
            self.children.close()
        self.up.close()
