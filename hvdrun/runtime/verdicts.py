"""The engine's verdicts on ops that cannot complete: deadlocks, stalls, and ranks that left.

Every function here reads only the negotiation table and the announcements that every rank holds
identically, so every rank reaches the same verdict at the same point without a coordinator; the
engine applies it (fails those ops on this rank) and the next collective works again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hvdrun.errors import CollectiveError
from hvdrun.runtime.negotiation import Entry, Table

SHUTDOWN = "__shutdown__"  # the name of the request every rank makes when it leaves the job


def deadlock(table: Table, blocked: dict[int, list[str]]) -> tuple[CollectiveError, list[Entry]] | None:
    """The error and the entries of a wait-for cycle among blocked ranks, removed from ``table``; None if
    every blocked rank may still be freed by a rank that computes.

    Args:
        table: the negotiation table (identical on every rank).
        blocked: rank -> the names it has waited for past the confirmation age.
    """
    stuck = table.deadlocked(blocked)
    if not stuck:
        return None
    parts = [_deadlock_part(table, rank, entries) for rank, entries in stuck.items()]
    error = CollectiveError("deadlock: every rank involved is blocked waiting for a collective that another "
                            "of them has not submitted, so none can complete: " + "; ".join(parts))
    removed = [entry for entries in stuck.values() for entry in entries
               if table.entries.pop(entry.name, None) is not None]
    return error, removed


def _deadlock_part(table: Table, rank: int, entries: list[Entry]) -> str:
    submitted = sorted(e.name for e in table.entries.values() if rank in e.requests)
    waits = ", ".join(f"'{e.name}' (which rank{'s' if len(table.awaited_ranks(e)) > 1 else ''} "
                      f"{', '.join(map(str, sorted(table.awaited_ranks(e))))} never submitted)" for e in entries)
    return f"rank {rank} waits for {waits} and has submitted {', '.join(submitted) or 'nothing'}"


def departed(table: Table) -> list[tuple[Entry, CollectiveError]]:
    """Entries that ranks which already shut down never submitted, removed from ``table``, with their errors."""
    shutdown = table.entries.get(SHUTDOWN)
    if shutdown is None:
        return []
    failed = []
    for entry in list(table.entries.values()):
        gone = sorted(set(shutdown.requests) - set(entry.requests))
        if entry is not shutdown and gone:
            del table.entries[entry.name]
            failed.append((entry, CollectiveError(
                f"'{entry.name}' can never complete: rank{'s' if len(gone) > 1 else ''} "
                f"{', '.join(map(str, gone))} shut down without submitting it")))
    return failed


@dataclass
class StallWatch:
    """Warns about, then fails, collectives that some ranks have not submitted for too long.

    Args:
        warning_s: warn (rank 0 only) after this long.
        error_s: fail every rank after this long (0 disables).
        period_s: look at most this often.
    """

    warning_s: float
    error_s: float
    period_s: float = 0.25
    _last: float = 0.0
    _final: set[tuple[str, float]] = field(default_factory=set)  # (name, first seen) of ops announced
    _last_final: float = 0.0

    def about_to_fail(self, table: Table) -> str | None:
        """The stall text of ops that will fail every rank within a second (each announced once): rank 0
        reports where every rank is then, while every rank is still there to answer."""
        now = time.monotonic()
        if not self.error_s or now - self._last_final < self.period_s:
            return None
        self._last_final = now
        near = [entry for entry in table.stalled(self.error_s - min(1.0, self.error_s / 10))
                if (entry.name, entry.first_seen) not in self._final]
        live = {(entry.name, entry.first_seen) for entry in table.entries.values()}
        self._final = (self._final & live) | {(entry.name, entry.first_seen) for entry in near}
        return describe_stall(near, table.size, self.error_s) if near else None

    def check(self, table: Table, rank: int) -> str | None:
        """The warning to print on this rank, if any; raises CollectiveError past ``error_s``."""
        now = time.monotonic()
        if now - self._last < self.period_s:
            return None
        self._last = now
        if self.error_s and (dead := table.stalled(self.error_s)):
            raise CollectiveError("stalled: " + describe_stall(dead, table.size, self.error_s))
        fresh = [entry for entry in table.stalled(self.warning_s) if not entry.warned]
        for entry in fresh:
            entry.warned = True
        if fresh and rank == 0:
            return (f"hvdrun: warning: {describe_stall(fresh, table.size, self.warning_s)}; "
                    "ranks that submit different tensors or hang cause this\n")
        return None


def describe_stall(entries: list[Entry], size: int, seconds: float) -> str:
    """``2 collective(s) waited more than 60 s for some ranks: 'a' missing rank 1; ...``."""
    parts = [f"'{e.name}' missing rank{'s' if len(e.missing(size)) > 1 else ''} "
             f"{', '.join(map(str, e.missing(size)))}" for e in entries]
    return f"{len(entries)} collective(s) waited more than {seconds:g} s for some ranks: {'; '.join(parts)}"
