"""A rank's vital signs, for the live view and the metrics (``hvdrun top``, ``--metrics-port``, ``--report``).

Asked for like a stacks report (rank 0's rendezvous gathers every rank's, :mod:`hvdrun.protocol.inspection`),
each rank answers with plain numbers its runtime already keeps: how many collectives it submitted and their
bytes, how long its threads waited for collectives, its optimizer steps (all counters since ``init()``, the
inspector turns two samples into rates), the collective it waits in now, its memory, and when it started.
Rank 0 adds the straggler watch's scores (:meth:`hvdrun.runtime.stragglers.StragglerWatch.scores`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from hvdrun.runtime.forensics import FlightRecorder
from hvdrun.runtime.stragglers import StragglerWatch

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rank_vitals(rank: int, host: str, recorder: FlightRecorder | None, stragglers: StragglerWatch | None,
                started_s: float) -> dict[str, Any]:
    """This rank's vitals: counters since ``init()`` (``started_s``: when it began, wall clock; all 0 while it
    joins, ``recorder`` None) and its state now."""
    recorder = recorder or FlightRecorder()
    flights = recorder.snapshot()
    waiting = next((f for f in flights if not f.ended), None)
    vitals: dict[str, Any] = {
        "rank": rank, "host": host, "pid": os.getpid(), "time": time.time(), "collectives": recorder.count,
        "bytes": recorder.bytes, "waited_s": recorder.waited_s, "steps": recorder.steps,
        "current": [waiting.kind, waiting.name, waiting.started] if waiting else None,
        "rss": rss_bytes(), "gpu_bytes": gpu_bytes(), "process_start": process_start(), "init_start": started_s}
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


def gpu_bytes() -> int | None:
    """GPU memory torch holds in this process on its current device; None where torch has no GPU in use."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.memory_allocated())
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and xpu.is_available() and xpu.is_initialized():
            return int(xpu.memory_allocated())
    except (RuntimeError, AttributeError):
        pass
    return None


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
