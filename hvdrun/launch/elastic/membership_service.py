"""The launcher's membership service of an elastic job: it answers the workers over the wire.

At every ``init()`` a worker (:mod:`hvdrun.runtime.membership`, the other end) connects, proves it
knows the job's secret and either asks for the *host updates* count (answered at once) or joins
the next round: its connection then waits here until the elastic driver
(:mod:`hvdrun.launch.elastic.driver`) decides the round and :meth:`MembershipService.assign` answers
every waiting worker with its place, or until the worker is told to leave. The messages and the
assignment are named in :mod:`hvdrun.protocol.rounds`.

The service only keeps and answers connections; every decision (who forms a round, who leaves,
when the job ends) is the driver's.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hvdrun.protocol.rounds import (
    MEMBERSHIP_ASSIGN,
    MEMBERSHIP_JOIN,
    MEMBERSHIP_LEAVE,
    MEMBERSHIP_UPDATES,
    Assignment,
)
from hvdrun.protocol.sockets import listen
from hvdrun.protocol.wire import authenticate_client, recv_frame, send_frame

_HANDSHAKE_TIMEOUT_S = 5.0
JOB_ENDING = "the job is ending"


@dataclass
class _Join:
    """A worker waiting for its round: its open connection and where it could serve the rendezvous."""

    sock: socket.socket
    addr: str
    port: int


class MembershipService:
    """Answers an elastic job's workers: admits joins, counts host updates, sends assignments and leaves.

    Args:
        secret: the job's secret; a connection that does not prove it knows it is refused.
        is_member: whether a worker number belongs to the job (others are told to leave at once).
        notify: called when a worker joins, so that the driver looks at the waiting workers.
    """

    def __init__(self, secret: str, is_member: Callable[[int], bool], notify: Callable[[], None]) -> None:
        self.secret, self.is_member, self.notify = secret, is_member, notify
        self._joins: dict[int, _Join] = {}
        self._updates = 0
        self._round = 0
        self._lock = threading.Lock()
        self._closing = False
        self._listener: socket.socket | None = None
        self.address: tuple[str, int] = ("", 0)

    # -- what the driver asks ---------------------------------------------------------------------
    @property
    def round(self) -> int:
        """The number of the last round formed (0 before the first)."""
        return self._round

    def start(self, addr: str) -> tuple[str, int]:
        """Listen on ``addr`` (a free port) and answer workers from a thread; returns the address."""
        self._listener = listen(addr, 0, 128)
        self.address = (addr, self._listener.getsockname()[1])
        threading.Thread(target=self._serve, name="hvdrun-membership", daemon=True).start()
        return self.address

    def count_update(self) -> None:
        """The hosts changed (a worker was lost or started, a host left): running workers reset at their commit."""
        with self._lock:
            self._updates += 1

    def waiting(self) -> set[int]:
        """The numbers of the workers waiting for the next round."""
        with self._lock:
            return set(self._joins)

    def drop(self, number: int) -> None:
        """Forget the waiting connection of worker ``number`` (it ended)."""
        with self._lock:
            join = self._joins.pop(number, None)
        if join is not None:
            join.sock.close()

    def send_leave(self, number: int, reason: str) -> None:
        """Tell waiting worker ``number`` that it leaves the job, and why."""
        with self._lock:
            join = self._joins.pop(number)
        _reply(join.sock, (MEMBERSHIP_LEAVE, reason))

    def assign(self, order: Sequence[int]) -> int:
        """Form the next round of the waiting workers ``order`` (by rank: rank 0 first) and answer each
        with its place; returns the round's number. Rank 0's worker serves the round's rendezvous."""
        with self._lock:
            self._round += 1
            round_number, updates = self._round, self._updates
            chosen = [self._joins.pop(number) for number in order]
        head = chosen[0]
        for rank, join in enumerate(chosen):
            place = Assignment(round=round_number, rank=rank, size=len(order), rendezvous_addr=head.addr,
                               rendezvous_port=head.port, updates=updates)
            _reply(join.sock, (MEMBERSHIP_ASSIGN, asdict(place)))
        return round_number

    def stop_admitting(self) -> None:
        """From now on every join is told that the job is ending; so are the workers waiting now."""
        self._closing = True
        with self._lock:
            joins, self._joins = self._joins, {}
        for join in joins.values():
            _reply(join.sock, (MEMBERSHIP_LEAVE, JOB_ENDING))

    def close(self) -> None:
        """Stop listening."""
        if self._listener is not None:
            self._listener.close()

    # -- the wire ---------------------------------------------------------------------------------
    def _serve(self) -> None:
        assert self._listener is not None
        while not self._closing:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock,), daemon=True).start()

    def _admit(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(_HANDSHAKE_TIMEOUT_S)
            authenticate_client(sock, self.secret.encode())
            message = recv_frame(sock)
            sock.settimeout(None)
        except (OSError, ConnectionError, EOFError, ValueError):
            sock.close()
            return
        if message[0] == MEMBERSHIP_UPDATES:
            with self._lock:
                count = self._updates
            _reply(sock, (MEMBERSHIP_UPDATES, count))
            return
        if message[0] == MEMBERSHIP_JOIN:
            self._join(sock, message)
            return
        sock.close()

    def _join(self, sock: socket.socket, message: tuple[Any, ...]) -> None:
        """Keep a joining worker's connection until its round forms (or tell it to leave now)."""
        _, number, addr, port, _pid = message
        with self._lock:
            if self._closing or not self.is_member(number):
                reason = JOB_ENDING if self._closing else f"worker {number} is not part of this job"
            else:
                self._joins[number] = _Join(sock, addr, port)
                reason = ""
        if reason:
            _reply(sock, (MEMBERSHIP_LEAVE, reason))
        self.notify()


def _reply(sock: socket.socket, message: tuple[object, ...]) -> None:
    try:
        send_frame(sock, message)
    except OSError:
        pass
    finally:
        sock.close()
