"""Listening sockets of the control plane: where to bind so that the ranks reach an address, and a port
taken meanwhile retried for a while (rank 0's rendezvous, a worker's reserved port, the launcher's
membership service, gloo's store)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import time

from hvdrun.errors import RendezvousError

_BIND_RETRY_S = 5.0
MIN_BACKLOG = 128


def bind_host(addr: str) -> str:
    """Where to listen so that ranks reach ``addr``: that address itself when it is an IP address
    (loopback for a job on one machine, the advertised interface otherwise), every interface for a name."""
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return ""
    return addr


def listen(addr: str, port: int, backlog: int, until: float | None = None) -> socket.socket:
    """A listening socket on ``bind_host(addr):port``; a port taken by someone else is retried for a while (until the
    monotonic time ``until`` when given: an earlier init()'s listener may still be closing).

    Raises:
        RendezvousError: the port stayed taken.
    """
    deadline = time.monotonic() + _BIND_RETRY_S if until is None else until
    while True:
        try:
            return socket.create_server((bind_host(addr), port), backlog=max(backlog, MIN_BACKLOG))
        except OSError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                where, reason = f"{bind_host(addr) or '*'}:{port}", os.strerror(e.errno or 0)
                raise RendezvousError(f"cannot listen on {where}: {reason}; the port hvdrun chose was taken by "
                                      "another program meanwhile: start the job again") from e
            time.sleep(0.1)
