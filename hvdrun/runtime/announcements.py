"""How a cycle's announcements travel between ranks: all-gathered whole, or merged on the way.

Every rank announces ``(items, waiting)``: its new requests (each its cached number or whole description, with
its data when eager) and the names it is blocked on. Backends that can only all-gather messages carry every
announcement whole to every rank. Across hosts (the native backend's hierarchy) the announcements are *merged*
instead, by recursive doubling: a rank's value is ``({rank: announcement without data}, lone)``, where ``lone``
is ``(request key, data)`` when the rank announced exactly one eager op and is blocked on nothing. Two values
merge by uniting their announcements and, when both carry a lone op with the same key, reducing its data (lower
ranks' first, so every rank ends with the same bits). So the steady state of training (every rank announcing
the same small allreduce) sends log2(hosts) messages of one tensor's size, as MPI's recursive doubling does,
instead of every rank's data to every rank. When the lone ops differ anywhere, the data is dropped and the ops
run as ordinary negotiated allreduces: eager data is used only when every rank announced the same op alone.

The steady state has a compact form of its own (:class:`Uniform`): "ranks lo..hi all announced cached request
number K alone, and here is their data reduced", which travels as a 32-byte header and the raw data (no marshal,
no per-rank entries) and merges with its neighbour range by one reduction. Anything else (another op, a rank
blocked on a name, a request not cached yet) travels in the general form, into which a uniform range expands.
"""

from __future__ import annotations

import marshal
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from hvdrun.runtime.backends.base import Backend
from hvdrun.runtime.negotiation import Request
from hvdrun.runtime.reduce import REDUCE_FNS
from hvdrun.runtime.transport.base import Codec, Message

Announcement = tuple[list[tuple[Any, Message | None]], list[str]]  # (items, names blocked on)


class Agreement:
    """What a cycle's exchange gave every rank alike.

    ``decoded``: every rank's announcement, by rank (without data where they were merged; listed when first read:
    an express cycle that ran never reads them); ``total``: the reduced data of the op that every rank announced
    alone with its data, when announcements were merged.
    """

    __slots__ = ("_listing", "_listed", "total")

    def __init__(self, listing: Callable[[], list[Announcement]], total: Any = None) -> None:
        self._listing, self.total = listing, total
        self._listed: list[Announcement] | None = None

    @property
    def decoded(self) -> list[Announcement]:
        if self._listed is None:
            self._listed = self._listing()
        return self._listed


class Uniform(NamedTuple):
    """Ranks ``lo`` to ``hi`` each announced the cached request number ``key`` alone, with its data; ``data``: their
    data reduced (the steady state of training, see the module docstring)."""

    key: int
    lo: int
    hi: int
    data: Any  # a buffer


_UNIFORM = struct.Struct("<B7xqqq")  # tag 0 (never marshal's first byte), key, lo, hi; the data follows, 8-aligned


def _dumps(value: Any) -> Message:
    if type(value) is Uniform:
        return b"".join((_UNIFORM.pack(0, value.key, value.lo, value.hi), value.data))
    return marshal.dumps(value)


def _loads(message: Message) -> Any:
    if message[0] == 0:
        _, key, lo, hi = _UNIFORM.unpack_from(message)
        return Uniform(key, lo, hi, memoryview(message)[_UNIFORM.size:])
    return marshal.loads(message)


CODEC = Codec(_dumps, _loads)


class Announcements:
    """Exchanges one rank's announcements with every rank (see the module docstring).

    Args:
        backend: carries them; merged when it can (``backend.merges``).
        rank: this rank.
        size: ranks in the job.
        request_of: the request a key stands for (the response cache's decoding).
    """

    def __init__(self, backend: Backend, rank: int, size: int, request_of: Callable[[Any], tuple]) -> None:
        self.backend, self.rank, self.size, self._request_of = backend, rank, size, request_of
        self._layouts: dict[Any, tuple[np.dtype, Callable[..., Any]]] = {}

    def exchange(self, announcement: Announcement) -> Agreement:
        """Every rank's announcement (and the merged data of a lone op every rank announced)."""
        if not self.backend.merges:
            decoded = [marshal.loads(m) for m in self.backend.allgather_messages(marshal.dumps(announcement))]
            return Agreement(lambda: decoded)
        items, waiting = announcement
        lone = items[0] if len(items) == 1 and items[0][1] is not None and not waiting else None
        if lone is not None and type(lone[0]) is int:
            value: Any = Uniform(lone[0], self.rank, self.rank, lone[1])
        else:
            value = ({self.rank: ([(key, None) for key, _ in items], waiting)}, lone)
        merged = self.backend.allgather_merged(value, self._merge, CODEC)
        if type(merged) is Uniform:  # lo 0, hi the last rank
            return Agreement(lambda: [([(merged.key, None)], [])] * self.size, merged.data)
        announced, total = merged
        return Agreement(lambda: [announced[rank] for rank in range(self.size)], total[1] if total else None)

    def _merge(self, lower: Any, upper: Any) -> Any:
        """Two ranges of ranks' values as one (``lower`` holds the lower ranks)."""
        if type(lower) is Uniform and type(upper) is Uniform and lower.key == upper.key and lower.hi + 1 == upper.lo:
            dtype, combine = self._layout(lower.key)
            return Uniform(lower.key, lower.lo, upper.hi,
                           combine(np.frombuffer(lower.data, dtype), np.frombuffer(upper.data, dtype)))
        lower, upper = _general(lower), _general(upper)
        announced = {**lower[0], **upper[0]}
        a, b = lower[1], upper[1]
        if a is None or b is None or a[0] != b[0]:
            return announced, None
        dtype, combine = self._layout(a[0])
        return announced, (a[0], combine(np.frombuffer(a[1], dtype), np.frombuffer(b[1], dtype)))  # marshal: bytes

    def _layout(self, key: Any) -> tuple[np.dtype, Callable[..., Any]]:
        """The dtype and reduction of the request ``key`` stands for, remembered per key."""
        layout = self._layouts.get(key)
        if layout is None:
            request = Request.from_wire(self._request_of(key))
            layout = np.dtype(request.dtype), REDUCE_FNS[request.op]
            if len(self._layouts) >= 4096:
                self._layouts.clear()
            self._layouts[key] = layout
        return layout


def _general(value: Any) -> tuple:
    """``value`` in the general form: ({rank: announcement without data}, lone op or None)."""
    if type(value) is not Uniform:
        return value
    return {rank: ([(value.key, None)], []) for rank in range(value.lo, value.hi + 1)}, (value.key, value.data)
