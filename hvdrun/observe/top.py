"""``hvdrun top [JOB]``: every rank's progress, live, from any shell that can reach the job's rank 0.

Two samples of every rank's vitals (:mod:`hvdrun.observe.rates`) a second apart give each rank's collectives and
bytes per second, the share of its time spent waiting for collectives, its optimizer steps per second, the
collective it waits in, its memory and rank 0's straggler marks. A job of more than 16 ranks is folded into one row
per host plus the ten worst ranks. ``--once`` prints one view; ``--json`` prints it as JSON (schema ``hvdrun-top/1``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hvdrun.observe.rates import FOLD_ABOVE, HostRates, RankRates, Sample, fold_hosts, rates, take_sample, worst

SCHEMA = "hvdrun-top/1"
STRAGGLER_MARK = "<< straggler"


def view(job_id: str, before: Sample | None, after: Sample) -> dict[str, Any]:
    """The live view of two samples as JSON-ready values: every rank (or, folded, the worst), every host."""
    rows = rates(before, after)
    folded = len(rows) > FOLD_ABOVE
    scores = after.stragglers
    return {"schema": SCHEMA, "job_id": job_id, "time": after.time, "size": after.size,
            "interval_s": after.time - before.time if before else 0.0, "folded": folded,
            "hosts": [host.as_dict() for host in fold_hosts(rows)],
            "ranks": [row.as_dict() for row in (worst(rows) if folded else rows)],
            "absent": {str(rank): why for rank, why in sorted(after.absent.items())},
            "stragglers": {"window": scores.get("window", 0), "said": scores.get("said", [])}}


def render(shown: dict[str, Any]) -> str:
    """The view as a text table, the way ``hvdrun top`` prints it."""
    lines = [f"hvdrun top: job {shown['job_id']}, {shown['size']} ranks, "
             f"{time.strftime('%H:%M:%S', time.localtime(shown['time']))}"]
    hosts = [HostRates(**host) for host in shown["hosts"]]
    ranks = [RankRates(**rank) for rank in shown["ranks"]]
    if len(hosts) > 1 or shown["folded"]:
        lines += ["", f"{'HOST':<24} {'RANKS':>5} {'COLL/S':>8} {'MB/S':>9} {'WAIT':>5} {'MAXW':>5} {'STEP/S':>7} "
                      f"{'RSS MB':>8} {'GPU MB':>8}"]
        lines += [_host_line(host) for host in hosts]
    title = f"the {len(ranks)} worst ranks" if shown["folded"] else "ranks"
    lines += ["", f"{title}:", f"{'RANK':>5} {'HOST':<20} {'COLL/S':>8} {'MB/S':>9} {'WAIT':>5} {'STEP/S':>7} "
                                f"{'RSS MB':>8} {'GPU MB':>8} {'LAST':>5}  NOW"]
    lines += [_rank_line(rank) for rank in ranks]
    for rank, why in shown["absent"].items():
        lines.append(f"{rank:>5} no vitals: {why}")
    said = shown["stragglers"]["said"]
    if said:
        lines += ["", said[-1][1]]
    return "\n".join(lines)


def _host_line(host: HostRates) -> str:
    mark = f"  {STRAGGLER_MARK} (rank {','.join(map(str, host.stragglers))})" if host.stragglers else ""
    return (f"{host.host[:24]:<24} {len(host.ranks):>5} {host.collectives_per_s_per_rank:>8.1f} "
            f"{host.bytes_per_s / 1e6:>9.2f} {host.mean_wait_share:>5.0%} {host.max_wait_share:>5.0%} "
            f"{host.steps_per_s_per_rank:>7.2f} {host.rss / 1e6:>8.0f} {_mb(host.gpu_bytes):>8}{mark}")


def _rank_line(rank: RankRates) -> str:
    mark = f"  {STRAGGLER_MARK}" if rank.straggler else ""
    return (f"{rank.rank:>5} {rank.host[:20]:<20} {rank.collectives_per_s:>8.1f} {rank.bytes_per_s / 1e6:>9.2f} "
            f"{rank.wait_share:>5.0%} {rank.steps_per_s:>7.2f} {rank.rss / 1e6:>8.0f} {_mb(rank.gpu_bytes):>8} "
            f"{rank.last_share:>5.0%}  {rank.current or '-'}{mark}")


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.0f}"


def watch(job_id: str, sample: Callable[[], Sample], show: Callable[[dict[str, Any]], None], interval_s: float,
          once: bool) -> None:
    """Sample every ``interval_s`` and show each view (after the first interval: rates need two samples), once or
    until interrupted."""
    before = sample()
    while True:
        time.sleep(interval_s)
        after = sample()
        show(view(job_id, before, after))
        if once:
            return
        before = after


def job_sampler(job: dict[str, Any], secret: str) -> Callable[[], Sample]:
    """Samples of the registered ``job`` (an entry of :func:`hvdrun.launch.registry.running_jobs`)."""
    return lambda: take_sample(str(job["addr"]), int(job["port"]), secret)
