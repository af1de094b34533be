"""The native backend (``HVDRUN_BACKEND=ring``): hvdrun's own collectives over shared memory and TCP.

Set-up, once per ``init()``: every rank creates its shared-memory receive ring and a TCP
data listener, joins the rendezvous, then connects to the next rank (shared memory when it
is on the same host, authenticated TCP otherwise) and accepts the previous one. A job whose
ranks all share one host also gets the fast lane (:mod:`hvdrun.runtime.lane`).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hvdrun.protocol.sockets import bind_host
from hvdrun.runtime.backends.backend import Backend, World, topology
from hvdrun.runtime.backends.links import LINK, RING, Acceptor, dial, dial_all, shm_link, tcp_link, time_left
from hvdrun.runtime.collectives import Ring
from hvdrun.runtime.collectives.hierarchical import (
    AlgorithmChoice,
    Hierarchy,
    MergedPath,
    check_same_settings,
    grid_of,
    link_partners,
    link_partners_at,
    uneven_hosts_note,
)
from hvdrun.runtime.collectives.pairwise import Link
from hvdrun.runtime.lane import FastLane, create_board, open_lane
from hvdrun.runtime.peers import Layout, NeedsPlan, Peer
from hvdrun.runtime.readiness import readable
from hvdrun.runtime.reduce import ReduceFn
from hvdrun.runtime.rendezvous import Rendezvous
from hvdrun.runtime.transport.channels import (
    MARSHAL,
    AbortFlag,
    Codec,
    Message,
    RxChannel,
    TxChannel,
    Waiter,
    Watchable,
    any_ready,
    spin_seconds,
)
from hvdrun.runtime.transport.posts import PostBoard
from hvdrun.runtime.transport.shm import ShmRx, ShmSegment, ShmTx, shm_supported
from hvdrun.runtime.transport.tcp import TcpRx, TcpTx

SHM_CAPACITY_BYTES = 4 << 20
LINK_CAPACITY_BYTES = 4 << 20


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown-boot"


class NativeBackend(Backend):
    """Collectives on hvdrun's own algorithms (see :mod:`hvdrun.runtime.collectives`): the ring inside one host,
    the hierarchical ones (:class:`Hierarchy`) across hosts that run equal numbers of ranks."""

    name = "ring"
    wakeable = True

    def __init__(self, world: World, ring: Ring, segments: Sequence[ShmSegment], peers: Sequence[Peer] = (),
                 hierarchy: Hierarchy | None = None, links: Sequence[Link] = ()) -> None:
        self.world, self.ring, self._segments, self.peers = world, ring, list(segments), peers
        self.hierarchy, self._links = hierarchy, list(links)
        self.lane: FastLane | None = None  # one-host jobs: blocking small allreduces on a shared board
        # where the first sign of a peer's cycle arrives: the ring, any link of the hierarchy, the host's post board
        # (the engine's thread and a caller's may both sleep on the board's bell: one may drain the other's wake-up,
        # which then sleeps to its timeout, MAX_SLEEP_S in a cycle, as with the rings' bells)
        self._wake: list[Watchable] = [c for c in [ring.rx, *(link.rx for link in self._links)] if c is not None]
        if hierarchy is not None and hierarchy.board is not None:
            self._wake.append(hierarchy.board.arrivals)

    @classmethod
    def connect(cls, rendezvous: Rendezvous, hostname: str, job_key: str, secret: bytes, abort: AbortFlag,
                timeout_s: float, use_shm: bool = True, store_port: int = 0,
                choice: AlgorithmChoice | None = None, wait_policy: str = "auto") -> NativeBackend:
        """Join the rendezvous and build this rank's channels to its ring neighbours (and its hierarchy's links).

        ``store_port`` (rank 0) announces the device process group's store in the table. ``wait_policy``: how waits
        for a peer spend their core (:func:`~hvdrun.runtime.transport.channels.spin_seconds`).
        """
        rank, size = rendezvous.rank, rendezvous.size
        choice = choice or AlgorithmChoice()
        deadline = time.monotonic() + timeout_s
        use_shm = use_shm and shm_supported()
        own = ShmSegment(job_key, rank, SHM_CAPACITY_BYTES, create=True) if use_shm and size > 1 else None
        board = create_board(job_key, rank, size, own is not None)
        listener = acceptor = None
        sockets: dict[int, socket.socket] = {}  # the links across hosts, closed if set-up fails
        channels: list[TxChannel | RxChannel] = []  # the ring's, likewise
        receiving: list[ShmSegment] = []  # this rank's link segments, unlinked once opened
        posts: PostBoard | None = None  # the host's post board (hierarchy with several ranks a host)
        try:
            address = rendezvous.local_address(deadline)  # the data port listens where the others reach us
            listener = socket.create_server((bind_host(address), 0))
            me = Peer(rank, hostname, f"{hostname}/{_boot_id()}", os.getpid(), address, listener.getsockname()[1],
                      store_port, choice.describe())
            peers = rendezvous.exchange(me, max(deadline - time.monotonic(), 0.1), needs_plan(choice))
            check_same_settings(peers.layout.settings)
            host_keys = peers.layout.rank_host_keys()
            world = topology(rank, host_keys, peers.layout.rank_hostnames())
            if size == 1:
                return cls(world, Ring(0, 1, None, None, Waiter(None, abort)), [], peers)
            spin = spin_seconds(wait_policy, world.local_size, os.cpu_count() or 1)
            grid = grid_of(host_keys) if choice.algorithm != "flat" else None
            if rank == 0 and grid is None and choice.algorithm != "flat":
                note = uneven_hosts_note(host_keys, world.hostnames)
                if note is not None:
                    sys.stderr.write(note + "\n")
            partners = link_partners(grid, rank) if grid is not None else set()
            local = {p for p in partners if _over_shm(me, peers[p], own)}
            for p in sorted(local):  # one at a time: those made before a failure are unlinked too
                receiving.append(ShmSegment(job_key, rank, LINK_CAPACITY_BYTES, create=True, sender=p))
            host_ranks = _host_ranks(grid, rank) if own is not None else []
            if len(host_ranks) > 1 and host_ranks[0] == rank:
                posts = PostBoard(job_key, rank, len(host_ranks), 0, create=True)
            acceptor = Acceptor(listener, _expected(me, peers, own, partners - local), secret, deadline, abort)
            tx, rx, segments = _channels(me, peers, own, acceptor, job_key, secret, deadline)
            channels += [tx, rx]
            remote = sorted(partners - local)  # links across hosts: this rank dials the higher ranks, all at once
            sockets.update(dial_all(me, [peers[p] for p in remote if p > rank], secret, LINK, deadline))
            sockets.update(acceptor.take_all(LINK, [peers[p] for p in remote if p < rank]))
            links = {p: tcp_link(sockets[p], peers[p]) for p in remote}
            waiter = Waiter(own.bell if own else None, abort, spin, [segment.bell for segment in receiving])
            ring = Ring(rank, size, tx, rx, waiter)
            lane = open_lane(board, job_key, rank, size, world.local_size, abort, use_shm, own_core=spin > 0)
            rendezvous.barrier(1, deadline)  # every peer has opened our ring (and the board) and made its link segments
            for p, segment in zip(sorted(local), receiving, strict=True):
                links[p], opened = shm_link(job_key, rank, p, segment, LINK_CAPACITY_BYTES)
                segments += [segment, opened]
            if len(host_ranks) > 1 and posts is None:
                posts = PostBoard(job_key, host_ranks[0], len(host_ranks), host_ranks.index(rank), create=False)
            if posts is not None:
                waiter.add_bell(posts.own_bell)
            if grid is not None:
                rendezvous.barrier(2, deadline)  # every peer has opened our link segments: names may go
            hierarchy = Hierarchy.build(grid, rank, links, ring, choice, posts) if grid is not None else None
            backend = cls(world, ring, segments, peers, hierarchy, list(links.values()))
            backend.lane = lane
            return backend
        except BaseException:
            if posts is not None:
                posts.close()
            if acceptor is not None:
                acceptor.close()
            for sock in sockets.values():
                sock.close()
            for channel in channels:
                channel.close()
            raise
        finally:
            if listener is not None:
                listener.close()
            for named in (own, board, posts, *receiving):
                if named is not None:
                    named.unlink()

    @classmethod
    def single(cls, hostname: str, abort: AbortFlag) -> NativeBackend:
        """A world of one rank: every collective is local."""
        return cls(topology(0, [hostname], [hostname]), Ring(0, 1, None, None, Waiter(None, abort)), [])

    def allgather_messages(self, payload: Message) -> list[Message]:
        if self.hierarchy is not None:
            return self.hierarchy.allgather_messages(payload)
        return self.ring.allgather_messages(payload)

    @property
    def merges(self) -> bool:  # type: ignore[override]
        return self.hierarchy is not None

    def allgather_merged(self, value: Any, merge: Callable[[Any, Any], Any], codec: Codec = MARSHAL) -> Any:
        if self.hierarchy is None:
            return super().allgather_merged(value, merge, codec)
        return self.hierarchy.allgather_merged(value, merge, codec)

    def merged_path(self) -> MergedPath | None:
        return self.hierarchy.merged_path() if self.hierarchy is not None else None

    def allreduce(self, array: np.ndarray, reduce: ReduceFn) -> None:
        (self.hierarchy or self.ring).allreduce(array, reduce)

    def reducescatter(self, array: np.ndarray, reduce: ReduceFn, bounds: list[tuple[int, int]]) -> None:
        (self.hierarchy or self.ring).reducescatter(array, reduce, bounds)

    def allgatherv(self, out: memoryview, sizes: Sequence[int]) -> None:
        (self.hierarchy or self.ring).allgatherv(out, sizes)

    def broadcast(self, buffer: memoryview, root: int) -> None:
        (self.hierarchy or self.ring).broadcast(buffer, root)

    def alltoallv(self, send: memoryview, send_sizes: Sequence[int], matrix: Sequence[Sequence[int]],
                  out: memoryview) -> None:
        self.ring.alltoallv(send, send_sizes, matrix, out)

    def peer_waiting(self) -> bool:
        return any_ready(self._wake)

    def idle_wait(self, extra_fds: Sequence[int]) -> None:
        if not self._wake:
            readable(list(extra_fds), 0.001)
            return
        self.ring.waiter.idle(self._wake, extra_read_fds=extra_fds)

    def progressed(self) -> None:
        self.ring.waiter.progressed()

    def wait_for_peer(self, extra_fds: Sequence[int], timeout_s: float) -> None:
        if not self._wake:
            super().wait_for_peer(extra_fds, timeout_s)
            return
        self.ring.waiter.sleep(self._wake, extra_fds, timeout_s)

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
        if self.hierarchy is not None and self.hierarchy.board is not None:
            self.hierarchy.board.close()
        for channel in (self.ring.tx, self.ring.rx, *(c for link in self._links for c in (link.tx, link.rx))):
            if channel is not None:
                channel.close()
        for segment in self._segments:
            segment.close()


def needs_plan(choice: AlgorithmChoice) -> NeedsPlan:
    """The records a rank needs (see :mod:`hvdrun.runtime.peers`): its ring neighbours and, with the hierarchy, its
    links' partners; computed by rank 0 for every rank from the layout, as each rank computes its own."""
    def plan(layout: Layout) -> Callable[[int], set[int]]:
        size = layout.size
        grid = grid_of(layout.rank_host_keys()) if choice.algorithm != "flat" else None
        where = {rank: (host, local) for host, ranks in enumerate(grid or []) for local, rank in enumerate(ranks)}

        def needs(rank: int) -> set[int]:
            ring = {(rank - 1) % size, (rank + 1) % size}
            return ring | link_partners_at(grid, *where[rank]) if grid is not None else ring
        return needs
    return plan


def _expected(me: Peer, peers: Sequence[Peer], own: ShmSegment | None, tcp_partners: set[int]) -> set[tuple[str, int]]:
    """The connections this rank accepts: its ring's previous rank over TCP, and the lower-ranked TCP links."""
    prev = peers[(me.rank - 1) % len(peers)]
    expected = {(LINK, p) for p in tcp_partners if p < me.rank}
    if not _over_shm(me, prev, own):
        expected.add((RING, prev.rank))
    return expected


def _host_ranks(grid: list[list[int]] | None, rank: int) -> list[int]:
    """The ranks of ``rank``'s host in the hierarchy's grid (none without one)."""
    return next((ranks for ranks in grid or [] if rank in ranks), [])


def _over_shm(me: Peer, peer: Peer, own: ShmSegment | None) -> bool:
    """Whether this rank talks to ``peer`` through shared memory (same host, and this rank has its segment)."""
    return own is not None and peer.host_key == me.host_key


def _channels(me: Peer, peers: Sequence[Peer], own: ShmSegment | None, acceptor: Acceptor, job_key: str,
              secret: bytes, deadline: float) -> tuple[TxChannel, RxChannel, list[ShmSegment]]:
    size = len(peers)
    nxt, prev = peers[(me.rank + 1) % size], peers[(me.rank - 1) % size]
    segments: list[ShmSegment] = [own] if own is not None else []
    opened: dict[int, ShmSegment] = {}

    def segment_of(peer: Peer) -> ShmSegment:
        if peer.rank not in opened:
            opened[peer.rank] = ShmSegment(job_key, peer.rank, SHM_CAPACITY_BYTES, create=False)
            segments.append(opened[peer.rank])
        return opened[peer.rank]

    if _over_shm(me, nxt, own):
        assert own is not None
        tx: TxChannel = ShmTx(segment_of(nxt), own.bell_fd)
    else:
        tx = TcpTx(dial(me, nxt, secret, RING, time_left(deadline)), nxt.describe())
    try:
        if _over_shm(me, prev, own):
            assert own is not None
            rx: RxChannel = ShmRx(own, segment_of(prev).bell)
        else:
            rx = TcpRx(acceptor.take(RING, prev), prev.describe())
    except BaseException:
        if isinstance(tx, TcpTx):  # its socket: nobody else holds it yet
            tx.close()
        raise
    return tx, rx, segments
