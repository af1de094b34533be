"""Blocking socket helpers for the control plane: framed messages and mutual authentication.

Authentication is an HMAC-SHA256 challenge/response with the job's secret, in both
directions, so neither side ever sends the secret and a peer without it is refused::

    server -> client   b"HVD1" + server_nonce
    client -> server   client_nonce + HMAC(secret, b"client" + server_nonce + client_nonce)
    server -> client   b"OKAY" + HMAC(secret, b"server" + client_nonce + server_nonce)   (or b"DENY")

Every control connection speaks it: the rendezvous and the data links between ranks, ``hvdrun stacks``
asking rank 0, and an elastic job's workers joining the launcher's membership service.
"""

from __future__ import annotations

import hashlib
import hmac
import marshal
import os
import socket
import struct
from typing import Any

from hvdrun.envvars import SECRET
from hvdrun.errors import RendezvousError

MAGIC = b"HVD1"
_NONCE = 32
_DIGEST = 32
_FRAME = struct.Struct("<I")
MAX_FRAME_BYTES = 64 << 20


class AuthError(RendezvousError):
    """The peer did not prove it knows the job's secret."""


def recv_exact(sock: socket.socket, count: int) -> bytes:
    """Read exactly ``count`` bytes; raise ConnectionError at EOF."""
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("connection closed by peer")
        data += chunk
    return bytes(data)


def send_frame(sock: socket.socket, obj: Any) -> None:
    """Send one marshalled object with a length prefix."""
    payload = marshal.dumps(obj)
    sock.sendall(_FRAME.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> Any:
    """Receive one object sent by :func:`send_frame`."""
    (length,) = _FRAME.unpack(recv_exact(sock, _FRAME.size))
    if length > MAX_FRAME_BYTES:
        raise ConnectionError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    return marshal.loads(recv_exact(sock, length))


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def authenticate_client(sock: socket.socket, secret: bytes) -> None:
    """Server side: prove the connecting peer knows ``secret`` (and prove we do)."""
    server_nonce = os.urandom(_NONCE)
    sock.sendall(MAGIC + server_nonce)
    reply = recv_exact(sock, _NONCE + _DIGEST)
    client_nonce, digest = reply[:_NONCE], reply[_NONCE:]
    if not hmac.compare_digest(digest, _mac(secret, b"client", server_nonce, client_nonce)):
        sock.sendall(b"DENY")
        raise AuthError("a connection did not present the job's secret; refused it")
    sock.sendall(b"OKAY" + _mac(secret, b"server", client_nonce, server_nonce))


def authenticate_server(sock: socket.socket, secret: bytes, peer: str) -> None:
    """Client side: answer the server's challenge and check its answer to ours."""
    hello = recv_exact(sock, len(MAGIC) + _NONCE)
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthError(f"{peer} is not an hvdrun rendezvous (wrong greeting)")
    server_nonce, client_nonce = hello[len(MAGIC):], os.urandom(_NONCE)
    sock.sendall(client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
    verdict = recv_exact(sock, 4)
    if verdict != b"OKAY":
        raise AuthError(f"{peer} refused our secret: this rank's {SECRET} differs from the job's")
    if not hmac.compare_digest(recv_exact(sock, _DIGEST), _mac(secret, b"server", client_nonce, server_nonce)):
        raise AuthError(f"{peer} does not know the job's secret")

