"""The native backend (``HVDRUN_BACKEND=ring``): hvdrun's own collectives over shared memory and TCP.

Set-up, once per ``init()``: every rank creates its shared-memory receive ring and a TCP
data listener, joins the rendezvous, then connects to the next rank (shared memory when it
is on the same host, authenticated TCP otherwise) and accepts the previous one. A job whose
ranks all share one host also gets the fast lane (:mod:`hvdrun.runtime.lane`).
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hvdrun.errors import RendezvousError
from hvdrun.runtime.backends.base import Backend, World, topology
from hvdrun.runtime.collectives import Ring
from hvdrun.runtime.lane import FastLane, create_board, open_lane
from hvdrun.runtime.reduce import ReduceFn
from hvdrun.runtime.rendezvous import Peer, Rendezvous, bind_host
from hvdrun.runtime.transport.base import DEFAULT_SPIN_S, AbortFlag, RxChannel, TxChannel, Waiter
from hvdrun.runtime.transport.shm import ShmRx, ShmSegment, ShmTx, shm_supported
from hvdrun.runtime.transport.tcp import TcpRx, TcpTx, tune
from hvdrun.runtime.wire import AuthError, authenticate_client, authenticate_server, recv_frame, send_frame

SHM_CAPACITY_BYTES = 4 << 20
_CONNECT_TIMEOUT_S = 30.0


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown-boot"


class NativeBackend(Backend):
    """Collectives on hvdrun's own algorithms (see :mod:`hvdrun.runtime.collectives`)."""

    name = "ring"
    wakeable = True

    def __init__(self, world: World, ring: Ring, segments: Sequence[ShmSegment], peers: Sequence[Peer] = ()) -> None:
        self.world, self.ring, self._segments, self.peers = world, ring, list(segments), list(peers)
        self.lane: FastLane | None = None  # one-host jobs: blocking small allreduces on a shared board

    @classmethod
    def connect(cls, rendezvous: Rendezvous, hostname: str, job_key: str, secret: bytes, abort: AbortFlag,
                timeout_s: float, use_shm: bool = True, store_port: int = 0) -> NativeBackend:
        """Join the rendezvous and build this rank's channels to its ring neighbours.

        ``store_port`` (rank 0) announces the device process group's store in the table.
        """
        rank, size = rendezvous.rank, rendezvous.size
        deadline = time.monotonic() + timeout_s
        use_shm = use_shm and shm_supported()
        own = ShmSegment(job_key, rank, SHM_CAPACITY_BYTES, create=True) if use_shm and size > 1 else None
        board = create_board(job_key, rank, size, own is not None)
        listener = None
        try:
            address = rendezvous.local_address(deadline)  # the data port listens where the others reach us
            listener = socket.create_server((bind_host(address), 0))
            me = Peer(rank, hostname, f"{hostname}/{_boot_id()}", os.getpid(), address, listener.getsockname()[1],
                      store_port)
            peers = rendezvous.exchange(me, max(deadline - time.monotonic(), 0.1))
            world = topology(rank, [p.host_key for p in peers], [p.hostname for p in peers])
            if size == 1:
                return cls(world, Ring(0, 1, None, None, Waiter(None, abort)), [], peers)
            spin = DEFAULT_SPIN_S if world.local_size <= (os.cpu_count() or 1) else 0.0
            tx, rx, segments = _channels(me, peers, own, listener, job_key, secret)
            ring = Ring(rank, size, tx, rx, Waiter(own.bell if own else None, abort, spin))
            lane = open_lane(board, job_key, rank, size, world.local_size, abort, use_shm, own_core=spin > 0)
            ring.allgather_messages(b"")  # every peer has opened our ring (and the board): names may go
            backend = cls(world, ring, segments, peers)
            backend.lane = lane
            return backend
        finally:
            if listener is not None:
                listener.close()
            if own is not None:
                own.unlink()
            if board is not None:
                board.unlink()

    @classmethod
    def single(cls, hostname: str, abort: AbortFlag) -> NativeBackend:
        """A world of one rank: every collective is local."""
        return cls(topology(0, [hostname], [hostname]), Ring(0, 1, None, None, Waiter(None, abort)), [])

    def allgather_messages(self, payload: bytes) -> list[bytes]:
        return self.ring.allgather_messages(payload)

    def allreduce(self, array: np.ndarray, reduce: ReduceFn) -> None:
        self.ring.allreduce(array, reduce)

    def reducescatter(self, array: np.ndarray, reduce: ReduceFn, bounds: list[tuple[int, int]]) -> None:
        self.ring.reducescatter(array, reduce, bounds)

    def allgatherv(self, out: memoryview, sizes: Sequence[int]) -> None:
        self.ring.allgatherv(out, sizes)

    def broadcast(self, buffer: memoryview, root: int) -> None:
        self.ring.broadcast(buffer, root)

    def alltoallv(self, send: memoryview, send_sizes: Sequence[int], matrix: Sequence[Sequence[int]],
                  out: memoryview) -> None:
        self.ring.alltoallv(send, send_sizes, matrix, out)

    def peer_waiting(self) -> bool:
        return self.ring.rx is not None and self.ring.rx.ready()

    def idle_wait(self, extra_fds: Sequence[int]) -> None:
        if self.ring.rx is None:
            select.select(list(extra_fds), [], [], 0.001)
            return
        self.ring.waiter.idle([self.ring.rx], extra_read_fds=extra_fds)

    def progressed(self) -> None:
        self.ring.waiter.progressed()

    def wait_for_peer(self, extra_fds: Sequence[int], timeout_s: float) -> None:
        if self.ring.rx is None:
            super().wait_for_peer(extra_fds, timeout_s)
            return
        self.ring.waiter.sleep([self.ring.rx], extra_fds, timeout_s)

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
        for channel in (self.ring.tx, self.ring.rx):
            if channel is not None:
                channel.close()
        for segment in self._segments:
            segment.close()


def _channels(me: Peer, peers: Sequence[Peer], own: ShmSegment | None, listener: socket.socket, job_key: str,
              secret: bytes) -> tuple[TxChannel, RxChannel, list[ShmSegment]]:
    size = len(peers)
    nxt, prev = peers[(me.rank + 1) % size], peers[(me.rank - 1) % size]
    segments: list[ShmSegment] = [own] if own is not None else []
    opened: dict[int, ShmSegment] = {}

    def segment_of(peer: Peer) -> ShmSegment:
        if peer.rank not in opened:
            opened[peer.rank] = ShmSegment(job_key, peer.rank, SHM_CAPACITY_BYTES, create=False)
            segments.append(opened[peer.rank])
        return opened[peer.rank]

    accepted: dict[str, object] = {}
    acceptor = None
    if prev.host_key != me.host_key or own is None:
        acceptor = threading.Thread(target=_accept_prev, args=(listener, prev, secret, accepted), name="hvdrun-accept",
                                    daemon=True)
        acceptor.start()
    if nxt.host_key == me.host_key and own is not None:
        tx: TxChannel = ShmTx(segment_of(nxt), own.bell_fd)
    else:
        tx = TcpTx(_connect_next(me, nxt, secret), nxt.describe())
    if acceptor is None:
        assert own is not None
        rx: RxChannel = ShmRx(own, segment_of(prev).bell)
    else:
        acceptor.join(_CONNECT_TIMEOUT_S + 1)
        if "sock" not in accepted:
            raise RendezvousError(f"{prev.describe()} did not connect to this rank's data port: "
                                  f"{accepted.get('error')}")
        rx = TcpRx(accepted["sock"], prev.describe())  # type: ignore[arg-type]
    return tx, rx, segments


def _connect_next(me: Peer, nxt: Peer, secret: bytes) -> socket.socket:
    try:
        sock = socket.create_connection((nxt.data_addr, nxt.data_port), timeout=_CONNECT_TIMEOUT_S)
        authenticate_server(sock, secret, nxt.describe())
        send_frame(sock, me.rank)
    except OSError as e:
        raise RendezvousError(f"cannot connect to {nxt.describe()} at {nxt.data_addr}:{nxt.data_port}: {e}") from e
    tune(sock)
    return sock


def _accept_prev(listener: socket.socket, prev: Peer, secret: bytes, result: dict[str, object]) -> None:
    listener.settimeout(_CONNECT_TIMEOUT_S)
    deadline = time.monotonic() + _CONNECT_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            sock, _ = listener.accept()
            sock.settimeout(_CONNECT_TIMEOUT_S)
            authenticate_client(sock, secret)
            if recv_frame(sock) != prev.rank:
                sock.close()
                continue
        except (OSError, ConnectionError, ValueError, EOFError, AuthError) as e:
            result["error"] = str(e)
            continue
        tune(sock)
        result["sock"] = sock
        return
