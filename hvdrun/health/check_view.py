"""How ``hvdrun check`` looks on a terminal: rich tables, colour, a progress line."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hvdrun.health.host_checks import Check, HostReport
from hvdrun.health.node_checks import NODE_CHECKS

if TYPE_CHECKING:
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
    """One row per host, one column per check (the node checks of ``--health`` where any host has them)."""
    table = Table(title="hosts", title_justify="left", show_lines=False)
    table.add_column("host", style="bold")
    asked = {c.name for host in hosts for c in host.checks}
    columns = [*HOST_COLUMNS, *(name for name in NODE_CHECKS if name in asked)]
    for name in columns:
        table.add_column(name)
    table.add_column("result")
    for host in hosts:
        checks = {c.name: c for c in host.checks}
        cells = [_cell(checks.get(name)) for name in columns]
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


def network_line(report: CheckReport) -> Text:
    """Which interface rank 0 advertises its address on, and why (``--network-interface``, the cluster file)."""
    interface = report.launcher.get("interface") or {}
    line = Text("network: ", style="bold")
    if interface.get("note"):  # the cluster file's interface is not on this machine
        return line + Text(str(interface["note"]), style="yellow")
    if not interface.get("name"):
        return line + Text("rank 0 advertises the address of its route to the first other host (no "
                           "--network-interface; a cluster file's network_interface counts when the job spans hosts)")
    address = interface.get("address")
    line.append(f"rank 0 advertises its address on {interface['name']} ({interface['from']}); ")
    line.append(f"this machine's is {address}" if address else "this machine has no IPv4 address on it",
                style="green" if address else "yellow")
    return line


def print_check(report: CheckReport, console: Console) -> None:
    """The whole report: the network, hosts, job, problems and the verdict."""
    console.print(network_line(report))
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

