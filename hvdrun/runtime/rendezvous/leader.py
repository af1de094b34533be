"""A host's leader (its local rank 0, when it is not rank 0): one connection to rank 0 for the whole host.

The host's other ranks join the leader on a local socket (authenticated with the job's secret, as rank 0's
TCP socket is). The leader joins rank 0 with its own record, then sends each local rank's record as it
arrives (so rank 0 still names exactly the ranks that never came), hands its ranks the table rank 0 sent for
the host, and from then on relays:

* down, from rank 0: aborts, signals, goodbyes and report requests (answered with every local rank's report,
  and why some have none, in one message);
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
from hvdrun.protocol.wire import AuthError, authenticate_client, recv_frame, send_frame
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
    same_user,
    signal_self,
)

_LOCAL_HANDSHAKE_S = 2.0  # a local rank's handshake; a connection that stalls longer is dropped


class _Pending:
    """A report request of rank 0 that the leader's ranks are answering."""

    def __init__(self, request: int, expected: set[int], timeout_s: float) -> None:
        self.request, self.expected, self.timeout_s = request, expected, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.reports: dict[int, Any] = {}
        self.absent: dict[int, str] = {}

    def done(self) -> bool:
        return not self.expected - set(self.reports) - set(self.absent) or time.monotonic() >= self.deadline


class HostLeader:
    """The leader of one host's ranks (see the module docstring).

    Args:
        up: this rank's connection to rank 0, or to its parent host's leader in the tree (not yet joined).
        listener: the local socket the host's ranks join (this rank bound it first: it leads the host).
        children: the hosts this host admits in the tree (None: a leaf, or no tree).
    """

    def __init__(self, up: Client, listener: socket.socket, children: Children | None = None) -> None:
        self.up, self.abort = up, up.abort
        self.listener, self.children = listener, children
        self.locals: dict[socket.socket, Peer] = {}
        self._said_bye: set[socket.socket] = set()
        self._pending: dict[int, _Pending] = {}
        self._send_lock = threading.Lock()
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
            ready = readable([self.listener, sock, *below], min(remaining, 0.5))
            joined = [self._admit_local()] if self.listener in ready else []
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
        for sock in list(self.locals):
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

    def _admit_local(self) -> Peer | None:
        """One local rank's handshake and record; None for a connection that is not one."""
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return None
        if not same_user(sock):
            sock.close()
            return None
        sock.settimeout(_LOCAL_HANDSHAKE_S)
        try:
            authenticate_client(sock, self.up.secret)
            generation, row = recv_frame(sock)
            peer = Peer(*row)
            if generation != self.up.generation or any(p.rank == peer.rank for p in self.locals.values()):
                send_frame(sock, ("error", f"rank {peer.rank} is not expected by this host's leader"))
                sock.close()
                return None
        except (OSError, ValueError, TypeError, EOFError, AuthError, ConnectionError):
            sock.close()
            return None
        sock.settimeout(None)
        self.locals[sock] = peer
        return peer

    def _fail_locals(self, why: str) -> None:
        for sock in [*self.locals, *(self.children.by_sock if self.children is not None else ())]:
            try:
                send_frame(sock, ("error", why))
            except OSError:
                pass

    # -- relaying -----------------------------------------------------------------------------------------
    def _watch(self) -> None:
        up = self.up.sock
        assert up is not None
        while not self._closing:
            live = [sock for sock in self.locals if sock not in self._said_bye]
            below = [self.children.listener, self.children.wake_fd, *self.children.live()] if self.children else []
            watched: list[Any] = [up, self._wake_read, *live, *below]
            try:
                ready = readable(watched, self._next_timeout())
            except (OSError, ValueError):
                return
            if self._wake_read in ready:
                return
            if up in ready and not self._from_rank0(up):
                return
            for sock in ready:
                if sock in self.locals:
                    self._from_local(sock)
                elif self.children is not None:
                    self._from_below(self.children, sock)
            self._answer_reports()

    def _from_below(self, children: Children, ready: Any) -> None:
        """After the table: a child's message, or a late connection (refused once its handshake is done)."""
        if ready in children.by_sock:
            self._from_child(*children.receive(ready))
        elif ready is children.listener:
            children.accept()
        elif ready == children.wake_fd:
            children.take_admitted()

    def _next_timeout(self) -> float:
        if not self._pending:
            return 0.5
        return max(min(p.deadline for p in self._pending.values()) - time.monotonic(), 0.0)

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
            self._ask_reports(*report_request(message))
        elif kind == "go":
            self._to_locals(message)
            self.barriers.release(message[1])
        return True

    def _from_local(self, sock: socket.socket) -> None:
        peer = self.locals[sock]
        try:
            message = recv_frame(sock)
            kind = message[0]
        except (OSError, ConnectionError, EOFError, ValueError, IndexError, TypeError):
            message, kind = None, None
        if kind == "bye":
            self._said_bye.add(sock)
        elif kind == "report":
            pending = self._pending.get(message[1])
            if pending is not None:
                pending.reports[peer.rank] = message[2]
        elif kind == "abort":  # this host and the subtree at once, without waiting for rank 0 (which may be gone)
            self.report_failure(str(message[1]))
        elif kind == "ready":
            self._reached(message[1], message[2])
        elif not self._closing:
            self._said_bye.add(sock)  # no longer watched
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

    def _ask_reports(self, request: int, timeout_s: float, what: str) -> None:
        live = {sock: peer for sock, peer in self.locals.items() if sock not in self._said_bye}
        # answer before the asker's own wait ends (shorter a level down the tree)
        pending = _Pending(request, {peer.rank for peer in live.values()}, timeout_s * 0.8)
        pending.absent.update({peer.rank: "it left the job" for sock, peer in self.locals.items()
                               if sock in self._said_bye})
        self._ask_children(pending, timeout_s * 0.8, what)
        own = report_or_none(self.reporter, what)
        if own is not None and self.me is not None:
            pending.reports[self.me.rank] = own
        for sock, peer in live.items():
            try:
                self._send(sock, ("report?", request, timeout_s, what))
            except OSError as e:
                pending.absent[peer.rank] = f"its control connection failed: {e}"
        self._pending[request] = pending

    def _ask_children(self, pending: _Pending, timeout_s: float, what: str) -> None:
        """Forward a report request to the child hosts (each answers up on its own, :meth:`_from_child`); why the
        ones that cannot answer have no report goes in ``pending``."""
        if self.children is None:
            return
        for child in self.children.by_sock.values():
            ranks = {peer.rank for peer in child.peers}
            if child.said_bye or child.lost:
                pending.absent.update({rank: "it left the job" for rank in ranks})
                continue
            try:
                self._send(child.sock, ("report?", pending.request, timeout_s, what))
            except OSError as e:
                pending.absent.update({rank: f"its control connection failed: {e}" for rank in ranks})

    def _answer_reports(self) -> None:
        for request, pending in list(self._pending.items()):
            if pending.done():
                del self._pending[request]
                for rank in pending.expected - set(pending.reports) - set(pending.absent):
                    pending.absent[rank] = (f"did not answer within {pending.timeout_s:.2g} s (busy in code "
                                           "that holds Python's lock?)")
                self._up_send(("reports", request, pending.reports, pending.absent))

    def _abort_all(self, reason: str) -> None:
        self.abort.set(reason)
        self._to_locals(("abort", reason))

    def _to_locals(self, message: Any) -> None:
        """``message`` to this host's ranks and to its child hosts."""
        for sock in [s for s in self.locals if s not in self._said_bye]:
            try:
                self._send(sock, message)
            except OSError:
                pass
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
        behind = len(self.locals) + 1 + (len(self.children.ranks()) if self.children is not None else 0)
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
        for sock in self.locals:
            sock.close()
        if self.children is not None:
            self.children.close()
        self.listener.close()
        self.up.close()
