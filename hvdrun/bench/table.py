"""How ``hvdrun bench`` looks on a terminal: rich tables of times, bus bandwidths, speed-ups and scaling."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hvdrun.bench.bench_job import LIBRARIES
from hvdrun.measure.timing import human_bytes

if TYPE_CHECKING:
    from hvdrun.bench.sweep import BenchReport


def _time_unit(seconds: Iterable[float]) -> tuple[str, float, int]:
    """One unit for a whole column, from its largest time: (name, per second, decimals); us below 10 ms, else ms."""
    return ("us", 1e6, 1) if max(seconds, default=0.0) < 1e-2 else ("ms", 1e3, 3)


def bench_table(report: BenchReport) -> Table:
    """Per rank count and size: each library's time and bus bandwidth, and hvdrun's speed-up over the others.

    Each time column has one unit, named in its header; with 1 rank (no link, nothing to reduce across)
    bus bandwidth and speed-ups are "-"."""
    libraries = [lib for lib in LIBRARIES if any(r.library == lib for r in report.rows)]
    table = Table(title=f"allreduce (float32 sum, median; launcher {report.launcher})", title_justify="left")
    for column in ("ranks", "hosts", "size"):
        table.add_column(column, justify="right")
    units = {lib: _time_unit(r.seconds for r in report.rows if r.library == lib) for lib in libraries}
    for library in libraries:
        table.add_column(f"{library} time {units[library][0]}", justify="right")
        table.add_column(f"{library} busbw GB/s", justify="right")
    others = [lib for lib in libraries if lib != "hvdrun"] if "hvdrun" in libraries else []
    for other in others:
        table.add_column(f"hvdrun vs {other}", justify="right")
    for ranks, nbytes in sorted({(r.ranks, r.bytes) for r in report.rows}):
        mine = report.row("hvdrun", ranks, nbytes)
        hosts = next(r.hosts for r in report.rows if (r.ranks, r.bytes) == (ranks, nbytes))
        cells: list[str | Text] = [str(ranks), str(hosts), human_bytes(nbytes)]
        for library in libraries:
            row = report.row(library, ranks, nbytes)
            _, per_second, decimals = units[library]
            busbw = f"{row.busbw / 1e9:.2f}" if row and ranks > 1 else "-"
            cells += [f"{row.seconds * per_second:,.{decimals}f}", busbw] if row else ["-", "-"]
        for other in others:
            speedup = report.speedup(mine, other) if mine and ranks > 1 else None
            style = "green" if speedup and speedup >= 1 else "red"
            cells.append(Text(f"{speedup:.2f}x", style=style) if speedup else Text("-"))
        table.add_row(*cells)
    return table


def print_bench(report: BenchReport, console: Console) -> None:
    """The table, the scaling efficiency and what was skipped."""
    console.print(bench_table(report))
    efficiency = report.efficiency()
    if efficiency:
        table = Table(title="scaling efficiency vs one host (bus bandwidth at the largest size)", title_justify="left")
        for column in ("library", "ranks", "hosts", "vs one host", "efficiency"):
            table.add_column(column, justify="right")
        for e in efficiency:
            table.add_row(e["library"], str(e["ranks"]), str(e["hosts"]), f"{e['baseline_ranks']} ranks",
                          f"{e['efficiency'] * 100:.0f} %")
        console.print(table)
    else:
        console.print(Text("scaling efficiency: every run fit on one host (add hosts, or -H a:N,b:N)", style="dim"))
    for line in report.skipped:
        console.print(Text(f"skipped: {line}", style="yellow"))
