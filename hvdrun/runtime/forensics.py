"""Where every rank is: a flight recorder of each rank's collectives, its report, and the job's folded report.

Each rank keeps its last collectives (:class:`FlightRecorder`: name, kind, bytes, when it started and
ended). On request (``hvdrun stacks``, Ctrl-\\ to hvdrun, the stall check) every rank answers with a
:func:`rank_report`: the Python stack of each of its threads, the collectives it waits in and its recent
ones. :func:`format_reports` folds ranks with identical stacks into one entry ("ranks 0,2-7:") and names
the first divergence among the flight recorders ("rank 3 has not submitted #12 'grad.fc2' ...").

Reports travel as plain dicts, lists, strings and numbers (the control plane marshals them).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import traceback
from typing import Any

from hvdrun.ranks import format_ranks

RECENT = 8  # finished collectives shown per rank
_KEPT = 64  # collectives the recorder keeps
_STACK_LINES = 12  # innermost frames shown per thread
_INTERNAL_THREAD = "hvdrun-"  # hvdrun's own threads (engine, rendezvous, reports): not the program's
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../hvdrun


class Flight:
    """One collective of this rank: ``ended`` is 0.0 while it is in flight. A plain class with slots, compared
    by identity: one is made per collective, fast-lane ones included (a dataclass cost a third more)."""

    __slots__ = ("seq", "name", "kind", "nbytes", "started", "ended")

    def __init__(self, seq: int, name: str, kind: str, nbytes: int) -> None:
        self.seq, self.name, self.kind, self.nbytes = seq, name, kind, nbytes
        self.started, self.ended = time.time(), 0.0

    def land(self) -> None:
        """The collective finished (done or failed) on this rank."""
        if not self.ended:
            self.ended = time.time()


class FlightRecorder:
    """This rank's collectives, in submission order, the last ``_KEPT`` of them (a deque: O(1) per op)."""

    def __init__(self) -> None:
        self._flights: collections.deque[Flight] = collections.deque(maxlen=_KEPT)
        self._seq = 0
        self._lock = threading.Lock()

    def take_off(self, name: str, kind: str, nbytes: int) -> Flight:
        """Record that this rank submitted ``name``; call :meth:`Flight.land` when it ends."""
        with self._lock:
            self._seq += 1
            flight = Flight(self._seq, name, kind, nbytes)
            self._flights.append(flight)
        return flight

    def scrub(self, flight: Flight) -> None:
        """Forget ``flight`` (a fast-lane attempt that fell back to the engine, which records it again), wherever
        it sits: another thread may have recorded an op meanwhile. Its number is given back when it was the last
        one taken, so ranks that take the same ops number them alike."""
        with self._lock:
            if self._flights and self._flights[-1] is flight and flight.seq == self._seq:
                self._flights.pop()
                self._seq -= 1
            elif flight in self._flights:
                self._flights.remove(flight)

    def snapshot(self) -> list[Flight]:
        """The recorded collectives, oldest first."""
        with self._lock:
            return list(self._flights)


def rank_report(rank: int, host: str, recorder: FlightRecorder | None) -> dict[str, Any]:
    """This rank's report: its threads' stacks, the collectives it waits in, its recent ones."""
    flights = recorder.snapshot() if recorder else []
    return {"rank": rank, "host": host, "pid": os.getpid(), "time": time.time(), "threads": _thread_stacks(),
            "waiting": [_flight_row(f) for f in flights if not f.ended],
            "recent": [_flight_row(f) for f in flights if f.ended][-RECENT:]}


def _flight_row(flight: Flight) -> list[Any]:
    return [flight.seq, flight.name, flight.kind, flight.nbytes, flight.started, flight.ended]


def _thread_stacks() -> list[list[Any]]:
    """``[[thread name, [frame lines, innermost last]], ...]`` of the program's threads, the main thread first.

    hvdrun's own threads are left out, and a stack ends at its first frame inside hvdrun (the call into
    hvdrun's API): what is below it is the same on every rank that waits alike.
    """
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    stacks = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda item: item[0] != main):
        name = names.get(ident, f"thread {ident}")
        if name.startswith(_INTERNAL_THREAD):
            continue
        frames: list[traceback.FrameSummary] = list(traceback.extract_stack(frame))
        entry = next((i for i, f in enumerate(frames) if f.filename.startswith(_PACKAGE + os.sep)), None)
        if entry is not None:
            frames = frames[:entry + 1]
        stacks.append([name, [f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line}" if f.line else "")
                              for f in frames[-_STACK_LINES:]]])
    return stacks


def format_reports(reports: list[dict[str, Any]], size: int, absent: dict[int, str] | None = None,
                   now: float | None = None) -> str:
    """The job's report: the first divergence, then one entry per group of ranks with identical stacks and
    collectives, then the ranks that did not answer (``absent``: rank -> why)."""
    now = time.time() if now is None else now
    lines = [f"hvdrun: stacks of {len(reports)} of {size} rank(s)"]
    divergence = first_divergence(reports, now)
    if divergence:
        lines.append(f"first divergence: {divergence}")
    groups: dict[str, list[int]] = {}
    for report in sorted(reports, key=lambda r: r["rank"]):
        groups.setdefault(_entry(report, now), []).append(report["rank"])
    for entry, ranks in groups.items():
        hosts = sorted({r["host"] for r in reports if r["rank"] in ranks})
        lines.append(f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)} (on {', '.join(hosts)}):")
        lines.append(entry)
    reasons: dict[str, list[int]] = {}
    for rank, why in sorted((absent or {}).items()):
        reasons.setdefault(why, []).append(rank)
    for why, ranks in reasons.items():
        lines.append(f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}: no report: {why}")
    return "\n".join(lines)


def _entry(report: dict[str, Any], now: float) -> str:
    """What a rank does, without what differs between ranks in the same state (pid, exact times)."""
    out = []
    waiting = report["waiting"]
    if waiting:
        out.append("  waiting in: " + "; ".join(f"#{seq} {kind} '{name}' ({nbytes} B, {_age(now - started)})"
                                               for seq, name, kind, nbytes, started, _ in waiting))
    else:
        out.append("  waiting in: no collective")
    recent = report["recent"]
    if recent:
        out.append("  last collectives: " + ", ".join(f"#{seq} '{name}'" for seq, name, *_ in recent))
    for name, frames in report["threads"]:
        out.append(f"  thread {name}:")
        out.extend(f"    {frame}" for frame in frames)
    return "\n".join(out)


def _age(seconds: float) -> str:
    """``for over 10 s``: coarse, so that ranks waiting alike fold together."""
    bound = next((b for b in (300, 60, 10, 1) if seconds >= b), None)
    return f"for over {bound} s" if bound else "just now"


def first_divergence(reports: list[dict[str, Any]], now: float | None = None) -> str | None:
    """Where the ranks part ways: the collective most ranks wait in, and what each other rank does instead.

    ``rank 2 has not submitted #12 allreduce 'grad.fc2' that ranks 0,1,3 wait in: it finished #11
    'grad.fc1' 4 s ago and waits in no collective (main thread at train.py:14 in slow_step)``.
    """
    now = time.time() if now is None else now
    waiters: dict[str, list[int]] = {}
    for report in reports:
        for _, name, *_ in report["waiting"]:
            waiters.setdefault(name, []).append(report["rank"])
    if not waiters:
        return None
    name, ranks = max(waiters.items(), key=lambda item: (len(item[1]), -min(item[1])))
    others = [r for r in sorted(reports, key=lambda r: r["rank"]) if r["rank"] not in ranks]
    if not others:
        return None
    seq, kind = next((row[0], row[2]) for r in reports for row in r["waiting"] if row[1] == name)
    parts = [_elsewhere(report, name, now) for report in others]
    return (f"rank{'s' if len(others) > 1 else ''} {format_ranks([r['rank'] for r in others])} "
            f"{'have' if len(others) > 1 else 'has'} not reached #{seq} {kind} '{name}' that "
            f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)} wait{'' if len(ranks) > 1 else 's'} in: "
            + "; ".join(parts))


def _elsewhere(report: dict[str, Any], name: str, now: float) -> str:
    """What one rank that is not waiting in ``name`` does instead."""
    rank = report["rank"]
    finished = [row for row in report["recent"] if row[1] == name]
    if finished:
        where = "finished it"
    elif report["recent"]:
        seq, last, *_, ended = report["recent"][-1]
        where = f"finished #{seq} '{last}' {now - ended:.1f} s ago"
    else:
        where = "has run no collective yet"
    waiting = report["waiting"]
    doing = (f"waits in #{waiting[0][0]} '{waiting[0][1]}'" if waiting
             else f"waits in no collective ({_main_frame(report)})")
    return f"rank {rank} {where} and {doing}"


def _main_frame(report: dict[str, Any]) -> str:
    """``main thread at train.py:14 in slow_step``: the innermost frame of the main thread outside hvdrun."""
    for name, frames in report["threads"]:
        if name == "MainThread" and frames:
            outside = [frame for frame in frames if not frame.startswith(_PACKAGE + os.sep)]
            frame = (outside or frames)[-1]
            where, _, rest = frame.partition(" in ")
            return f"main thread at {os.path.basename(where)} in {rest.split(':')[0]}"
    return "its main thread's stack is unknown"
