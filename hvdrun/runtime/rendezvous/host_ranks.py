"""The other ranks of a host, as its leader (:mod:`.leader`) gathers them: they join it on a local socket,
authenticated with the job's secret as rank 0's TCP socket is, and are watched until each says goodbye (as a leader's
child hosts are, :mod:`.children`)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from hvdrun.protocol.wire import AuthError, authenticate_client, recv_frame, send_frame
from hvdrun.runtime.peers import Peer
from hvdrun.runtime.rendezvous.common import same_user, send_to_each

_LOCAL_HANDSHAKE_S = 2.0  # a local rank's handshake; a connection that stalls longer is dropped


class HostRanks:
    """The ranks that joined their host's leader (see the module docstring).

    Args:
        listener: the local socket the host's ranks join (the leader bound it first: it leads the host).
        secret: the job's secret; a connection that does not prove it is dropped.
        generation: this process's init() generation; a rank of another one is refused.
    """

    def __init__(self, listener: socket.socket, secret: bytes, generation: int) -> None:
        self.listener, self.secret, self.generation = listener, secret, generation
        self.by_sock: dict[socket.socket, Peer] = {}
        self.said_bye: set[socket.socket] = set()  # said goodbye, or no longer watched

    def admit(self) -> Peer | None:
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
            authenticate_client(sock, self.secret)
            generation, row = recv_frame(sock)
            peer = Peer(*row)
            if generation != self.generation or any(p.rank == peer.rank for p in self.by_sock.values()):
                send_frame(sock, ("error", f"rank {peer.rank} is not expected by this host's leader"))
                sock.close()
                return None
        except (OSError, ValueError, TypeError, EOFError, AuthError, ConnectionError):
            sock.close()
            return None
        sock.settimeout(None)
        self.by_sock[sock] = peer
        return peer

    def live(self) -> dict[socket.socket, Peer]:
        """The ranks still watched (no goodbye yet), by connection."""
        return {sock: peer for sock, peer in self.by_sock.items() if sock not in self.said_bye}

    def left(self) -> list[Peer]:
        """The ranks that said goodbye, or are no longer watched."""
        return [peer for sock, peer in self.by_sock.items() if sock in self.said_bye]

    def send_all(self, message: Any, send: Callable[[socket.socket, Any], None] = send_frame) -> None:
        """``message`` to every rank still watched (one that cannot take it is found by the watch)."""
        send_to_each(self.live(), message, send)

    def close(self) -> None:
        """Close every rank's connection and the local socket."""
        for sock in self.by_sock:
            sock.close()
        self.listener.close()
