"""Timing collectives the same way everywhere: warm-up, batches of back-to-back ops, median of repeats;
and the byte sizes they are timed at (``4K`` on the command line, ``4 KB`` in a report)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def batch_plan(nbytes: int, slow: bool = False) -> tuple[int, int]:
    """(repeats, batch length) for an op of ``nbytes``: long batches for latency, few ops for bandwidth.

    ``slow`` shortens the small-message batches for a library an order of magnitude slower there (gloo).
    """
    if nbytes <= 64 << 10:
        return 7, (100 if slow else 1000)
    if nbytes <= 1 << 20:
        return 7, 20
    return (7, 2) if nbytes <= 64 << 20 else (3, 1)


def median_seconds(op: Callable[[], object], barrier: Callable[[], object], repeats: int, batch: int,
                   warmup: int = 2) -> float:
    """Median over ``repeats`` of the mean time of one op in a batch of ``batch`` back-to-back ops.

    Every rank calls it with the same arguments; a barrier lines the ranks up before each batch.
    """
    for _ in range(warmup):
        op()
    times = []
    for _ in range(repeats):
        barrier()
        start = time.perf_counter()
        for _ in range(batch):
            op()
        times.append((time.perf_counter() - start) / batch)
    return statistics.median(times)


def after_pause_seconds(op: Callable[[], object], barrier: Callable[[], object], repeats: int,
                        pause_s: float = 0.002) -> float:
    """Median time of one op right after ``pause_s`` of computation that follows a barrier: a training
    step's pattern (compute, then an allreduce), where back-to-back batches hide wake-up and cold costs."""
    op()
    times = []
    for _ in range(repeats):
        barrier()
        until = time.perf_counter() + pause_s
        while time.perf_counter() < until:  # busy, like a forward/backward pass
            pass
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bus_bandwidth(nbytes: int, seconds: float, ranks: int) -> float:
    """Bytes per second each rank's link carries in a ring allreduce: ``bytes / time * 2 (N - 1) / N``."""
    return nbytes / seconds * 2 * (ranks - 1) / ranks if seconds > 0 else 0.0


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes of ``4096``, ``4K``, ``64M``, ``1G`` (binary units, case-insensitive)."""
    stripped = text.strip().upper()
    number = stripped.rstrip("KMGB")
    unit = stripped[len(number):]
    if not number.isdigit() or unit not in _UNITS or int(number) == 0:
        raise ValueError(f"{text!r} is not a size; expected e.g. 4096, 4K, 64M or 1G")
    return int(number) * _UNITS[unit]


def human_bytes(nbytes: int) -> str:
    """``4 KB``, ``64 MB``, ``1.5 GB``: binary units, as the sizes are given."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"
