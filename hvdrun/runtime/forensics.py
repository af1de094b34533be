"""Where every rank is: a flight recorder of each rank's collectives, and its report when asked.

Each rank keeps its last collectives (:class:`FlightRecorder`: name, kind, bytes, when it started and
ended). On request (``hvdrun stacks``, Ctrl-\\ to hvdrun, the stall check) every rank answers with a
:func:`rank_report`: the Python stack of each of its threads, the collectives it waits in and its recent
ones. :func:`hvdrun.protocol.inspection.format_reports` folds them into the job's report, in the launcher
(``hvdrun stacks``) and on rank 0 (the stall check) alike.

Reports travel as plain dicts, lists, strings and numbers (the control plane marshals them).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import traceback
from threading import get_ident
from typing import Any

from hvdrun.protocol.inspection import PACKAGE_DIR

RECENT = 8  # finished collectives shown per rank
_KEPT = 64  # collectives the recorder keeps
_STACK_LINES = 12  # innermost frames shown per thread
_INTERNAL_THREAD = "hvdrun-"  # hvdrun's own threads (engine, rendezvous, reports): not the program's
_PRELOAD_FILE = os.path.join(PACKAGE_DIR, "launch", "remote", "inprocess.py")  # where a forked rank's code starts


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
        self.bytes = 0  # of every collective submitted
        self.steps = 0  # optimizer steps (``hvdrun.torch`` counts them)
        self._waited_s = 0.0  # time the program's threads spent blocked waiting for collectives, waits that ended
        self._waits: dict[int, float] = {}  # thread -> when its wait (the outermost) began, wall clock

    @property
    def count(self) -> int:
        """How many collectives this rank submitted."""
        return self._seq

    def take_off(self, name: str, kind: str, nbytes: int) -> Flight:
        """Record that this rank submitted ``name``; call :meth:`Flight.land` when it ends."""
        with self._lock:
            self._seq += 1
            self.bytes += nbytes
            flight = Flight(self._seq, name, kind, nbytes)
            self._flights.append(flight)
        return flight

    def wait_begins(self, at: float | None = None) -> int:
        """The calling thread blocks until a collective finishes (from ``at``, wall clock, default now); returns
        the token for :meth:`wait_ends` (0 for a wait inside a wait of the same thread: it counts once). No lock:
        each thread touches its own entry (a dict's item operations are atomic), and the sum is a statistic."""
        thread = get_ident()
        waits = self._waits
        if thread in waits:
            return 0
        waits[thread] = time.time() if at is None else at
        return thread

    def wait_ends(self, thread: int, at: float | None = None) -> None:
        """The wait that :meth:`wait_begins` returned ``thread`` for ended (at ``at``, default now)."""
        if thread:
            waits = self._waits
            elapsed = (time.time() if at is None else at) - waits[thread]
            if elapsed > 0:  # a clock stepped back: nothing
                self._waited_s += elapsed
            del waits[thread]  # after the sum: a reader in between counts it twice, never not at all

    def waited(self, seconds: float) -> None:
        """A wait of ``seconds`` that ended, not registered while in progress (the fast lane's: a few microseconds
        unless a peer is late, and the lane withdraws within milliseconds then)."""
        if seconds > 0:
            self._waited_s += seconds

    def waited_s(self) -> float:
        """Seconds the program's threads spent blocked waiting for collectives, the waits in progress included
        (a rank stuck in a collective shows as waiting, not as idle)."""
        now = time.time()
        in_progress = list(self._waits.values())
        return self._waited_s + sum(max(now - began, 0.0) for began in in_progress)

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
            else:
                return
            self.bytes -= flight.nbytes

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


def _below_rank_entry(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """``frames`` without the launcher's own below the rank's code (a rank forked from a preloaded fork server
    runs inside its frames, ``launch/remote/inprocess.py``)."""
    entries = [i for i, f in enumerate(frames) if f.filename == _PRELOAD_FILE]
    return frames[entries[-1] + 1:] if entries else frames


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
        frames: list[traceback.FrameSummary] = _below_rank_entry(list(traceback.extract_stack(frame)))
        entry = next((i for i, f in enumerate(frames) if f.filename.startswith(PACKAGE_DIR + os.sep)), None)
        if entry is not None:
            frames = frames[:entry + 1]
        stacks.append([name, [f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line}" if f.line else "")
                              for f in frames[-_STACK_LINES:]]])
    return stacks
