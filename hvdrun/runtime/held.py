"""One rank's held requests: cached ops it announces by number each cycle instead of into the table.

Where the backend merges announcements (:mod:`hvdrun.runtime.announcements`), a request every rank agreed on
before (a number of the response cache) is *held* by the rank that submitted it: each cycle the rank says which
numbers it holds, the cycle's tallies say how many ranks hold each, and a number every rank holds runs. A held
request goes into the table the ordinary way (it is *flushed*, announced in the general form in the next cycle)
when a cycle had anything in the general form, or when some rank held one for :data:`FLUSH_AGE_S`; a request
whose name is in the table already, or whose number is being flushed, is not held at all. So the table, and
every verdict read from it (mismatch, stall, deadlock, join), still sees every request that has not run.

Every decision here that all ranks must share (which numbers run, which are flushed) is read from the cycle's
merged tallies and flags, which every rank has alike; what a rank holds is its own.
"""

from __future__ import annotations

import time
from typing import Any

from hvdrun.runtime.announcements import Tally, holders

FLUSH_AGE_S = 0.5  # a request held this long on a rank goes into the table (the deadlock probe's confirmation age)
_CYCLE_TIMES = 4096  # cycles whose times a rank remembers (a held request's arrival)


class HeldRequests:
    """The requests this rank holds, and the cycle count and times their tallies refer to."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, float]] = {}  # number -> (the cycle it began, when: monotonic)
        self.flushing: frozenset[int] = frozenset()  # numbers the last cycle said to flush in this one
        self.cycle = 0  # cycles exchanged (the same count on every rank)
        self.times: dict[int, float] = {}  # cycle -> when it ran here, for the recent ones

    def __bool__(self) -> bool:
        return bool(self._held)

    def flush_due(self) -> bool:
        """A cycle is due: some numbers are to be flushed, or one was held for FLUSH_AGE_S."""
        return bool(self.flushing) or self._held_too_long()

    def _held_too_long(self) -> bool:
        """The oldest held request (the first: held in order) was held for FLUSH_AGE_S."""
        try:  # flush_due asks outside the progress lock: a cycle may change the held requests meanwhile
            oldest = next(iter(self._held.values()), None)
        except RuntimeError:
            return False
        return oldest is not None and time.monotonic() - oldest[1] >= FLUSH_AGE_S

    def begin_cycle(self) -> tuple[int, list[int]]:
        """A new cycle's number, and the numbers this rank flushes in it (no longer held)."""
        self.cycle += 1
        if not self.flushing:
            return self.cycle, []
        flushed = [key for key in self._held if key in self.flushing]
        for key in flushed:
            del self._held[key]
        return self.cycle, flushed

    def hold(self, key: int, since: float | None = None) -> None:
        """Hold the request numbered ``key`` from this cycle on (submitted at ``since``, monotonic; default now)."""
        self._held[key] = (self.cycle, time.monotonic() if since is None else since)

    def announced(self) -> tuple[dict[int, int], bool]:
        """What this cycle says of them: each number with the cycle it began, and whether one is held too long."""
        return {key: held[0] for key, held in self._held.items()}, self._held_too_long()

    def end_exchange(self) -> None:
        """This cycle's flushes went out."""
        self.flushing = frozenset()

    def drop(self, key: Any) -> None:
        """``key`` ran (by itself, every rank with it alone)."""
        self._held.pop(key, None)

    def began_alone_now(self, key: Any, tallies: dict[int, Tally], general: bool, size: int) -> bool:
        """Every rank began to hold ``key`` in this cycle, and holds and says nothing else."""
        if type(key) is not int or general or len(tallies) != 1:
            return False
        tally = tallies.get(key)
        return tally is not None and tally[0] == {self.cycle: size}

    def settle(self, tallies: dict[int, Tally], size: int, flush: bool, now: float) -> list[int]:
        """The numbers every rank holds, in number order (the same on every rank), no longer held; when ``flush``,
        the ones held by only some are flushed in the next cycle."""
        self.times[self.cycle] = now
        if len(self.times) > _CYCLE_TIMES:
            del self.times[next(iter(self.times))]
        ready: list[int] = []
        partial: list[int] = []
        for key in sorted(tallies):
            (ready if holders(tallies[key]) == size else partial).append(key)
        for key in ready:
            self._held.pop(key, None)
        if partial and flush:
            self.flushing = frozenset(partial)
        return ready
