"""Process sets: only the global set is supported so far; any other set is refused, never ignored."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from hvdrun.runtime import context

F = TypeVar("F", bound=Callable[..., Any])


class ProcessSet:
    """A set of global ranks that a collective is restricted to (Horovod's ``hvd.ProcessSet``)."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self._ranks = sorted(ranks) if ranks is not None else None
        self.process_set_id: int | None = 0 if ranks is None else None

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
        return "ProcessSet(global)" if self._ranks is None else f"ProcessSet({self._ranks})"


global_process_set = ProcessSet()


def check_process_set(process_set: Any) -> None:
    """Refuse anything but the global set, with a clear error (hvdrun does not support subsets yet)."""
    if process_set is None or process_set is global_process_set:
        return
    if isinstance(process_set, ProcessSet) and process_set.ranks == global_process_set.ranks:
        return
    raise ValueError(f"{process_set!r}: hvdrun supports only the global process set so far; "
                     "drop process_set= or use hvd.global_process_set")


def add_process_set(process_set: Any) -> ProcessSet:
    """Horovod's dynamic process sets: refused until hvdrun supports subsets of ranks."""
    raise ValueError("add_process_set: hvdrun supports only the global process set so far")


def remove_process_set(process_set: Any) -> bool:
    """Horovod's dynamic process sets: the global set cannot be removed; others do not exist."""
    check_process_set(process_set)
    return False


def global_set_only(fn: F) -> F:
    """Check the ``process_set`` argument of ``fn`` (cheaply: its position is found once)."""
    position = list(inspect.signature(fn).parameters).index("process_set")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        process_set = args[position] if len(args) > position else kwargs.get("process_set")
        if process_set is not None:
            check_process_set(process_set)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
