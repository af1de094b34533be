"""Stragglers named from the negotiation alone: which rank (or host) the others keep waiting for.

Every rank's table sees, for each collective, the cycle in which each rank's request arrived (a cycle's
announcements reach every rank together, so every rank sees the same). When a collective becomes ready, the
ranks whose request came last are the ones the others waited for, and each other rank waited from its own
arrival to theirs. Rank 0 keeps these facts over a sliding window of collectives and, when one rank stands out
among the last of most of them (or the late ranks are all of one host), well after the median, says so in one
line, at most once a minute while it lasts::

    hvdrun: straggler: rank 3 on node7 arrived last at 94% of the last 500 collectives, 31 ms after the
    median; the other 3 ranks spent 28% of their time waiting for it

Collectives that every rank requested in the same cycle (an even job's steady state) count as arrivals with no
one last, so jitter that moves the last place around, a first step's warm-up or a checkpoint every rank takes
does not add up to a verdict. Collectives of a process set, or with ranks that joined, are left out.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import repeat
from typing import Any, NamedTuple

WINDOW = 500  # collectives kept
MIN_COLLECTIVES = 32  # a verdict needs at least this many in the window
LAST_SHARE = 0.75  # the straggler came last in at least this share of them
MIN_LAG_S = 0.005  # ... on average at least this long after the median
MIN_WAIT_SHARE = 0.05  # ... and the others spent at least this share of their time waiting for it
REPEAT_S = 60.0  # a straggler that persists is named again at most this often
JUDGE_S = 0.25  # the window is judged at most this often (a judgement reads the whole window)
NAMED_KEPT = 20  # lines kept for the live view and the report


class Arrival(NamedTuple):
    """One collective: who came last (empty: everyone in the same cycle), how long after the median arrival,
    how long the others waited for them in all, and when it became ready."""

    last: tuple[int, ...]
    lag_s: float
    waited_s: float
    at: float


def arrival(times: Mapping[int, float], now: float) -> Arrival:
    """The :class:`Arrival` of one collective from each rank's arrival time."""
    latest = max(times.values())
    if min(times.values()) == latest:
        return Arrival((), 0.0, 0.0, now)
    last = tuple(sorted(rank for rank, t in times.items() if t == latest))
    median = statistics.median(times.values())
    return Arrival(last, latest - median, sum(latest - t for t in times.values()), now)


def tally_arrival(counts: Mapping[int, int], last_cycle: int, last: Sequence[int], times: Mapping[int, float],
                  now: float) -> Arrival:
    """The :class:`Arrival` of a held request that every rank held, from its tally (see
    :mod:`hvdrun.runtime.announcements`): how many ranks began to hold it in each cycle, the last cycle and its
    ranks, and when each cycle ran (``times``; one this rank no longer remembers counts as ``now``)."""
    if len(counts) == 1:
        return Arrival((), 0.0, 0.0, now)
    when = sorted((times.get(cycle, now), count) for cycle, count in counts.items())
    latest = times.get(last_cycle, now)
    total = sum(count for _, count in when)
    return Arrival(tuple(sorted(last)), latest - _median(when, total), sum(count * (latest - t) for t, count in when),
                   now)


def _median(when: list[tuple[float, int]], total: int) -> float:
    """The median of ``total`` values given as sorted (value, how many) pairs."""
    middle: list[float] = []
    seen = 0
    for value, count in when:
        while len(middle) < 2 and seen + count > (total - 1) // 2 + len(middle):
            middle.append(value)
        seen += count
        if len(middle) == 2:
            break
    return middle[0] if total % 2 else (middle[0] + middle[1]) / 2


class StragglerWatch:
    """Rank 0's sliding window of arrivals and its verdict.

    Args:
        hostnames: the host of every rank.
        say: where a verdict goes (rank 0's stderr, which the launcher prefixes with the rank).
        clock: seconds, monotonic.
    """

    def __init__(self, hostnames: Sequence[str], say: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, window: int = WINDOW) -> None:
        self.hostnames, self.size = list(hostnames), len(hostnames)
        self._say = say or _to_stderr
        self._clock = clock
        self._window: deque[Arrival] = deque(maxlen=window)
        self._named: dict[tuple[int, ...], float] = {}  # the ranks of each verdict said, and when
        self.said: deque[tuple[float, str]] = deque(maxlen=NAMED_KEPT)  # the lines said (wall clock, line)
        self.flagged: tuple[int, ...] = ()  # the ranks of the latest judgement's verdict (the live view's marks)
        self._judged = -JUDGE_S

    def observe(self, late: Iterable[Mapping[int, float]], even: int = 0, now: float | None = None,
                arrivals: Iterable[Arrival] = ()) -> None:
        """Count the collectives that became ready now and name a straggler: ``late``, each rank's arrival time
        of those whose requests arrived in more than one cycle; ``even``, how many arrived in one (the cheap
        common case: the caller need not look at their ranks); ``now``, the cycle's time when the caller has
        read the clock already; ``arrivals``, collectives already summed up (held requests, :func:`tally_arrival`)."""
        now = self._clock() if now is None else now
        size, window = self.size, self._window
        if even:
            window.extend(repeat(Arrival((), 0.0, 0.0, now), min(even, window.maxlen or even)))
        for times in late:
            if len(times) == size:
                window.append(arrival(times, now))
        window.extend(arrivals)
        if now - self._judged >= JUDGE_S and len(window) >= MIN_COLLECTIVES:
            self._judged = now
            found = self._judge()
            self.flagged = found[1] if found else ()
            if found is not None:
                self._name(*found, now)

    def verdict(self) -> str | None:
        """The line that names the straggler of the window, or None when there is none: a rank that stands out
        (among the last far more often than any other), else a host whose ranks come last (by turns, or
        together)."""
        found = self._judge()
        return found[0] if found else None

    def _judge(self) -> tuple[str, tuple[int, ...]] | None:
        """The verdict's line and the ranks it names (a rank, or every rank of a host), or None."""
        window = list(self._window)
        for who, found in (("rank", _distinct_rank(window)), ("host", _most_often_last(window, self._by_host))):
            if found is None:
                continue
            key, late = found
            line = self._line(who, key, late, window)
            if line is not None:
                named = (int(key),) if who == "rank" else tuple(r for r, h in enumerate(self.hostnames) if h == key)
                return line, named
        return None

    def scores(self) -> dict[str, Any]:
        """The window as numbers, for the live view: for each rank that came last at least once, the share of the
        window's collectives it was among the last in, its mean lag after the median (seconds) and whether the
        latest judgement's verdict names it (or its host); the window's length; the lines said so far
        (``[wall clock, line]``, the latest last). Read on another thread than the engine's, which appends."""
        window, said, flagged = list(self._window), list(self.said), set(self.flagged)
        lags: dict[int, list[float]] = {}
        for item in window:
            for rank in item.last:
                lags.setdefault(rank, []).append(item.lag_s)
        ranks = {rank: [len(lag) / len(window), statistics.fmean(lag), rank in flagged] for rank, lag in lags.items()}
        ranks.update({rank: [0.0, 0.0, True] for rank in flagged - set(ranks)})  # a named host's punctual ranks
        return {"window": len(window), "said": [list(entry) for entry in said], "ranks": ranks}

    def _by_host(self, last: tuple[int, ...]) -> str | None:
        hosts = {self.hostnames[rank] for rank in last}
        return hosts.pop() if len(hosts) == 1 and len(set(self.hostnames)) > 1 else None

    def _line(self, who: str, key: str, late: list[Arrival], window: list[Arrival]) -> str | None:
        if len(late) < LAST_SHARE * len(window):
            return None
        lag = statistics.fmean(a.lag_s for a in late)
        elapsed = window[-1].at - window[0].at
        waiting = sum(a.waited_s for a in late)
        if lag < MIN_LAG_S or elapsed <= 0:
            return None
        others = self.size - (1 if who == "rank" else self.hostnames.count(key))
        share = waiting / (max(others, 1) * elapsed)
        if share < MIN_WAIT_SHARE:
            return None
        name = f"rank {key} on {self.hostnames[int(key)]}" if who == "rank" else f"host {key} (its ranks)"
        return (f"hvdrun: straggler: {name} arrived last at {len(late) / len(window):.0%} of the last "
                f"{len(window)} collectives, {lag * 1e3:.0f} ms after the median; the other {others} ranks spent "
                f"{min(share, 1.0):.0%} of their time waiting for it")

    def _name(self, line: str, named: tuple[int, ...], now: float) -> None:
        if now - self._named.get(named, -REPEAT_S) >= REPEAT_S:
            self._named[named] = now
            self.said.append((time.time(), line))
            self._say(line)


def _distinct_rank(window: list[Arrival]) -> tuple[str, list[Arrival]] | None:
    """The rank among the last most often and its collectives, when it stands out: no other rank was among the last
    in even half the verdict's share of the window (others that came last with it in the same cycle, descheduled
    a moment on a busy host, do not hide it; several ranks late alike point at their host, or at the job)."""
    counts = Counter(rank for item in window for rank in item.last)
    if not counts:
        return None
    (rank, _), *rest = counts.most_common(2)
    if rest and rest[0][1] >= LAST_SHARE / 2 * len(window):
        return None
    return str(rank), [item for item in window if rank in item.last]


def _most_often_last(window: list[Arrival], key_of: Callable[[tuple[int, ...]], str | None]
                     ) -> tuple[str, list[Arrival]] | None:
    """The key most often last in ``window`` and its collectives, or None when no collective had one last."""
    by_key: dict[str, list[Arrival]] = {}
    for item in window:
        key = key_of(item.last) if item.last else None
        if key is not None:
            by_key.setdefault(key, []).append(item)
    if not by_key:
        return None
    key = max(by_key, key=lambda k: len(by_key[k]))
    return key, by_key[key]


def _to_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
