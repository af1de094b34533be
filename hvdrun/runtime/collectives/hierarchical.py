"""Collectives across hosts: shared memory inside a host, only what must cross between hosts.

The job is a grid: ``grid[h][l]`` is the rank with local rank ``l`` on host ``h`` (every host has
the same number ``L`` of ranks; otherwise the job keeps the flat ring). A rank belongs to two groups:
its host's ``L`` ranks (a ring over shared memory) and the ``H`` ranks of its local rank across
hosts (a ring and a :class:`~hvdrun.runtime.collectives.pairwise.Pairwise` group over TCP).

- allreduce: reduce-scatter inside the host (local rank l owns 1/L of the buffer), an allreduce of
  that part among the l-th ranks of every host (L exchanges in parallel, as NCCL runs one ring per
  channel), all-gather inside the host. A host's link carries about 2 (H - 1) / H of the buffer.
  Across hosts: recursive doubling for small parts, Rabenseifner for medium ones, the ring for large.
  Inside the host, a buffer that fits a post takes the host's post board: two rounds (every rank posts its
  buffer and reduces its part from the L posts; later posts its reduced part and copies the others'), where
  the host's ring takes 2 (L - 1) steps in a row; larger buffers take the ring, whose steps overlap.
- allgather / reducescatter: the same two levels, each rank's block crossing hosts once.
- broadcast: the root's local rank across hosts (a binomial tree, or the ring for large buffers),
  then a ring inside each host.
- negotiation (every rank's message): all-gather inside the host, then recursive doubling of the
  hosts' bundles: L - 1 + log2(H) steps, not N - 1. Merged negotiation (every cycle's announcements, see
  :mod:`hvdrun.runtime.announcements`) takes the host's post board inside the host: one post and one wait
  (:mod:`hvdrun.runtime.transport.posts`); then, where there are several hosts, the host's leader (local rank 0)
  alone runs log2(H) steps across hosts, so that a host's link carries one copy of each step's value, not L, and
  posts the job's value in a second round of the board, where the others read it.
"""

from __future__ import annotations

import functools
import marshal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from hvdrun import envvars
from hvdrun.errors import UsageError
from hvdrun.ranks import format_ranks
from hvdrun.runtime import compiled
from hvdrun.runtime.collectives.pairwise import Link, Pairwise, partners
from hvdrun.runtime.collectives.ring import Ring
from hvdrun.runtime.reduce import ReduceFn, as_bytes, chunk_bounds
from hvdrun.runtime.transport.channels import MARSHAL, MAX_SLEEP_S, Codec, Message
from hvdrun.runtime.transport.posts import SLOT_BYTES, PostBoard

DEFAULT_DOUBLING_MAX_BYTES = 64 << 10
DEFAULT_HALVING_MAX_BYTES = 4 << 20
BROADCAST_TREE_MAX_BYTES = 256 << 10


@dataclass(frozen=True)
class AlgorithmChoice:
    """Which algorithm crosses hosts (``HVDRUN_ALGORITHM``), and the sizes where ``auto`` switches.

    Args:
        algorithm: ``auto`` (by size), ``flat`` (one ring through every rank, no hierarchy), or one of
            ``ring``, ``doubling``, ``halving`` for every size.
        doubling_max_bytes: ``auto`` uses recursive doubling up to this buffer size.
        halving_max_bytes: ``auto`` uses Rabenseifner up to this size, the ring above it.
    """

    algorithm: str = "auto"
    doubling_max_bytes: int = DEFAULT_DOUBLING_MAX_BYTES
    halving_max_bytes: int = DEFAULT_HALVING_MAX_BYTES

    def describe(self) -> str:
        """The settings as the variables that set them (every rank must have the same)."""
        return (f"{envvars.ALGORITHM[0]}={self.algorithm} {envvars.DOUBLING_MAX_BYTES[0]}={self.doubling_max_bytes} "
                f"{envvars.HALVING_MAX_BYTES[0]}={self.halving_max_bytes}")

    def across_hosts(self, nbytes: int, hosts: int = 2) -> str:
        """``ring``, ``doubling`` or ``halving`` for an allreduce of ``nbytes`` among ``hosts``: the ring's
        2 (hosts - 1) steps pay off only for buffers that grow with the hosts, so Rabenseifner runs up to
        ``halving_max_bytes`` x hosts / 8 (measured on 2, 4 and 8 hosts over loopback and veth:
        benchmarks/results/crossover-after-scratch.txt, multihost-final-*.md; the model in docs/scaling.md)."""
        if self.algorithm != "auto":
            return self.algorithm
        if nbytes <= self.doubling_max_bytes:
            return "doubling"
        return "halving" if nbytes * 8 <= self.halving_max_bytes * hosts else "ring"


def _ranks_by(values: Sequence[str]) -> dict[str, list[int]]:
    """The ranks of each value (``values[rank]``), values in order of their first rank."""
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(rank)
    return ranks


def check_same_settings(settings: Sequence[str]) -> None:
    """Raise UsageError, alike on every rank, when ranks were given different algorithm settings (they would
    pick different algorithms and wait for each other forever)."""
    groups = _ranks_by(settings)
    if len(groups) <= 1:
        return
    parts = "; ".join(f"rank{'s' if len(r) > 1 else ''} {format_ranks(r)}: {value or '(none)'}"
                      for value, r in groups.items())
    raise UsageError(f"ranks were given different collective settings ({parts}); set them alike for every rank "
                     "(hvdrun -x passes a variable to all)")


def grid_of(host_keys: Sequence[str]) -> list[list[int]] | None:
    """``grid[h][l]``: the rank of local rank l on host h (hosts in order of their first rank); None when the
    hosts run different numbers of ranks or there is one host (the flat ring serves those jobs)."""
    grid = list(_ranks_by(host_keys).values())
    if len(grid) < 2 or len({len(ranks) for ranks in grid}) != 1:
        return None
    return grid


def uneven_hosts_note(host_keys: Sequence[str], hostnames: Sequence[str]) -> str | None:
    """The one line rank 0 prints when hosts run different numbers of ranks (the hierarchy needs equal ones),
    saying how to get faster collectives; None when there is nothing to say."""
    hosts = list(_ranks_by(host_keys).values())
    if len(hosts) < 2 or len({len(ranks) for ranks in hosts}) == 1:
        return None
    shown = ", ".join(f"{hostnames[ranks[0]]}: {len(ranks)}" for ranks in hosts[:6])
    return (f"hvdrun: note: hosts run different numbers of ranks ({shown}{', ...' if len(hosts) > 6 else ''}), so "
            "collectives across hosts take one ring through every rank; give every host the same number of ranks "
            "for the hierarchical ones, or run with --launcher mpiexec (MPI's collectives)")


def position(grid: list[list[int]], rank: int) -> tuple[int, int]:
    """(host, local rank) of ``rank`` in ``grid``."""
    for host, ranks in enumerate(grid):
        if rank in ranks:
            return host, ranks.index(rank)
    raise ValueError(f"rank {rank} is not in the grid")


def link_partners(grid: list[list[int]], rank: int) -> set[int]:
    """Every rank that ``rank`` needs a link to: its host's ring neighbours, its local rank's ring neighbours
    across hosts, and its recursive-doubling partners there."""
    found = link_partners_at(grid, *position(grid, rank))
    found.discard(rank)
    return found


def link_partners_at(grid: list[list[int]], host: int, local: int) -> set[int]:
    """:func:`link_partners` of the rank at ``(host, local)`` (which it may contain)."""
    hosts, locals_ = len(grid), len(grid[0])
    if locals_ == 1:  # the job's own ring is the ring across hosts; with 2 hosts it is the doubling partner too
        found = {grid[member][0] for member in partners(host, hosts)} if hosts > 2 else set()
    else:
        found = {grid[host][(local + 1) % locals_], grid[host][(local - 1) % locals_],
                 grid[(host + 1) % hosts][local], grid[(host - 1) % hosts][local]}
        found |= {grid[member][local] for member in partners(host, hosts)}
    return found


class MergedPath(NamedTuple):
    """:meth:`Hierarchy.allgather_merged`'s way, for a caller that runs its steps itself: the doubling across hosts,
    the host's post board (None: one rank a host), this rank's place on it, the host's first rank (its ranks are
    consecutive), and the hierarchy (whose :meth:`~Hierarchy.merge_posted` goes on from the board)."""

    cross: Pairwise
    board: PostBoard | None
    member: int
    first_rank: int
    hierarchy: Hierarchy | None


class Hierarchy:
    """The two-level collectives of one rank (see the module docstring).

    Args:
        grid: ``grid[h][l]``, from :func:`grid_of`.
        rank: this rank.
        local: the ring of this rank's host (member index = local rank).
        cross_ring: the ring of this rank's local rank across hosts (member index = host).
        cross: the pairwise group of the same ranks.
        choice: the algorithm settings.
        board: the host's post board (None: merged exchanges take the host's ring).
    """

    def __init__(self, grid: list[list[int]], rank: int, local: Ring, cross_ring: Ring, cross: Pairwise,
                 choice: AlgorithmChoice, board: PostBoard | None = None) -> None:
        self.grid, self.local, self.cross_ring, self.cross, self.choice = grid, local, cross_ring, cross, choice
        self.board = board
        self.host, self.local_rank = position(grid, rank)
        self.hosts, self.locals = len(grid), len(grid[0])

    @classmethod
    def build(cls, grid: list[list[int]], rank: int, links: dict[int, Link], ring: Ring,
              choice: AlgorithmChoice, board: PostBoard | None = None) -> Hierarchy:
        """The groups of ``rank`` over ``links`` (rank -> link, for every rank of :func:`link_partners`) and the
        job's ring (``ring``: with one rank per host it is the ring across hosts, and links it has need none);
        ``board``: the host's post board, if it has one."""
        host, local = position(grid, rank)
        hosts, locals_ = len(grid), len(grid[0])
        waiter = ring.waiter
        if locals_ == 1:
            links = {**links, **{p: Link(ring.tx, ring.rx) for p in (grid[(host + 1) % hosts][0],)
                                 if hosts == 2 and ring.tx is not None and ring.rx is not None}}
            local_ring, cross_ring = Ring(0, 1, None, None, waiter), ring
        else:
            local_ring = Ring(local, locals_, links[grid[host][(local + 1) % locals_]].tx,
                              links[grid[host][(local - 1) % locals_]].rx, waiter)
            cross_ring = Ring(host, hosts, links[grid[(host + 1) % hosts][local]].tx,
                              links[grid[(host - 1) % hosts][local]].rx, waiter)
        cross = Pairwise(host, hosts, {member: links[grid[member][local]] for member in partners(host, hosts)}, waiter,
                         compiled.runner())
        return cls(grid, rank, local_ring, cross_ring, cross, choice, board)

    def allreduce(self, array: np.ndarray, reduce: ReduceFn) -> None:
        """Reduce the contiguous ``array`` in place across every rank."""
        flat = array.reshape(-1)
        if not flat.size:
            return
        bounds = chunk_bounds(flat.size, self.locals)
        if self.board is not None and flat.nbytes <= SLOT_BYTES:
            self._allreduce_on_board(flat, reduce, bounds)
            return
        self.local.reduce_scatter(flat, reduce, bounds, shift=0)  # local rank l owns chunk l + 1
        start, stop = self._owned(bounds, self.local_rank)
        self._allreduce_across_hosts(flat[start:stop], reduce, flat.nbytes)
        self.local.all_gather_chunks(flat, bounds)

    def _owned(self, bounds: list[tuple[int, int]], local: int) -> tuple[int, int]:
        """The chunk local rank ``local`` reduces and carries across hosts: ``l + 1``, where the host's ring
        reduce-scatter (shift 0) leaves it."""
        return bounds[(local + 1) % self.locals]

    def _allreduce_across_hosts(self, part: np.ndarray, reduce: ReduceFn, nbytes: int) -> None:
        """Allreduce this rank's ``part`` of an ``nbytes`` buffer among its local rank's ranks on every host."""
        algorithm = self.choice.across_hosts(nbytes, self.hosts)
        if algorithm == "doubling":
            self.cross.allreduce_doubling(part, reduce)
        elif algorithm == "halving":
            self.cross.allreduce_halving(part, reduce)
        else:
            self.cross_ring.allreduce(part, reduce)

    def _allreduce_on_board(self, flat: np.ndarray, reduce: ReduceFn, bounds: list[tuple[int, int]]) -> None:
        """:meth:`allreduce` with the host's post board inside the host: every rank posts its buffer and reduces
        its part from the L posts in place; the part crosses hosts; every rank posts its reduced part and copies
        the others'. Two rounds of the board, each one post and one wait. Each rank owns the part the ring's
        reduce-scatter leaves it, so a host without a board (no shared memory) crosses with the same part."""
        me, dtype = self.local_rank, flat.dtype
        start, stop = self._owned(bounds, me)
        part = flat[start:stop]
        for member, post in enumerate(self._post_and_wait(as_bytes(flat))):
            if member != me and stop > start:
                reduce(part, np.frombuffer(post, dtype, stop - start, start * dtype.itemsize), out=part)
        self._allreduce_across_hosts(part, reduce, flat.nbytes)
        for member, post in enumerate(self._post_and_wait(as_bytes(part))):
            first, last = self._owned(bounds, member)
            if member != me and last > first:
                flat[first:last] = np.frombuffer(post, dtype, last - first)

    def reducescatter(self, array: np.ndarray, reduce: ReduceFn, bounds: list[tuple[int, int]]) -> None:
        """Reduce in place; afterwards this rank's chunk (element ``bounds[rank]``) is reduced over every rank."""
        flat = array.reshape(-1)
        self.local.reduce_scatter_blocks(flat, [[bounds[ranks[local]] for ranks in self.grid]
                                                for local in range(self.locals)], reduce)
        self.cross_ring.reduce_scatter_blocks(flat, [[bounds[ranks[self.local_rank]]] for ranks in self.grid],
                                              reduce)

    def allgatherv(self, out: memoryview, sizes: Sequence[int]) -> None:
        """``out`` holds this rank's block at its offset; fill in every other rank's block (byte sizes)."""
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()

        def block(rank: int) -> memoryview:
            return out[offsets[rank]:offsets[rank + 1]]

        self.cross_ring.allgather_blocks([[block(ranks[self.local_rank])] for ranks in self.grid])
        self.local.allgather_blocks([[block(ranks[local]) for ranks in self.grid] for local in range(self.locals)])

    def broadcast(self, buffer: memoryview, root: int) -> None:
        """Copy ``root``'s buffer to every rank: across hosts among the root's local rank, then inside hosts."""
        if not len(buffer):
            return
        root_host, root_local = position(self.grid, root)
        if self.local_rank == root_local:
            if len(buffer) <= BROADCAST_TREE_MAX_BYTES:
                self.cross.broadcast(buffer, root_host)
            else:
                self.cross_ring.broadcast(buffer, root_host)
        self.local.broadcast(buffer, root_local)

    def allgather_messages(self, payload: Message) -> list[Message]:
        """Every rank's ``payload``, indexed by rank."""
        if self.locals == 1:  # ranks are hosts, in order
            return self.cross.allgather_messages(payload)
        bundles = self.cross.allgather_messages(marshal.dumps(self.local.allgather_messages(payload)))
        messages: list[Message] = [b""] * (self.hosts * self.locals)
        for ranks, bundle in zip(self.grid, bundles, strict=True):
            for rank, message in zip(ranks, marshal.loads(bundle), strict=True):
                messages[rank] = message
        return messages

    def allgather_merged(self, value: Any, merge: Callable[[Any, Any], Any], codec: Codec = MARSHAL) -> Any:
        """Every rank's ``value`` merged in rank order (``merge(lower, upper)``): inside the host (all-gathered
        over shared memory, merged in local order), then across hosts by recursive doubling among the hosts'
        leaders, whose result the others read from the board."""
        if self.locals == 1:
            return self.cross.allgather_merged(value, merge, codec)
        message = codec.dumps(value)
        if self.board is not None:
            self._post_and_wait(message)
        return self.merge_posted(value, message, merge, codec)

    def merge_posted(self, value: Any, message: Message, merge: Callable[[Any, Any], Any], codec: Codec) -> Any:
        """:meth:`allgather_merged` once this rank posted ``value`` (as ``message``) on the board and every local
        rank posted this round (the compiled module may have posted it; without a board, nothing was posted)."""
        reads = self.hosts == 1 or self.local_rank == 0  # else the leader merges and crosses; this rank reads it
        messages = self._round_messages(message, copied=reads)
        if not reads:
            return self.shared_result(None, codec)
        values = [value if local == self.local_rank else codec.loads(m) for local, m in enumerate(messages)]
        merged = functools.reduce(merge, values)
        if self.hosts == 1:  # nothing to cross: every rank has the job's value
            return merged
        return self.shared_result(self.cross.allgather_merged(merged, merge, codec), codec)

    def shared_result(self, result: Any, codec: Codec) -> Any:
        """The leader's ``result`` of a merged exchange, on every rank of the host: the leader posts it, the
        others an empty message, in one round of the board (the host's ring where there is no board or it does
        not fit); the others' ``result`` is ignored."""
        leads = self.local_rank == 0
        message = codec.dumps(result) if leads else b""
        if self.board is not None:
            self._post_and_wait(message)
        messages = self._round_messages(message, copied=not leads)
        return result if leads else codec.loads(messages[0])

    def posted_result(self, codec: Codec) -> Any:
        """The leader's result of this rank's current round, which this rank already posted (the compiled module
        did) and every rank of the host posted."""
        return codec.loads(self._round_messages(b"", copied=True)[0])

    def _round_messages(self, own: Message, copied: bool) -> list[Message]:
        """Every local rank's message of this round, by local rank: the board's posts (copied, or none where this
        rank has no use for them: ``copied`` False); without a board, or where a message did not fit its post
        (every rank of the host sees which), all of them through the host's ring, this rank's being ``own``."""
        board = self.board
        if board is not None and board.all_fit():
            return board.copies(own) if copied else []
        return self.local.allgather_messages(own)

    def merged_path(self) -> MergedPath | None:
        """How :meth:`allgather_merged` goes, for a caller that runs its steps itself (the compiled module); None
        where it cannot: ranks of a host that share no board, or whose ranks are not consecutive."""
        ranks = self.grid[self.host]
        if self.locals > 1 and (self.board is None or ranks != list(range(ranks[0], ranks[0] + self.locals))):
            return None
        return MergedPath(self.cross, self.board if self.locals > 1 else None, self.local_rank, ranks[0], self)

    def wait_posted(self) -> None:
        """Sleep until every local rank posted this rank's round of the board (posted already)."""
        board, waiter = self.board, self.local.waiter
        assert board is not None
        while not board.posted():
            waiter.sleep((board.complete,), (), MAX_SLEEP_S)
        waiter.progressed()

    def _post_and_wait(self, message: Message) -> list[memoryview]:
        """Post ``message`` in the board's next round and wait until every local rank posted it: their posts, in
        place (valid until this rank posts again)."""
        board, waiter = self.board, self.local.waiter
        assert board is not None
        board.post(message)
        waiter.progressed()  # spin first: an idle engine's old idle time must not send this wait straight to sleep
        while not board.posted():
            waiter.idle((board.complete,))
        waiter.progressed()
        return board.views()
