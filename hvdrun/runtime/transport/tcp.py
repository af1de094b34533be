"""TCP channels between ranks on different hosts (non-blocking sockets)."""

from __future__ import annotations

import socket

from hvdrun.errors import PeerLostError
from hvdrun.runtime.transport.channels import RxChannel, TxChannel

STAGING_BYTES = 4 << 20
SOCKET_BUFFER_BYTES = 4 << 20


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
        self.sock.close()


class TcpRx(RxChannel):
    """Receives from the previous rank into a staging buffer that :meth:`peek` exposes.

    The end of the stream (or its failure) is raised only once every byte staged before it has been taken: a peer
    that sends its last frames and leaves at once (the shutdown's last cycle) must not take them with it."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self._buffer = bytearray(STAGING_BYTES)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0
        self._ended: PeerLostError | None = None  # the stream's end, met while bytes were still staged

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
        try:
            self._end += self._receive(self._view[self._end:])
        except PeerLostError as e:
            if self._end == self._start:
                raise
            self._ended = e  # raised once the staged bytes are taken

    def _receive(self, into: memoryview) -> int:
        if not len(into):  # a full buffer: recv_into would return 0, which means a closed connection
            return 0
        if self._ended is not None:
            raise self._ended
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
