"""A worker's side of an elastic job's membership: which round it joins, and with which rank.

In an elastic job (``hvdrun --min-np/--max-np/--host-discovery-script``) ranks are not fixed at
launch. The launcher runs a membership service (``hvdrun.launch.elastic.membership_service``); at every
``init()`` a worker connects to it (authenticated with the job's secret), says which worker it is
and where it could serve the round's rendezvous, and waits. When every live worker has come, the
service answers each with its assignment: the round number, the worker's rank and the world size,
and the address of the worker that is rank 0 this round. Rank 0 is always a worker of the previous
round (its state is the one that is broadcast), joiners come last. The messages and the assignment
are named in :mod:`hvdrun.protocol.rounds`.

The service also counts *host updates* (workers added, hosts removed, workers lost); rank 0 asks
for that count at each commit (``hvdrun.torch.elastic``) and, when it moved, every rank resets.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from hvdrun import envvars
from hvdrun.errors import HvdrunError
from hvdrun.protocol.rounds import MEMBERSHIP_ASSIGN, MEMBERSHIP_JOIN, MEMBERSHIP_UPDATES, Assignment
from hvdrun.protocol.sockets import listen
from hvdrun.protocol.wire import authenticate_server, recv_frame, send_frame
from hvdrun.runtime.rendezvous import reserve_listener

_CONNECT_TIMEOUT_S = 10.0


class MembershipError(HvdrunError):
    """The launcher's membership service is gone, or no round formed in time: this worker cannot go on.

    Not a collective failure (``HorovodInternalError``): resetting again would not help.
    """


class WorkerRemoved(MembershipError):
    """The launcher took this worker out of the job (its host left discovery, or the job is ending)."""


def is_elastic(environ: Mapping[str, str]) -> bool:
    """Whether this worker belongs to an elastic job."""
    return envvars.ELASTIC_ADDR in environ


def _service(environ: Mapping[str, str]) -> tuple[str, int, bytes]:
    return environ[envvars.ELASTIC_ADDR], int(environ[envvars.ELASTIC_PORT]), environ[envvars.SECRET].encode()


def _connect(environ: Mapping[str, str]) -> socket.socket:
    addr, port, secret = _service(environ)
    try:
        sock = socket.create_connection((addr, port), timeout=_CONNECT_TIMEOUT_S)
        authenticate_server(sock, secret, f"hvdrun's membership service at {addr}:{port}")
    except OSError as e:
        raise MembershipError(f"cannot reach hvdrun's membership service at {addr}:{port}: {e}; "
                              "did the launcher exit?") from e
    return sock


_reserved: dict[str, int] = {}  # this worker's rendezvous port per local address, kept for its life


def _rendezvous_port(local_addr: str) -> int:
    """A port this worker listens on already, in case it becomes rank 0 of a round."""
    port = _reserved.get(local_addr)
    if port is None:
        sock = listen(local_addr, 0, 128)
        port = _reserved[local_addr] = sock.getsockname()[1]
        reserve_listener(local_addr, port, sock)
    return port


def join_round(environ: Mapping[str, str]) -> Assignment:
    """Wait for the next round to form and return this worker's place in it.

    The launcher decides how long a round may take (``--elastic-timeout``) and answers every
    waiting worker when it gives up, so the wait has no clock of its own; a launcher that dies
    closes the connection (and its guard stops this worker anyway).

    Raises:
        WorkerRemoved: the launcher has no place for this worker any more.
        MembershipError: the service is gone.
    """
    sock = _connect(environ)
    try:
        local_addr = sock.getsockname()[0]
        worker = int(environ[envvars.WORKER_ID])
        send_frame(sock, (MEMBERSHIP_JOIN, worker, local_addr, _rendezvous_port(local_addr), os.getpid()))
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        try:
            kind, body = recv_frame(sock)
        except (OSError, ConnectionError, EOFError) as e:
            raise MembershipError(f"worker {worker}: the launcher's membership service closed: {e}") from e
    finally:
        sock.close()
    if kind != MEMBERSHIP_ASSIGN:
        raise WorkerRemoved(str(body))
    return Assignment(**body)


def host_updates(environ: Mapping[str, str]) -> int:
    """The launcher's current host-update count (one short request)."""
    sock = _connect(environ)
    try:
        sock.settimeout(_CONNECT_TIMEOUT_S)
        send_frame(sock, (MEMBERSHIP_UPDATES,))
        kind, count = recv_frame(sock)
    except (OSError, ConnectionError, EOFError) as e:
        raise MembershipError(f"hvdrun's membership service did not answer: {e}") from e
    finally:
        sock.close()
    return int(count)

