"""``hvdrun bench``'s table: one unit per column, no ratios where one rank has nothing to compare."""

from __future__ import annotations

from io import StringIO

from rich.console import Console

from hvdrun.bench.sweep import BenchReport, BenchRow
from hvdrun.bench.table import bench_table


def rendered(rows: list[BenchRow]) -> list[list[str]]:
    """The table's header and rows, cell by cell."""
    console = Console(width=200, file=StringIO())
    console.print(bench_table(BenchReport(rows=rows)))
    lines = [line for line in console.file.getvalue().splitlines() if line.startswith(("┃", "│"))]
    return [[cell.strip() for cell in line.strip("┃│").replace("┃", "│").split("│")] for line in lines]


def test_each_time_column_has_one_unit_chosen_by_its_largest_time():
    rows = [BenchRow(lib, 2, 1, nbytes, seconds * (2 if lib == "gloo" else 1))
            for lib in ("hvdrun", "gloo") for nbytes, seconds in ((4096, 4e-5), (1 << 20, 6e-3))]
    rows.append(BenchRow("gloo", 2, 1, 1 << 26, 0.25))
    header, small, medium, large = rendered(rows)
    assert header[3:7] == ["hvdrun time us", "hvdrun busbw GB/s", "gloo time ms", "gloo busbw GB/s"]
    assert [small[3], medium[3], large[3]] == ["40.0", "6,000.0", "-"]  # 6 ms in the us column, not "6.00 ms"
    assert [small[5], medium[5], large[5]] == ["0.080", "12.000", "250.000"]
    assert small[4] == f"{4096 / 4e-5 / 1e9:.2f}"


def test_one_rank_has_no_bus_bandwidth_and_no_ratio():
    rows = [BenchRow(lib, ranks, 1, 4096, seconds)
            for lib, seconds in (("hvdrun", 1e-6), ("gloo", 9e-6)) for ranks in (1, 2)]
    header, one, two = rendered(rows)
    assert header[-1] == "hvdrun vs gloo"
    assert one[:3] == ["1", "1", "4 KB"] and one[4] == one[6] == one[-1] == "-"
    assert two[:3] == ["2", "1", "4 KB"] and two[-1] == "9.00x" and two[4] != "-"
