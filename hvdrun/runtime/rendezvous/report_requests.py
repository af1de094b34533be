"""Report requests over the control connections (``hvdrun stacks``, ``hvdrun top``, a rendezvous that times out):
rank 0 asks every connection for its ranks' reports and waits for them (:class:`ReportBook`); a host's leader asks its
own host's ranks and its child hosts, and answers up for its host in one message (:class:`RelayedReports`).

Every rank without a report is named with why: it left the job, its connection failed, it did not answer in time.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from hvdrun.runtime.rendezvous.children import Children
from hvdrun.runtime.rendezvous.host_ranks import HostRanks

Reports = tuple[list[dict[str, Any]], dict[int, str]]  # every report, by rank; why the other ranks have none


class ReportBook:
    """Rank 0's report requests waiting for their answers: by request, the reports so far and why a host's leader
    has none for some of its ranks. Answers come on the watching thread; the asker waits on another."""

    def __init__(self) -> None:
        self._reports: dict[int, dict[int, Any]] = {}  # request id -> rank -> report
        self._absent: dict[int, dict[int, str]] = {}  # request id -> rank -> why a leader has no report for it
        self._reported = threading.Condition()
        self._requests = 0

    def open(self) -> int:
        """A new request's id; its answers are kept from now on, until :meth:`wait` returns them."""
        with self._reported:
            self._requests += 1
            request = self._requests
            self._reports[request], self._absent[request] = {}, {}
        return request

    def take(self, ranks: list[int], message: tuple[Any, ...]) -> None:
        """A rank's report, or a host leader's reports for its ranks and why some have none (``ranks``: those of
        the connection it came on); one for a request no longer open is dropped."""
        with self._reported:
            request = message[1]
            if request not in self._reports:
                return
            if message[0] == "report":
                self._reports[request][ranks[0]] = message[2]
            else:
                self._reports[request].update(message[2])
                self._absent[request].update(message[3])
            self._reported.notify_all()

    def wait(self, request: int, expected: set[int], deadline: float) -> tuple[dict[int, Any], dict[int, str]]:
        """Until every rank of ``expected`` answered ``request`` or the monotonic ``deadline`` passed; the reports by
        rank and why a leader has none for some ranks. The request is closed."""
        with self._reported:
            while expected - set(self._reports[request]) - set(self._absent[request]) and time.monotonic() < deadline:
                self._reported.wait(deadline - time.monotonic())
            return self._reports.pop(request), self._absent.pop(request)


def every_rank(replies: dict[int, Any], absent: dict[int, str], expected: set[int], timeout_s: float,
               not_joined: set[int], own: dict[str, Any] | None) -> Reports:
    """Rank 0's answer to a request: the reports (``replies`` and rank 0's ``own``), in rank order, and why every other
    rank has none (``absent`` so far, ``expected`` ranks that did not answer, the ranks that have ``not_joined``)."""
    for rank in [rank for rank, report in replies.items() if "rank" not in report]:
        del replies[rank]
        absent[rank] = "its runtime had no report to give"
    for rank in expected - set(replies) - set(absent):
        absent[rank] = f"did not answer within {timeout_s:g} s (busy in code that holds Python's lock?)"
    for rank in not_joined - set(absent):
        absent[rank] = "has not joined rank 0 (not in init() yet, or cannot reach rank 0)"
    if own is None:
        absent[0] = "its report failed"
    return sorted([*replies.values(), *([own] if own else [])], key=lambda r: r["rank"]), absent


class _Pending:
    """A report request of rank 0 that the leader's ranks are answering."""

    def __init__(self, request: int, expected: set[int], timeout_s: float) -> None:
        self.request, self.expected, self.timeout_s = request, expected, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.reports: dict[int, Any] = {}
        self.absent: dict[int, str] = {}

    def done(self) -> bool:
        return not self.expected - set(self.reports) - set(self.absent) or time.monotonic() >= self.deadline


class RelayedReports:
    """A host leader's report requests in flight, all on its watching thread: asked of its host's ranks (answered up
    together, once every one answered or its time is up) and of its child hosts (each answers up on its own, through
    the leader, a frame per child, so that no frame holds a whole subtree's stacks).

    Args:
        host_ranks: the other ranks of the leader's host.
        children: the hosts the leader admits in the tree (None: a leaf, or no tree).
        own: the leader's own report of a kind (``what``), with its rank (None: it has none).
        send: how the leader sends to one of its ranks or children (one sender at a time).
        up_send: how the leader sends up, to rank 0 or its parent's leader (a failure is the watch's to find).
    """

    def __init__(self, host_ranks: HostRanks, children: Children | None,
                 own: Callable[[str], tuple[int, dict[str, Any]] | None],
                 send: Callable[[socket.socket, Any], None], up_send: Callable[[Any], None]) -> None:
        self.host_ranks, self.children, self.own = host_ranks, children, own
        self.send, self.up_send = send, up_send
        self._pending: dict[int, _Pending] = {}

    def next_timeout(self) -> float:
        """How long the watch may wait before a pending request is due."""
        if not self._pending:
            return 0.5
        return max(min(p.deadline for p in self._pending.values()) - time.monotonic(), 0.0)

    def ask(self, request: int, timeout_s: float, what: str) -> None:
        """Forward report request ``request`` (its asker waits ``timeout_s`` for ``what``) down."""
        live = self.host_ranks.live()
        # answer before the asker's own wait ends (shorter a level down the tree)
        pending = _Pending(request, {peer.rank for peer in live.values()}, timeout_s * 0.8)
        pending.absent.update({peer.rank: "it left the job" for peer in self.host_ranks.left()})
        self._ask_children(pending, timeout_s * 0.8, what)
        own = self.own(what)
        if own is not None:
            pending.reports[own[0]] = own[1]
        for sock, peer in live.items():
            try:
                self.send(sock, ("report?", request, timeout_s, what))
            except OSError as e:
                pending.absent[peer.rank] = f"its control connection failed: {e}"
        self._pending[request] = pending

    def _ask_children(self, pending: _Pending, timeout_s: float, what: str) -> None:
        """Forward a report request to the child hosts (each answers up on its own, :meth:`HostLeader._from_child`);
        why the ones that cannot answer have no report goes in ``pending``."""
        if self.children is None:
            return
        for child in self.children.by_sock.values():
            ranks = {peer.rank for peer in child.peers}
            if child.said_bye or child.lost:
                pending.absent.update({rank: "it left the job" for rank in ranks})
                continue
            try:
                self.send(child.sock, ("report?", pending.request, timeout_s, what))
            except OSError as e:
                pending.absent.update({rank: f"its control connection failed: {e}" for rank in ranks})

    def take(self, request: int, rank: int, report: Any) -> None:
        """Rank ``rank``'s report for ``request`` (one for a request no longer pending is dropped)."""
        pending = self._pending.get(request)
        if pending is not None:
            pending.reports[rank] = report

    def answer_due(self) -> None:
        """Send up the host's answer to every request that is done (every rank answered, or its time is up)."""
        for request, pending in list(self._pending.items()):
            if pending.done():
                del self._pending[request]
                for rank in pending.expected - set(pending.reports) - set(pending.absent):
                    pending.absent[rank] = (f"did not answer within {pending.timeout_s:.2g} s (busy in code "
                                           "that holds Python's lock?)")
                self.up_send(("reports", request, pending.reports, pending.absent))
