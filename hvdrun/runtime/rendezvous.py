"""Rendezvous: rank 0 serves an authenticated TCP control socket that every other rank joins.

1. Every rank sends its :class:`Peer` record (host, pid, data endpoint); rank 0 answers with
   the table of all of them, or with an error naming the ranks that never arrived.
2. Afterwards the control connections are the job's failure detector: if one drops without
   a goodbye, rank 0 tells every other rank which rank died; if rank 0 drops, every rank
   notices by itself. Either way the :class:`AbortFlag` is set and every wait loop raises.
3. They also carry reports (:mod:`hvdrun.runtime.forensics`): an inspector that knows the secret
   (``hvdrun stacks``, or hvdrun on Ctrl-\\) connects to rank 0 and sends ``("inspect",)``; rank 0 asks
   every rank for its report over the control connections and answers with all of them. Rank 0's
   stall check gathers the same reports itself.
"""

from __future__ import annotations

import errno
import ipaddress
import marshal
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any

from hvdrun.envvars import START_TIMEOUT
from hvdrun.errors import RendezvousError
from hvdrun.runtime.forensics import format_reports
from hvdrun.runtime.transport.base import AbortFlag
from hvdrun.runtime.wire import AuthError, authenticate_client, authenticate_server, recv_frame, send_frame

_HANDSHAKE_TIMEOUT_S = 5.0  # an unauthenticated connection is dropped after this, whatever it sends
REPORT_TIMEOUT_S = 3.0  # how long rank 0 waits for the ranks' reports (a rank stuck holding the GIL never answers)
INSPECT = "inspect"
SIGNAL = "signal"  # an inspector's request: pass signal N to every rank's process (hvdrun --forward-signals)
Reporter = Callable[[], dict[str, Any]]
_BIND_RETRY_S = 5.0
_MIN_BACKLOG = 128
# Rank 0 keeps its listening socket for the life of the process: between a shutdown() and the
# next init() the kernel could otherwise hand the port to another socket (an ephemeral port).
_listeners: dict[tuple[str, int], socket.socket] = {}


def bind_host(addr: str) -> str:
    """Where to listen so that ranks reach ``addr``: that address itself when it is an IP address
    (loopback for a job on one machine, the advertised interface otherwise), every interface for a name."""
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return ""
    return addr


def listen(addr: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on ``bind_host(addr):port``; a port taken by someone else is retried for a while.

    Raises:
        RendezvousError: the port stayed taken.
    """
    deadline = time.monotonic() + _BIND_RETRY_S
    while True:
        try:
            return socket.create_server((bind_host(addr), port), backlog=max(backlog, _MIN_BACKLOG))
        except OSError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                where, reason = f"{bind_host(addr) or '*'}:{port}", os.strerror(e.errno or 0)
                raise RendezvousError(f"cannot listen on {where}: {reason}; the port hvdrun chose was taken by "
                                      "another program meanwhile: start the job again") from e
            time.sleep(0.1)


def reserve_listener(addr: str, port: int, sock: socket.socket) -> None:
    """Keep ``sock`` (listening on ``addr:port``) for a later rank 0 of this process to serve on."""
    _listeners[(addr, port)] = sock


def _listener(addr: str, port: int, size: int) -> socket.socket:
    sock = _listeners.get((addr, port))
    if sock is None or sock.fileno() < 0:
        sock = _listeners[(addr, port)] = listen(addr, port, size)
    else:
        sock.listen(max(size, _MIN_BACKLOG))  # a larger job than last time: room for all its ranks at once
    return sock


@dataclass(frozen=True)
class Peer:
    """What every rank learns about every other rank."""

    rank: int
    hostname: str
    host_key: str
    pid: int
    data_addr: str
    data_port: int
    store_port: int = 0  # rank 0: the TCPStore of the device process group (0: none)
    settings: str = ""  # what must be the same on every rank (the algorithms across hosts), compared after the exchange

    def describe(self) -> str:
        """``rank 3 (host n2, pid 1234)``."""
        return f"rank {self.rank} (host {self.hostname}, pid {self.pid})"


class _Server:
    """Rank 0's side: accepts the other ranks, then watches their connections."""

    def __init__(self, addr: str, port: int, size: int, secret: bytes, abort: AbortFlag, generation: int) -> None:
        self.size, self.secret, self.abort, self.generation = size, secret, abort, generation
        self.listener = _listener(addr, port, size)
        self._handshakes = threading.BoundedSemaphore(max(2 * size, 16))
        self.clients: dict[int, tuple[socket.socket, Peer]] = {}
        self._lock = threading.Lock()
        self._closing = self._closed = False
        self._said_bye: set[int] = set()
        self._monitor: threading.Thread | None = None
        self._wake_read, self._wake_write = os.pipe()
        self.reporter: Reporter | None = None  # rank 0's own report (set by the runtime)
        self._send_lock = threading.Lock()
        self._reports: dict[int, dict[int, Any]] = {}  # request id -> rank -> report
        self._reported = threading.Condition()
        self._requests = 0

    def gather_reports(self, timeout_s: float = REPORT_TIMEOUT_S) -> tuple[list[dict[str, Any]], dict[int, str]]:
        """Every rank's report (rank 0's own included) and why the others have none."""
        with self._reported:
            self._requests += 1
            request = self._requests
            self._reports[request] = {}
        live = {rank: sock for rank, (sock, _) in list(self.clients.items()) if rank not in self._said_bye}
        absent = {rank: "it left the job" for rank in self._said_bye}
        if self._monitor is None:  # the rendezvous is still gathering: joined ranks wait for the table
            absent.update({rank: "joined rank 0; waits for the other ranks to join" for rank in live})
            live = {}
        for rank, sock in live.items():
            try:
                self._send(sock, ("report?", request))
            except OSError as e:
                absent[rank] = f"its control connection failed: {e}"
        deadline = time.monotonic() + timeout_s
        with self._reported:
            while set(live) - set(absent) - set(self._reports[request]) and time.monotonic() < deadline:
                self._reported.wait(deadline - time.monotonic())
            replies = self._reports.pop(request)
        for rank in [rank for rank, report in replies.items() if "rank" not in report]:
            del replies[rank]
            absent[rank] = "its runtime had no report to give"
        for rank in set(live) - set(replies) - set(absent):
            absent[rank] = f"did not answer within {timeout_s:g} s (busy in code that holds Python's lock?)"
        for rank in set(range(1, self.size)) - set(live) - set(absent):
            absent[rank] = "has not joined rank 0 (not in init() yet, or cannot reach rank 0)"
        own = _report_or_none(self.reporter)
        if own is None:
            absent[0] = "its report failed"
        return sorted([*replies.values(), *([own] if own else [])], key=lambda r: r["rank"]), absent

    def signal_ranks(self, signum: int) -> int:
        """Send ``signum`` to every other rank's process; the number of ranks it reaches with rank 0's own."""
        reached = 0
        for rank, (sock, _) in list(self.clients.items()):
            if rank not in self._said_bye:
                try:
                    self._send(sock, (SIGNAL, signum))
                    reached += 1
                except OSError:
                    pass
        return reached + 1

    def _send(self, sock: socket.socket, message: Any) -> None:
        with self._send_lock:
            send_frame(sock, message)

    def _serve_inspector(self, sock: socket.socket) -> None:
        """Answer an inspector (see the module docstring) with every rank's report."""
        reports, absent = self.gather_reports()
        send_frame(sock, ("reports", reports, sorted(absent.items()), self.size))
        sock.close()

    def gather(self, me: Peer, deadline: float) -> list[Peer]:
        """Accept connections until every rank joined; send everyone the table."""
        while len(self.clients) < self.size - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail_missing(deadline)
            if select.select([self.listener], [], [], min(remaining, 0.005))[0]:
                self._accept()
        peers = sorted([me] + [peer for _, peer in self.clients.values()], key=lambda p: p.rank)
        table = [astuple(p) for p in peers]
        for sock, _ in self.clients.values():
            send_frame(sock, ("table", table))
        self._monitor = threading.Thread(target=self._watch, name="hvdrun-rendezvous", daemon=True)
        self._monitor.start()
        return peers

    def _accept(self) -> None:
        """Take one connection; at most 2 x size handshakes at once, each dropped after its deadline."""
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        if not self._handshakes.acquire(blocking=False):
            sock.close()  # a flood of connections that never authenticate: refuse, keep serving the job
            return
        threading.Thread(target=self._admit_within_deadline, args=(sock,), name="hvdrun-admit", daemon=True).start()

    def _admit_within_deadline(self, sock: socket.socket) -> None:
        watchdog = threading.Timer(_HANDSHAKE_TIMEOUT_S, _drop, args=(sock,))
        watchdog.name = "hvdrun-handshake-watchdog"
        watchdog.start()
        try:
            self._admit(sock)
        finally:
            watchdog.cancel()
            self._handshakes.release()

    def _admit(self, sock: socket.socket) -> None:
        sock.settimeout(_HANDSHAKE_TIMEOUT_S)
        try:
            authenticate_client(sock, self.secret)
            generation, row = recv_frame(sock)
            if generation == INSPECT:
                self._serve_inspector(sock)
                return
            if generation == SIGNAL:
                signum = int(row)
                send_frame(sock, ("signalled", self.signal_ranks(signum)))
                sock.close()
                _signal_self(signum)  # rank 0 last: it may die of it (no handler), after the answer
                return
            if generation != self.generation:  # a rank already on its next init() reached our old server
                send_frame(sock, ("retry", f"rank 0 is at init #{self.generation}, not #{generation}"))
                sock.close()
                return
            peer = Peer(*row)
            with self._lock:
                if not 0 < peer.rank < self.size or peer.rank in self.clients or self._monitor is not None:
                    send_frame(sock, ("error", f"rank {peer.rank} is not expected by this job (size {self.size})"))
                    sock.close()
                    return
                sock.settimeout(None)
                self.clients[peer.rank] = (sock, peer)
        except (OSError, ValueError, TypeError, EOFError, AuthError):
            sock.close()

    def _fail_missing(self, deadline: float) -> None:
        missing = sorted(set(range(1, self.size)) - set(self.clients))
        message = (f"rendezvous timed out: ranks {', '.join(map(str, missing))} never joined rank 0 "
                   f"(raise {START_TIMEOUT} if they start slowly)")
        if self.reporter is not None:  # where every rank is, before they are stopped
            try:
                reports, absent = self.gather_reports(0.0)
                sys.stderr.write(f"hvdrun: where every rank is, as the rendezvous times out\n"
                                 f"{format_reports(reports, self.size, absent)}\n")
            except Exception:  # noqa: BLE001 - a report must never hide the rendezvous error itself
                pass
        for sock, _ in self.clients.values():
            try:
                send_frame(sock, ("error", message))
            except OSError:
                pass
        self.close()
        raise RendezvousError(message)

    def _watch(self) -> None:
        while not self._closing:
            socks = {sock: peer for sock, peer in self.clients.values() if peer.rank not in self._said_bye}
            watched: list[Any] = [self.listener, self._wake_read, *socks]
            try:
                readable = select.select(watched, [], [], 0.5)[0]
            except (OSError, ValueError):
                return
            for sock in readable:
                if sock is self._wake_read:
                    return
                if sock is self.listener:
                    self._refuse_late()
                else:
                    self._read_client(sock, socks[sock])

    def _refuse_late(self) -> None:
        self._accept()

    def _read_client(self, sock: socket.socket, peer: Peer) -> None:
        try:
            message = recv_frame(sock)
        except (OSError, ConnectionError, EOFError, ValueError):
            message = None
        if message == ("bye",):
            self._said_bye.add(peer.rank)
            return
        if self._closing:
            return
        if isinstance(message, tuple) and message[:1] == ("report",):
            with self._reported:
                if message[1] in self._reports:
                    self._reports[message[1]][peer.rank] = message[2]
                    self._reported.notify_all()
            return
        if isinstance(message, tuple) and message[:1] == ("abort",):
            self.broadcast_abort(str(message[1]))
            return
        self.broadcast_abort(f"{peer.describe()} disconnected without shutting down: it exited or crashed")

    def broadcast_abort(self, reason: str) -> None:
        """Set our abort flag and tell every other rank why."""
        self.abort.set(reason)
        for rank, (sock, _) in self.clients.items():
            if rank not in self._said_bye:
                try:
                    self._send(sock, ("abort", reason))
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
        for sock, _ in self.clients.values():
            try:  # rank 0 leaves after the negotiated shutdown: not a crash the others must report
                self._send(sock, ("bye",))
            except OSError:
                pass
            sock.close()


def _report_or_none(reporter: Reporter | None) -> dict[str, Any] | None:
    """The reporter's report, or None when there is none or it failed: a report never breaks the control plane."""
    if reporter is None:
        return None
    try:
        report = reporter()
        marshal.dumps(report)  # what travels must marshal
        return report
    except Exception:  # noqa: BLE001
        return None


def _signal_self(signum: Any) -> None:
    """Pass a forwarded signal to this rank's process (its handler runs in the main thread)."""
    try:
        os.kill(os.getpid(), int(signum))
    except (OSError, ValueError, TypeError):
        pass


def _drop(sock: socket.socket) -> None:
    """End a handshake that took too long (the admitting thread's recv then fails)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Client:
    """A non-zero rank's side: joins rank 0, then listens for aborts."""

    def __init__(self, addr: str, port: int, secret: bytes, abort: AbortFlag, generation: int) -> None:
        self.addr, self.port, self.secret, self.abort = addr, port, secret, abort
        self.generation = generation
        self.sock: socket.socket | None = None
        self._closing = False
        self.reporter: Reporter | None = None  # this rank's report (set by the runtime)
        self._send_lock = threading.Lock()

    def connect(self, deadline: float) -> socket.socket:
        """Connect to rank 0 and authenticate, retrying until ``deadline``.

        A connection that is refused, or that closes or falls silent during the handshake (another
        process held the port for a moment, or rank 0 is not listening yet), is tried again; a peer
        that proves it does not know the job's secret (:class:`AuthError`) is not.
        """
        while True:
            try:
                sock = socket.create_connection((self.addr, self.port), timeout=_HANDSHAKE_TIMEOUT_S)
            except OSError as e:
                self._retry_or_fail(deadline, f"cannot reach rank 0 at {self.addr}:{self.port}: {e.strerror or e}; "
                                              "is rank 0 running and the address reachable?", e)
                continue
            try:
                authenticate_server(sock, self.secret, f"rank 0 at {self.addr}:{self.port}")
            except (OSError, ConnectionError) as e:
                sock.close()
                self._retry_or_fail(deadline, f"rank 0 at {self.addr}:{self.port} did not complete the handshake: "
                                              f"{e}", e)
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

    def join(self, me: Peer, deadline: float) -> list[Peer]:
        """Send our record, wait for the table, then start listening for aborts."""
        while True:
            if self.sock is None:
                self.connect(deadline)
            assert self.sock is not None
            send_frame(self.sock, (self.generation, astuple(me)))
            self.sock.settimeout(max(deadline - time.monotonic(), 0.1) + _HANDSHAKE_TIMEOUT_S)
            try:
                kind, body = recv_frame(self.sock)
            except (OSError, ConnectionError, EOFError, ValueError) as e:
                raise RendezvousError(f"rank 0 at {self.addr}:{self.port} closed the rendezvous: {e}") from e
            if kind != "retry" or time.monotonic() > deadline:
                break
            self.sock.close()
            self.sock = None
            time.sleep(0.02)
        if kind != "table":
            raise RendezvousError(str(body))
        self.sock.settimeout(None)
        threading.Thread(target=self._watch, name="hvdrun-rendezvous", daemon=True).start()
        return [Peer(*row) for row in body]

    def _watch(self) -> None:
        assert self.sock is not None
        try:
            while True:
                kind, body = recv_frame(self.sock)
                if kind == "abort":
                    self.abort.set(body)
                    return
                if kind == "bye":  # rank 0 shut down cleanly; our own shutdown is finishing
                    return
                if kind == SIGNAL:
                    _signal_self(body)
                    continue
                if kind == "report?":
                    self._send(("report", body, _report_or_none(self.reporter) or {}))
        except (OSError, ConnectionError, EOFError, ValueError):
            if not self._closing:
                self.abort.set(f"lost the connection to rank 0 at {self.addr}: rank 0 exited or crashed")

    def _send(self, message: Any) -> None:
        """One frame to rank 0: the watch thread's answers and the caller's messages never interleave."""
        assert self.sock is not None
        with self._send_lock:
            send_frame(self.sock, message)

    def report_failure(self, reason: str) -> None:
        """Ask rank 0 to abort every rank with ``reason``."""
        if self.sock is not None:
            self._send(("abort", reason))

    def close(self) -> None:
        """Say goodbye so rank 0 does not report us as crashed."""
        self._closing = True
        if self.sock is not None:
            try:
                self._send(("bye",))
            except OSError:
                pass
            self.sock.close()


class Rendezvous:
    """One rank's membership in the job's control plane.

    Args:
        rank: this rank.
        size: number of ranks.
        addr: rank 0's advertised address.
        port: rank 0's control port.
        secret: the job's secret (bytes).
        abort: the flag to set when a peer fails.
        generation: how many times this process called init() before; all ranks agree on it.
    """

    def __init__(self, rank: int, size: int, addr: str, port: int, secret: bytes, abort: AbortFlag,
                 generation: int = 0) -> None:
        self.rank, self.size, self.addr, self.port = rank, size, addr, port
        self.abort = abort
        self._server = _Server(addr, port, size, secret, abort, generation) if rank == 0 else None
        self._client = _Client(addr, port, secret, abort, generation) if rank != 0 else None

    def local_address(self, deadline: float) -> str:
        """The address of this rank that the others can reach (the route to rank 0)."""
        if self._client is None:
            return self.addr
        return str(self._client.connect(deadline).getsockname()[0])

    def exchange(self, me: Peer, timeout_s: float) -> list[Peer]:
        """Publish ``me`` and return every rank's record, in rank order."""
        deadline = time.monotonic() + timeout_s
        if self._server is not None:
            return self._server.gather(me, deadline)
        assert self._client is not None
        return self._client.join(me, deadline)

    def set_reporter(self, reporter: Reporter) -> None:
        """What this rank answers when asked for its report."""
        endpoint = self._server or self._client
        assert endpoint is not None
        endpoint.reporter = reporter

    def gather_reports(self) -> tuple[list[dict[str, Any]], dict[int, str]] | None:
        """Rank 0: every rank's report and why some have none (other ranks: None)."""
        return self._server.gather_reports() if self._server is not None else None

    def report_failure(self, reason: str) -> None:
        """Tell the other ranks that this rank hit a fatal error (rank 0 relays it)."""
        if self._server is not None:
            self._server.broadcast_abort(reason)
        elif self._client is not None:
            self._client.report_failure(reason)

    def close(self) -> None:
        """Leave the job cleanly."""
        if self._server is not None:
            self._server.close()
        if self._client is not None:
            self._client.close()
