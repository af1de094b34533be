"""Every rank's vitals as the inspector sees them: one :class:`Sample` from rank 0, two samples turned into each
rank's rates (:class:`RankRates`), the ranks folded into hosts (:class:`HostRates`) and the worst ranks first.

A sample holds each rank's counters since ``init()`` (collectives, bytes, seconds waited, optimizer steps), the
collective it waits in, its memory, and rank 0's straggler scores (:mod:`hvdrun.runtime.vitals`). Rates come from
the difference of two samples over each rank's own clock.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hvdrun.protocol.inspection import INSPECT, VITALS, ask_rank0

WORST_SHOWN = 10  # ranks listed on their own when a job is folded into hosts
FOLD_ABOVE = 16  # jobs with more ranks than this are shown per host plus the worst ranks


@dataclass(frozen=True)
class Sample:
    """Every rank's vitals at one moment: ``ranks`` rank -> its vitals (plain dict), ``absent`` rank -> why it has
    none, ``size`` the job's ranks, ``time`` when the inspector received it (wall clock)."""

    ranks: dict[int, dict[str, Any]]
    absent: dict[int, str]
    size: int
    time: float

    @property
    def stragglers(self) -> dict[str, Any]:
        """Rank 0's straggler scores (``window``, ``ranks``: rank -> [share last, lag s, flagged], ``said``)."""
        return dict(self.ranks.get(0, {}).get("stragglers") or {})


def take_sample(addr: str, port: int, secret: str) -> Sample:
    """Every rank's vitals, from the rank 0 that serves ``addr:port``.

    Raises:
        OSError: rank 0 cannot be reached (the job ended, or has not started its rendezvous yet).
        RendezvousError: rank 0 refused the secret.
    """
    _, reports, absent, size = ask_rank0(addr, port, secret, (INSPECT, VITALS))
    return Sample({int(r["rank"]): r for r in reports if "collectives" in r}, {int(k): str(v) for k, v in absent},
                  int(size), time.time())


@dataclass(frozen=True)
class RankRates:
    """One rank between two samples. ``wait_share``: the share of the time its threads were blocked waiting for
    collectives; ``last_share``/``lag_s``: how often it came last among the straggler window's collectives and how
    far after the median; ``straggler``: rank 0's watch flags it."""

    rank: int
    host: str
    collectives_per_s: float
    bytes_per_s: float
    wait_share: float
    steps_per_s: float
    current: str | None
    rss: int
    gpu_bytes: int | None
    collectives: int
    steps: int
    last_share: float = 0.0
    lag_s: float = 0.0
    straggler: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The row as JSON-ready values."""
        return asdict(self)


@dataclass(frozen=True)
class HostRates:
    """A host's ranks folded: collectives and steps per second and the wait share of its ranks on average (and the
    worst wait share), its bytes per second and memory summed."""

    host: str
    ranks: list[int]
    collectives_per_s_per_rank: float
    bytes_per_s: float
    mean_wait_share: float
    max_wait_share: float
    steps_per_s_per_rank: float
    rss: int
    gpu_bytes: int | None
    stragglers: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The row as JSON-ready values."""
        return asdict(self)


def rates(before: Sample | None, after: Sample) -> list[RankRates]:
    """Each rank of ``after`` with its rates since ``before`` (0 where ``before`` lacks it), by rank."""
    scores = after.stragglers.get("ranks", {})
    rows = []
    for rank, now in sorted(after.ranks.items()):
        then = (before.ranks.get(rank) if before else None) or {}
        elapsed = float(now["time"]) - float(then.get("time", now["time"]))

        def per_s(key: str, now: dict[str, Any] = now, then: dict[str, Any] = then, elapsed: float = elapsed) -> float:
            return max(float(now[key]) - float(then.get(key, now[key])), 0.0) / elapsed if elapsed > 0 else 0.0

        share, lag, flagged = (list(scores.get(rank, [])) + [0.0, 0.0, False])[:3]
        rows.append(RankRates(rank, str(now["host"]), per_s("collectives"), per_s("bytes"),
                              min(per_s("waited_s"), 1.0), per_s("steps"), _current(now, float(now["time"])),
                              int(now.get("rss") or 0), now.get("gpu_bytes"), int(now["collectives"]),
                              int(now["steps"]), float(share), float(lag), bool(flagged)))
    return rows


def _current(vitals: dict[str, Any], now: float) -> str | None:
    current = vitals.get("current")
    if not current:
        return None
    kind, name, started = current
    return f"{kind} '{name}' ({max(now - float(started), 0.0):.1f} s)"


def fold_hosts(rows: Iterable[RankRates]) -> list[HostRates]:
    """The ranks of each host folded into one row, hosts in the order of their first rank."""
    by_host: dict[str, list[RankRates]] = {}
    for row in rows:
        by_host.setdefault(row.host, []).append(row)
    return [_fold(host, members) for host, members in by_host.items()]


def _fold(host: str, rows: Sequence[RankRates]) -> HostRates:
    count = len(rows)
    gpus = [row.gpu_bytes for row in rows if row.gpu_bytes is not None]
    return HostRates(host, [row.rank for row in rows], sum(r.collectives_per_s for r in rows) / count,
                     sum(r.bytes_per_s for r in rows), sum(r.wait_share for r in rows) / count,
                     max(r.wait_share for r in rows), sum(r.steps_per_s for r in rows) / count,
                     sum(r.rss for r in rows), sum(gpus) if gpus else None, [r.rank for r in rows if r.straggler])


def worst(rows: Iterable[RankRates], count: int = WORST_SHOWN) -> list[RankRates]:
    """The ranks most likely to hold the others up: flagged stragglers, then those that came last most often, then
    the slowest."""
    return sorted(rows, key=lambda r: (not r.straggler, -r.last_share, r.collectives_per_s, r.rank))[:count]
