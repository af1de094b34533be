"""How ``hvdrun check`` and ``hvdrun bench`` look on a terminal: rich tables, colour, a progress line."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hvdrun.health.hosts import Check, HostReport

if TYPE_CHECKING:
    from hvdrun.health.bench import BenchReport
    from hvdrun.health.check import CheckReport

HOST_COLUMNS = ("reach", "python", "hvdrun", "torch", "gpus", "disk", "port")


def _cell(check: Check | None) -> Text:
    if check is None:
        return Text("-", style="dim")
    text = check.found if len(check.found) <= 48 else check.found[:45] + "..."
    if not check.ok:
        return Text(f"✗ {text}", style="bold red")
    return Text(text, style="yellow" if check.warn else "green")


def host_table(hosts: Sequence[HostReport]) -> Table:
    """One row per host, one column per check."""
    table = Table(title="hosts", title_justify="left", show_lines=False)
    table.add_column("host", style="bold")
    for name in HOST_COLUMNS:
        table.add_column(name)
    table.add_column("result")
    for host in hosts:
        checks = {c.name: c for c in host.checks}
        cells = [_cell(checks.get(name)) for name in HOST_COLUMNS]
        cells.append(Text("ok", style="bold green") if host.ok else Text("FAILED", style="bold red"))
        table.add_row(host.host, *cells)
    return table


def job_table(report: CheckReport) -> Table | Text:
    """The real job's checks, and its ring links."""
    job = report.job
    if not job.ran:
        return Text(f"allreduce job: skipped ({job.skipped})", style="yellow")
    table = Table(title=f"allreduce job ({report.launcher['ranks']} ranks, launcher {report.launcher['launcher']})",
                  title_justify="left")
    for column in ("check", "expected", "found"):
        table.add_column(column)
    for check in job.checks:
        table.add_row(check.name, check.expected, _cell(check))
    for link in (job.result or {}).get("links", []):
        speed = Text(f"{link['bandwidth'] / 1e9:.2f} GB/s", style="yellow" if link["slow"] else "green")
        table.add_row(f"link {link['src']}->{link['dst']}", f"{link['src_host']} -> {link['dst_host']}", speed)
    return table


def problems(report: CheckReport) -> list[Text]:
    """A paragraph per failure (and warning): where, what was expected, what was found, the fix."""
    lines = []
    warnings = [(where, c) for where, checks in _all_checks(report) for c in checks if c.warn]
    for where, check in report.failures() + warnings:
        style = "yellow" if check.warn else "red"
        line = Text(f"{where}: {check.name}: ", style=f"bold {style}")
        line.append(f"expected {check.expected}; found {check.found}")
        if check.fix:
            line.append(f"\n    fix: {check.fix}", style="cyan")
        lines.append(line)
    if report.job.error:
        lines.append(Text(f"job: {report.job.error}", style="red"))
    return lines


def _all_checks(report: CheckReport) -> Iterator[tuple[str, list[Check]]]:
    for host in report.hosts:
        yield host.host, host.checks
    yield "job", report.job.checks


def print_check(report: CheckReport, console: Console) -> None:
    """The whole report: hosts, job, problems and the verdict."""
    console.print(host_table(report.hosts))
    console.print(job_table(report))
    for line in problems(report):
        console.print(line)
    verdict = "all checks passed" if report.ok else f"{len(report.failures())} check(s) failed"
    console.print(Text(f"hvdrun check: {verdict}", style="bold green" if report.ok else "bold red"))


class HostProgress:
    """A live line on stderr while hosts answer: ``checking 4 hosts: 2 answered; waiting for h3, h4``."""

    def __init__(self, console: Console, names: Sequence[str]) -> None:
        self.console, self.waiting, self.total = console, list(names), len(names)
        self._status: Any = None

    def _text(self) -> str:
        done = self.total - len(self.waiting)
        waiting = ", ".join(self.waiting[:6]) + (" ..." if len(self.waiting) > 6 else "")
        return f"checking {self.total} hosts: {done} answered" + (f"; waiting for {waiting}" if waiting else "")

    @contextmanager
    def shown(self) -> Iterator[HostProgress]:
        """Show the line (only on a terminal) while the block runs."""
        if not self.console.is_terminal:
            yield self
            return
        with self.console.status(self._text()) as status:
            self._status = status
            yield self

    def host_done(self, report: HostReport) -> None:
        """A host answered (or timed out)."""
        if report.host in self.waiting:
            self.waiting.remove(report.host)
        if self._status is not None:
            self._status.update(self._text())
            mark = "[green]ok[/]" if report.ok else "[red]failed[/]"
            self.console.print(f"  {report.host}: {mark} ({report.seconds:.1f} s)")

    def phase(self, text: str) -> None:
        """A new phase began."""
        if self._status is not None:
            self._status.update(text)


def _time(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us" if seconds < 1e-2 else f"{seconds * 1e3:,.2f} ms"


def _size(nbytes: int) -> str:
    from hvdrun.health.check import human_bytes

    return human_bytes(nbytes)


def bench_table(report: BenchReport) -> Table:
    """Per rank count and size: each library's time and bus bandwidth, and hvdrun's speed-up over the others."""
    libraries = [lib for lib in ("hvdrun", "gloo", "mpi") if any(r.library == lib for r in report.rows)]
    table = Table(title=f"allreduce (float32 sum, median; launcher {report.launcher})", title_justify="left")
    for column in ("ranks", "hosts", "size"):
        table.add_column(column, justify="right")
    for library in libraries:
        table.add_column(f"{library} time", justify="right")
        table.add_column(f"{library} busbw", justify="right")
    others = [lib for lib in libraries if lib != "hvdrun"] if "hvdrun" in libraries else []
    for other in others:
        table.add_column(f"hvdrun vs {other}", justify="right")
    for ranks, nbytes in sorted({(r.ranks, r.bytes) for r in report.rows}):
        mine = report.row("hvdrun", ranks, nbytes)
        hosts = next(r.hosts for r in report.rows if (r.ranks, r.bytes) == (ranks, nbytes))
        cells: list[str | Text] = [str(ranks), str(hosts), _size(nbytes)]
        for library in libraries:
            row = report.row(library, ranks, nbytes)
            cells += [_time(row.seconds), f"{row.busbw / 1e9:.2f} GB/s"] if row else ["-", "-"]
        for other in others:
            speedup = report.speedup(mine, other) if mine else None
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
