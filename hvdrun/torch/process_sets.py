"""Process sets: collectives restricted to a subset of the ranks.

Sets are registered collectively (every rank calls ``add_process_set`` with the same ranks, in the
same order), so every rank assigns the same id. An op on a set completes when its members asked
for it; ranks outside the set take part in the transfer with the op's neutral element, which
keeps hvdrun's single ring (see ``hvdrun.runtime.executors.stand_in``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from hvdrun.runtime import context
from hvdrun.runtime.negotiation import GLOBAL_SET, Request

_requests = itertools.count(1)


class ProcessSet:
    """A set of global ranks that a collective is restricted to (Horovod's ``hvd.ProcessSet``)."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self._ranks = sorted(int(r) for r in ranks) if ranks is not None else None
        self.process_set_id: int | None = GLOBAL_SET if ranks is None else None

    @property
    def ranks(self) -> list[int]:
        """The global ranks of the set (every rank for the global set)."""
        return self._ranks if self._ranks is not None else list(range(context.current().world.size))

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self.ranks)

    def rank(self) -> int:
        """This rank's index within the set."""
        return self.ranks.index(context.current().world.rank)

    def included(self) -> bool:
        """True when this rank belongs to the set."""
        return context.current().world.rank in self.ranks

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self._ranks is None else f"ProcessSet({self._ranks}, id={self.process_set_id})"


global_process_set = ProcessSet()


def set_size(process_set: ProcessSet | None) -> int:
    """Number of ranks in ``process_set`` (the global set for None)."""
    return (process_set or global_process_set).size()


def set_id(process_set: Any) -> int:
    """The registered id of ``process_set`` (the global set for None); refuses unregistered sets and outsiders."""
    if process_set is None or process_set is global_process_set:
        return GLOBAL_SET
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be an hvd.ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not registered: call hvd.add_process_set() on every rank first")
    if not process_set.included():
        raise ValueError(f"rank {context.current().world.rank} is not in {process_set!r}")
    return process_set.process_set_id


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a set of ranks; every rank must call it with the same ranks. Returns the registered set."""
    process_set = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    runtime = context.current()
    ranks = tuple(process_set.ranks)
    if not ranks or min(ranks) < 0 or max(ranks) >= runtime.world.size or len(set(ranks)) != len(ranks):
        raise ValueError(f"a process set needs distinct ranks in 0..{runtime.world.size - 1}, got {list(ranks)}")
    if ranks in runtime.engine.table.sets.values():
        raise ValueError(f"a process set with ranks {list(ranks)} is already registered")
    process_set.process_set_id = int(runtime.engine.run(Request(f"__add_set__.{next(_requests)}", "add_set",
                                                                splits=ranks)))
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set on every rank (collective); the global set cannot be removed."""
    if process_set is global_process_set or process_set.process_set_id in (None, GLOBAL_SET):
        return False
    removed = bool(context.current().engine.run(Request(f"__remove_set__.{next(_requests)}", "remove_set",
                                                        root=int(process_set.process_set_id))))
    process_set.process_set_id = None
    return removed
