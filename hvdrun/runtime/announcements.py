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
"""

from __future__ import annotations

import marshal
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from hvdrun.runtime.backends.base import Backend
from hvdrun.runtime.negotiation import Request
from hvdrun.runtime.reduce import REDUCE_FNS, as_bytes
from hvdrun.runtime.transport.base import Message

Announcement = tuple[list[tuple[Any, Message | None]], list[str]]  # (items, names blocked on)


class Agreement(NamedTuple):
    """What a cycle's exchange gave every rank alike.

    ``decoded``: every rank's announcement, by rank (without data where they were merged); ``total``: the
    reduced data of the op that every rank announced alone with its data, when announcements were merged.
    """

    decoded: list[Announcement]
    total: Message | None


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
            messages = self.backend.allgather_messages(marshal.dumps(announcement))
            return Agreement([marshal.loads(m) for m in messages], None)
        items, waiting = announcement
        lone = items[0] if len(items) == 1 and items[0][1] is not None and not waiting else None
        value = ({self.rank: ([(key, None) for key, _ in items], waiting)}, lone)
        merged, total = self.backend.allgather_merged(value, self._merge)
        return Agreement([merged[rank] for rank in range(self.size)], total[1] if total is not None else None)

    def _merge(self, lower: tuple, upper: tuple) -> tuple:
        """Two ranges of ranks' values as one (``lower`` holds the lower ranks)."""
        announced = {**lower[0], **upper[0]}
        a, b = lower[1], upper[1]
        if a is None or b is None or a[0] != b[0]:
            return announced, None
        dtype, combine = self._layout(a[0])
        mine = np.frombuffer(a[1], dtype)
        out = np.empty_like(mine)
        combine(mine, np.frombuffer(b[1], dtype), out)
        return announced, (a[0], as_bytes(out))

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
