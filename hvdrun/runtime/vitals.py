"""A rank's vital signs, for the live view and the metrics (``hvdrun top``, ``--metrics-port``, ``--report``).

Asked for like a stacks report (rank 0's rendezvous gathers every rank's, :mod:`hvdrun.protocol.inspection`),
each rank answers with plain numbers its runtime already keeps: how many collectives it submitted and their
bytes, how long its threads waited for collectives (a wait in progress included), its optimizer steps (all
counters since ``init()``: the inspector turns two samples into rates), the collective it waits in now, its
memory, and when its process started.
Rank 0 adds the straggler watch's scores (:meth:`hvdrun.runtime.stragglers.StragglerWatch.scores`).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

from hvdrun.runtime.device import own_device_ordinal
from hvdrun.runtime.forensics import FlightRecorder
from hvdrun.runtime.stragglers import StragglerWatch

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rank_vitals(rank: int, host: str, local_rank: int, recorder: FlightRecorder | None,
                stragglers: StragglerWatch | None) -> dict[str, Any]:
    """This rank's vitals: counters since ``init()`` (all 0 while it joins, ``recorder`` None) and its state now."""
    recorder = recorder or FlightRecorder()
    flights = recorder.snapshot()
    waiting = next((f for f in flights if not f.ended), None)
    vitals: dict[str, Any] = {
        "rank": rank, "host": host, "pid": os.getpid(), "time": time.time(), "collectives": recorder.count,
        "bytes": recorder.bytes, "waited_s": recorder.waited_s(), "steps": recorder.steps,
        "current": [waiting.kind, waiting.name, waiting.started] if waiting else None,
        "rss": rss_bytes(), "gpu_bytes": gpu_bytes(local_rank), "process_start": process_start()}
    if stragglers is not None:
        vitals["stragglers"] = stragglers.scores()
    return vitals


def rss_bytes() -> int:
    """This process's resident memory."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def gpu_bytes(local_rank: int) -> int | None:
    """GPU memory torch holds in this process on the rank's own device (the one hvdrun makes current: asked by
    number, since the current device is per thread and this runs on the runtime's), on every device where the rank
    has none of its own; None where torch has no GPU in use."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    for kind in ("cuda", "xpu"):
        module = getattr(torch, kind, None)
        try:
            if module is None or not module.is_available() or not module.is_initialized():
                continue
            count = module.device_count()
            own = own_device_ordinal(os.environ, local_rank, count)
            return int(sum(module.memory_allocated(d) for d in ([own] if own is not None else range(count))))
        except (RuntimeError, AttributeError):
            return None
    return None


@functools.cache
def process_start() -> float | None:
    """When this process started (wall clock, from ``/proc``); None where that cannot be read."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as machine:
            boot = next(int(line.split()[1]) for line in machine if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
