"""Timeline: a Chrome-trace JSON file (chrome://tracing, Perfetto) of every collective on rank 0.

Each tensor name gets its own row; its ``NEGOTIATE_<OP>`` span runs from submission until
every rank asked for it, and its ``<OP>`` span covers the execution. With ``mark_cycles`` every
negotiation cycle is an instant event. The file is written atomically when the timeline stops.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from hvdrun.atomic_files import write_text_atomically


class Timeline:
    """Collects trace events in memory and writes them to ``path`` on :meth:`close`."""

    def __init__(self, path: str | os.PathLike[str], mark_cycles: bool = False) -> None:
        self.path, self.mark_cycles = Path(path), mark_cycles
        self._events: list[dict[str, Any]] = []
        self._rows: dict[str, int] = {}
        self._lock = threading.Lock()
        self._origin = time.perf_counter()

    def _row(self, name: str) -> int:
        if name not in self._rows:
            self._rows[name] = len(self._rows) + 1
            self._events.append({"name": "process_name", "ph": "M", "pid": self._rows[name], "args": {"name": name}})
        return self._rows[name]

    def _add(self, name: str, phase: str, label: str) -> None:
        stamp = (time.perf_counter() - self._origin) * 1e6
        with self._lock:
            self._events.append({"name": label, "ph": phase, "ts": round(stamp, 3), "pid": self._row(name), "tid": 1})

    def negotiate_start(self, name: str, kind: str) -> None:
        """A collective was submitted on this rank."""
        self._add(name, "B", f"NEGOTIATE_{kind.upper()}")

    def execute_start(self, name: str, kind: str) -> None:
        """Every rank asked for ``name``: negotiation ends, execution begins."""
        self._add(name, "E", f"NEGOTIATE_{kind.upper()}")
        self._add(name, "B", kind.upper())

    def execute_end(self, name: str, kind: str) -> None:
        """The collective finished on this rank."""
        self._add(name, "E", kind.upper())

    def cycle(self) -> None:
        """One negotiation cycle (only with ``mark_cycles``)."""
        if self.mark_cycles:
            stamp = (time.perf_counter() - self._origin) * 1e6
            with self._lock:
                self._events.append({"name": "CYCLE_START", "ph": "i", "s": "g", "ts": round(stamp, 3), "pid": 0})

    def close(self) -> None:
        """Write the trace (temp file, then rename)."""
        with self._lock:
            events = list(self._events)
        write_text_atomically(self.path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
