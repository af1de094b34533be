"""Rank 0's side of the rendezvous: gather every rank, send each what it needs, then watch the connections."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any

from hvdrun.envvars import START_TIMEOUT
from hvdrun.errors import RENDEZVOUS_TIMED_OUT, RendezvousError
from hvdrun.protocol.inspection import INSPECT, REPORT_TIMEOUT_S, SIGNAL, STACKS, VITALS, format_reports
from hvdrun.protocol.wire import AuthError, authenticate_client, recv_frame, send_frame
from hvdrun.ranks import format_ranks
from hvdrun.runtime.peers import Layout, NeedsPlan, Peer, PeerTable
from hvdrun.runtime.readiness import readable
from hvdrun.runtime.rendezvous.common import (
    HANDSHAKE_TIMEOUT_S,
    Barriers,
    Reporter,
    disconnected,
    handshake_on_thread,
    listener_for,
    report_or_none,
    same_user,
    signal_self,
)
from hvdrun.runtime.rendezvous.report_requests import ReportBook, Reports, every_rank
from hvdrun.runtime.transport.channels import AbortFlag


class _Conn:
    """One control connection to rank 0: a rank, or a host leader and the ranks of its host behind it."""

    def __init__(self, sock: socket.socket, peers: list[Peer], leader: bool) -> None:
        self.sock, self.first, self.leader = sock, peers[0], leader
        self.ranks = [p.rank for p in peers]
        self.said_bye = False


class RootServer:
    """Rank 0's side: accepts the other ranks (each on its own connection, or many behind their host's leader),
    then watches their connections."""

    def __init__(self, addr: str, port: int, size: int, secret: bytes, abort: AbortFlag, generation: int) -> None:
        self.size, self.secret, self.abort, self.generation = size, secret, abort, generation
        self.listener = listener_for(addr, port, size)
        self.local_listener: socket.socket | None = None  # this host's ranks, when rank 0 leads its host
        self._handshakes = threading.BoundedSemaphore(max(2 * size, 16))
        self.members: dict[int, Peer] = {}  # every rank that joined, rank 0 aside
        self._reached: dict[int, set[int]] = {}  # set-up barrier -> the ranks rank 0 heard reached it
        self.conns: dict[socket.socket, _Conn] = {}
        self._lock = threading.Lock()
        self._closing = self._closed = False
        self._monitor: threading.Thread | None = None
        self._wake_read, self._wake_write = os.pipe()
        self.reporter: Reporter | None = None  # rank 0's own report (set by the runtime)
        self._send_lock = threading.Lock()
        self._report_book = ReportBook()  # the report requests waiting for answers
        self.barriers = Barriers(abort)

    def _live(self) -> list[_Conn]:
        return [conn for conn in list(self.conns.values()) if not conn.said_bye]

    def gather_reports(self, timeout_s: float = REPORT_TIMEOUT_S, what: str = STACKS) -> Reports:
        """Every rank's report of ``what`` (stacks or vitals; rank 0's own included) and why the others have none."""
        request = self._report_book.open()
        live = self._live()
        absent = {rank: "it left the job" for conn in self.conns.values() if conn.said_bye for rank in conn.ranks}
        if self._monitor is None:  # the rendezvous is still gathering: joined ranks wait for the table
            absent.update({rank: "joined rank 0; waits for the other ranks to join" for c in live for rank in c.ranks})
            live = []
        for conn in live:
            try:
                self._send(conn.sock, ("report?", request, timeout_s, what))
            except OSError as e:
                absent.update({rank: f"its control connection failed: {e}" for rank in conn.ranks})
        expected = {rank for conn in live for rank in conn.ranks} - set(absent)
        replies, absent_there = self._report_book.wait(request, expected, time.monotonic() + timeout_s)
        absent.update(absent_there)
        not_joined = set(range(1, self.size)) - set(self.members)
        return every_rank(replies, absent, expected, timeout_s, not_joined, report_or_none(self.reporter, what))

    def signal_ranks(self, signum: int) -> int:
        """Send ``signum`` to every other rank's process; the number of ranks it reaches with rank 0's own."""
        reached = 0
        for conn in self._live():
            try:
                self._send(conn.sock, (SIGNAL, signum))
                reached += len(conn.ranks)
            except OSError:
                pass
        return reached + 1

    def _send(self, sock: socket.socket, message: Any) -> None:
        with self._send_lock:
            send_frame(sock, message)

    def _serve_inspector(self, sock: socket.socket, what: str) -> None:
        """Answer an inspector (see the module docstring) with every rank's report of ``what``."""
        reports, absent = self.gather_reports(what=what)
        send_frame(sock, ("reports", reports, sorted(absent.items()), self.size))
        sock.close()

    def gather(self, me: Peer, deadline: float, needs: NeedsPlan, local_listener: socket.socket | None) -> PeerTable:
        """Accept connections until every rank joined; send each connection the layout and the records its ranks
        need (``needs``). ``local_listener``: also accept this host's ranks there (rank 0 leads its host)."""
        self.local_listener = local_listener
        while len(self.members) < self.size - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail_missing(deadline)
            with self._lock:
                leaders = [conn.sock for conn in self.conns.values() if conn.leader]
            listeners = [sock for sock in (self.listener, self.local_listener) if sock is not None]
            for sock in readable([*listeners, *leaders], min(remaining, 0.005)):
                if sock in listeners:
                    self._accept(sock)
                else:
                    self._more_rows(self.conns[sock])
        peers = sorted([me, *self.members.values()], key=lambda p: p.rank)
        table = PeerTable(Layout.of(peers), {p.rank: p for p in peers})
        plan = needs(table.layout)
        for conn in self.conns.values():
            wanted = set(conn.ranks).union(*(plan(rank) for rank in conn.ranks))
            send_frame(conn.sock, ("table", *table.encode_for(wanted)))
        self._monitor = threading.Thread(target=self._watch, name="hvdrun-rendezvous", daemon=True)
        self._monitor.start()
        return table

    def _more_rows(self, conn: _Conn) -> None:
        """A host leader's next local ranks (a leader that drops now leaves its ranks missing)."""
        try:
            kind, rows = recv_frame(conn.sock)
            if kind != "rows":
                raise ValueError(kind)
            peers = [Peer(*row) for row in rows]
        except (OSError, ValueError, TypeError, EOFError, ConnectionError):
            with self._lock:
                del self.conns[conn.sock]
                for rank in conn.ranks:
                    self.members.pop(rank, None)
            conn.sock.close()
            return
        with self._lock:
            if self._refuse(conn.sock, peers):
                return
            conn.ranks += [p.rank for p in peers]
            self.members.update({p.rank: p for p in peers})

    def _accept(self, listener: socket.socket) -> None:
        """Take one connection; at most 2 x size handshakes at once, each dropped after its deadline."""
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        if listener is self.local_listener and not same_user(sock):
            sock.close()
            return
        handshake_on_thread(sock, self._handshakes, self._admit)

    def _admit(self, sock: socket.socket) -> None:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            authenticate_client(sock, self.secret)
            generation, row = recv_frame(sock)
            if generation == INSPECT:
                self._serve_inspector(sock, row if row in (STACKS, VITALS) else STACKS)
                return
            if generation == SIGNAL:
                signum = int(row)
                send_frame(sock, ("signalled", self.signal_ranks(signum)))
                sock.close()
                signal_self(signum)  # rank 0 last: it may die of it (no handler), after the answer
                return
            if generation != self.generation:  # a rank already on its next init() reached our old server
                send_frame(sock, ("retry", f"rank 0 is at init #{self.generation}, not #{generation}"))
                sock.close()
                return
            leader = isinstance(row, list)  # a host leader joins with its own record and its host's ranks so far
            peers = [Peer(*r) for r in row] if leader else [Peer(*row)]
            with self._lock:
                if self._refuse(sock, peers):
                    return
                sock.settimeout(None)
                self.conns[sock] = _Conn(sock, peers, leader)
                self.members.update({p.rank: p for p in peers})
        except (OSError, ValueError, TypeError, EOFError, AuthError, IndexError):
            sock.close()

    def _refuse(self, sock: socket.socket, peers: list[Peer]) -> bool:
        """Refuse (and close) a connection that brings a rank this job does not expect; under the lock."""
        for peer in peers:
            if not 0 < peer.rank < self.size or peer.rank in self.members or self._monitor is not None:
                send_frame(sock, ("error", f"rank {peer.rank} is not expected by this job (size {self.size})"))
                sock.close()
                self.conns.pop(sock, None)
                return True
        return False

    def _fail_missing(self, deadline: float) -> None:
        missing = sorted(set(range(1, self.size)) - set(self.members))
        message = (f"{RENDEZVOUS_TIMED_OUT}: ranks {', '.join(map(str, missing))} never joined rank 0 "
                   f"(raise {START_TIMEOUT} if they start slowly)")
        if self.reporter is not None:  # where every rank is, before they are stopped
            try:
                reports, absent = self.gather_reports(0.0)
                sys.stderr.write(f"hvdrun: where every rank is, as the rendezvous times out\n"
                                 f"{format_reports(reports, self.size, absent)}\n")
            except Exception:  # noqa: BLE001 - a report must never hide the rendezvous error itself
                pass
        for conn in self.conns.values():
            try:
                send_frame(conn.sock, ("error", message))
            except OSError:
                pass
        self.close()
        raise RendezvousError(message)

    def _watch(self) -> None:
        listeners = [sock for sock in (self.listener, self.local_listener) if sock is not None]
        while not self._closing:
            conns = {conn.sock: conn for conn in self._live()}
            watched: list[Any] = [*listeners, self._wake_read, *conns]
            try:
                ready = readable(watched, 0.5)
            except (OSError, ValueError):
                return
            for sock in ready:
                if sock is self._wake_read:
                    return
                if sock in listeners:
                    self._accept(sock)  # late: refused by _admit
                elif sock in conns:
                    self._read_client(conns[sock])

    def _read_client(self, conn: _Conn) -> None:
        try:
            message = recv_frame(conn.sock)
        except (OSError, ConnectionError, EOFError, ValueError):
            message = None
        if message == ("bye",):
            conn.said_bye = True
            return
        if self._closing:
            return
        kind = message[0] if isinstance(message, tuple) and message else None
        if kind in ("report", "reports"):
            self._report_book.take(conn.ranks, message)
        elif kind == "ready":
            with self._lock:
                self._reached.setdefault(message[1], set()).update(conn.ranks)
            self.barriers.add(message[1], message[2])
        elif kind == "abort":
            self.broadcast_abort(str(message[1]))
        else:
            self.broadcast_abort(disconnected(conn.first))

    def barrier(self, number: int, deadline: float) -> None:
        """Set-up barrier ``number``: wait until every other rank reached it (a leader counts for its host), then
        release them all."""
        try:
            self.barriers.wait(number, deadline, reached=self.size - 1)
        except RendezvousError as e:
            raise RendezvousError(f"{e}; {self._not_reached(number)}") from None
        for conn in self._live():
            self._send(conn.sock, ("go", number))

    def _not_reached(self, number: int) -> str:
        """Who rank 0 had not heard reach set-up barrier ``number``, by host (a host's leader speaks for all
        the ranks of its host at once, when the last of them reached it)."""
        with self._lock:
            missing = sorted(set(range(1, self.size)) - self._reached.get(number, set()))
        by_host: dict[str, list[int]] = {}
        for rank in missing:
            peer = self.members.get(rank)
            by_host.setdefault(peer.hostname if peer is not None else "an unknown host", []).append(rank)
        where = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)} on {host}"
                          for host, ranks in by_host.items())
        return f"not reached (as rank 0 heard): {where}"

    def broadcast_abort(self, reason: str) -> None:
        """Set our abort flag and tell every other rank why."""
        self.abort.set(reason)
        for conn in self._live():
            try:
                self._send(conn.sock, ("abort", reason))
            except OSError:
                pass

    def close(self) -> None:
        """Stop watching and close every client socket (the listener stays for the next init). Idempotent:
        a failed gather closes before the caller's cleanup closes again."""
        if self._closed:
            return
        self._closed = self._closing = True
        os.write(self._wake_write, b"\0")
        if self._monitor is not None:
            self._monitor.join(2.0)
        os.close(self._wake_read)
        os.close(self._wake_write)
        if self.local_listener is not None:
            self.local_listener.close()
        for conn in self.conns.values():
            try:  # rank 0 leaves after the negotiated shutdown: not a crash the others must report
                self._send(conn.sock, ("bye",))
            except OSError:
                pass
            conn.sock.close()


