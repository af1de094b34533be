"""What the ranks learn about each other at the rendezvous.

Every rank learns the job's :class:`Layout` (the host of every rank, and every rank's collective settings):
the topology and the hierarchical collectives need it for all ranks, and it is small (run-length encoded,
about one entry per host). Full :class:`Peer` records (pid and data endpoint) travel only to the ranks that
need them: a rank's ring neighbours, its links' partners and rank 0 (a :data:`NeedsPlan` says which), so the
rendezvous sends O(log hosts) records to each rank, not the whole table to everyone.
"""

from __future__ import annotations

import marshal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import astuple, dataclass
from typing import Any, overload

from hvdrun.errors import RendezvousError


@dataclass(frozen=True)
class Peer:
    """Everything about one rank that another rank may need to reach it."""

    rank: int
    hostname: str
    host_key: str
    pid: int
    data_addr: str
    data_port: int
    store_port: int = 0  # rank 0: the TCPStore of the device process group (0: none)
    settings: str = ""  # what must be the same on every rank (the algorithms across hosts), compared after the exchange

    def describe(self) -> str:
        """``rank 3 (host n2, pid 1234)``."""
        return f"rank {self.rank} (host {self.hostname}, pid {self.pid})"


def _runs(values: Sequence[Any]) -> list[tuple[Any, int]]:
    """``[a, a, b]`` as ``[(a, 2), (b, 1)]``."""
    runs: list[tuple[Any, int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1] = (value, runs[-1][1] + 1)
        else:
            runs.append((value, 1))
    return runs


def _expand(runs: Sequence[tuple[Any, int]]) -> list[Any]:
    return [value for value, count in runs for _ in range(count)]


@dataclass(frozen=True)
class Layout:
    """Where every rank runs and which settings it was given (``host_of[rank]`` indexes ``hostnames``)."""

    hostnames: tuple[str, ...]
    host_keys: tuple[str, ...]
    host_of: tuple[int, ...]
    settings: tuple[str, ...]

    @classmethod
    def of(cls, peers: Sequence[Peer]) -> Layout:
        """The layout of ``peers`` (every rank's record, in rank order)."""
        index: dict[str, int] = {}
        names: list[str] = []
        for peer in peers:
            if peer.host_key not in index:
                index[peer.host_key] = len(names)
                names.append(peer.hostname)
        host_of = tuple(index[p.host_key] for p in peers)
        return cls(tuple(names), tuple(index), host_of, tuple(p.settings for p in peers))

    @property
    def size(self) -> int:
        """Number of ranks."""
        return len(self.host_of)

    def rank_host_keys(self) -> list[str]:
        """Every rank's host key, in rank order."""
        return [self.host_keys[h] for h in self.host_of]

    def rank_hostnames(self) -> list[str]:
        """Every rank's host name, in rank order."""
        return [self.hostnames[h] for h in self.host_of]

    def encode(self) -> tuple[Any, ...]:
        """A compact marshal-able form: per-rank fields as runs (contiguous ranks per host: one run per host)."""
        return self.hostnames, self.host_keys, _runs(self.host_of), _runs(self.settings)

    @classmethod
    def decode(cls, data: Sequence[Any]) -> Layout:
        """The inverse of :meth:`encode`."""
        hostnames, host_keys, host_runs, setting_runs = data
        return cls(tuple(hostnames), tuple(host_keys), tuple(_expand(host_runs)), tuple(_expand(setting_runs)))


# Given the job's layout, which ranks' full records a rank needs (rank 0's is always sent).
NeedsPlan = Callable[[Layout], Callable[[int], set[int]]]


def ring_neighbours(layout: Layout) -> Callable[[int], set[int]]:
    """The default plan: a rank needs its ring neighbours' records."""
    size = layout.size
    return lambda rank: {(rank - 1) % size, (rank + 1) % size}


class PeerTable(Sequence[Peer]):
    """The layout of the whole job and the full records this rank was sent, indexed by rank.

    Indexing a rank whose record was not sent raises :class:`RendezvousError` (a plan that left out a rank
    a collective reaches is a bug, named at once rather than a hang).
    """

    def __init__(self, layout: Layout, records: dict[int, Peer]) -> None:
        self.layout, self._records = layout, records
        self._encoded_layout: bytes | None = None  # the same for every rank: marshalled once

    @classmethod
    def decode(cls, layout: bytes, rows: Sequence[Sequence[Any]]) -> PeerTable:
        """From the rendezvous message: the marshalled layout and record rows."""
        records = {peer.rank: peer for peer in (Peer(*row) for row in rows)}
        return cls(Layout.decode(marshal.loads(layout)), records)

    def encode_for(self, ranks: set[int]) -> tuple[bytes, list[tuple[Any, ...]]]:
        """The message for a rank that needs ``ranks`` (rank 0's record is always included); the layout is marshalled
        once for all ranks (at thousands of hosts it is the largest part)."""
        if self._encoded_layout is None:
            self._encoded_layout = marshal.dumps(self.layout.encode())
        return self._encoded_layout, [astuple(self._records[r]) for r in sorted(ranks | {0})]

    def __len__(self) -> int:
        return self.layout.size

    @overload
    def __getitem__(self, rank: int) -> Peer: ...

    @overload
    def __getitem__(self, rank: slice) -> Sequence[Peer]: ...

    def __getitem__(self, rank: int | slice) -> Peer | Sequence[Peer]:
        if isinstance(rank, slice):
            return [self[r] for r in range(self.layout.size)[rank]]
        if rank < 0:
            rank += self.layout.size
        try:
            return self._records[rank]
        except KeyError:
            raise RendezvousError(f"rank {rank}'s record was not sent to this rank (the rendezvous sends only the "
                                  "records a rank's collectives need)") from None

    def __iter__(self) -> Iterator[Peer]:
        return (self[r] for r in range(self.layout.size))

    def known(self) -> list[int]:
        """The ranks whose full records this table holds."""
        return sorted(self._records)
