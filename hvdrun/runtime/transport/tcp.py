"""TCP channels between ranks on different hosts (non-blocking sockets)."""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import time

from hvdrun.errors import PeerLostError
from hvdrun.runtime.transport.base import RxChannel, TxChannel

STAGING_BYTES = 4 << 20
SOCKET_BUFFER_BYTES = 4 << 20
CLOSE_FLUSH_S = 1.0  # how long a closing channel waits for its peer to take what it sent


def _unacknowledged(sock: socket.socket) -> int:
    """Bytes sent on ``sock`` that the peer has not acknowledged yet (Linux's SIOCOUTQ; 0 where unknown)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0])
    except (OSError, ValueError):
        return 0


def tune(sock: socket.socket) -> None:
    """No Nagle delay, large buffers, non-blocking."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
    sock.setblocking(False)


class TcpTx(TxChannel):
    """Sends to the next rank over a connected socket."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self.bytes_sent = 0

    def send_some(self, data: memoryview) -> int:
        try:
            count = self.sock.send(data)
        except BlockingIOError:
            return 0
        except OSError as e:
            raise PeerLostError(f"lost the connection to {self.peer}: {e.strerror}") from e
        self.bytes_sent += count
        return count

    def wait_fds(self) -> tuple[list[int], list[int]]:
        return [], [self.sock.fileno()]

    def socket_fd(self) -> int | None:
        return self.sock.fileno()

    def close(self) -> None:
        """Close once the peer has every byte sent, waiting at most :data:`CLOSE_FLUSH_S`: a rank that leaves the
        job first must not cut off what its successor still reads (closed with bytes in flight, the successor read
        the stream's end before them, on loopback under load)."""
        deadline = time.monotonic() + CLOSE_FLUSH_S
        while _unacknowledged(self.sock) and time.monotonic() < deadline:
            time.sleep(0.001)
        self.sock.close()


class TcpRx(RxChannel):
    """Receives from the previous rank into a staging buffer that :meth:`peek` exposes."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self._buffer = bytearray(STAGING_BYTES)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0

    def peek(self, limit: int) -> memoryview:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):  # keep a partial element together with what follows
            pending = self._end - self._start
            self._view[:pending] = self._view[self._start:self._end]
            self._start, self._end = 0, pending
        if self._end - self._start < limit:
            self._fill()
        return self._view[self._start:min(self._end, self._start + limit)]

    def consume(self, count: int) -> None:
        self._start += count

    def read_into(self, dst: memoryview) -> int:
        staged = self._end - self._start
        if staged:  # staged bytes first, in order (and no more staging: dst may be longer than the buffer)
            count = min(len(dst), staged)
            dst[:count] = self._view[self._start:self._start + count]
            self._start += count
            return count
        return self._receive(dst)

    def _fill(self) -> None:
        self._end += self._receive(self._view[self._end:])

    def _receive(self, into: memoryview) -> int:
        if not len(into):  # a full buffer: recv_into would return 0, which means a closed connection
            return 0
        try:
            count = self.sock.recv_into(into)
        except BlockingIOError:
            return 0
        except OSError as e:
            raise PeerLostError(f"lost the connection to {self.peer}: {e.strerror}") from e
        if count == 0:
            raise PeerLostError(f"{self.peer} closed its connection (did it exit or crash?)")
        return count

    def wait_fds(self) -> tuple[list[int], list[int]]:
        return [self.sock.fileno()], []

    def ready(self) -> bool:
        """Bytes are staged or waiting in the socket; never touches the stream (other threads may call it)."""
        if self._end > self._start:
            return True
        try:  # a peek, not select (no descriptor past 1024) nor a shared poll object (one thread at a time)
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True  # the read that follows names the error
        return True  # a byte, or the peer's end (an empty peek)

    def socket_fd(self) -> int | None:
        return self.sock.fileno()

    def staged(self) -> int:
        return self._end - self._start

    def close(self) -> None:
        self.sock.close()
