"""Plots for the job report, as inline SVG: no script, no network, readable in any browser.

:func:`line_chart` draws series over time (one line each, a legend beside them); :func:`phase_bars` draws a
horizontal stacked bar per host (its start-up phases). Every plot is an ``<svg class="plot">``; text is escaped.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence

WIDTH, HEIGHT = 760, 260
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 180, 28, 36  # margins: axis labels left and below, legend right
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
LEGEND_ROWS = 12  # series named in the legend (the rest: "and N more")

Point = tuple[float, float]


def line_chart(title: str, series: Mapping[str, Sequence[Point]], y_label: str, percent: bool = False,
               start: float | None = None) -> str:
    """``series`` (name -> ``(time, value)`` points) as lines over seconds since ``start`` (default: the first
    point); ``percent``: values are shares from 0 to 1, drawn 0–100 %."""
    points = [p for line in series.values() for p in line]
    if not points:
        return f'<p class="empty">{html.escape(title)}: no samples (the job ended before the first one)</p>'
    origin = min(p[0] for p in points) if start is None else start
    x_max = max(max(p[0] for p in points) - origin, 1e-9)
    y_max = 1.0 if percent else _nice_ceiling(max(p[1] for p in points))
    width, height = WIDTH - _LEFT - _RIGHT, HEIGHT - _TOP - _BOTTOM

    def xy(point: Point) -> str:
        x = _LEFT + (point[0] - origin) / x_max * width
        y = _TOP + height - min(point[1] / y_max, 1.0) * height
        return f"{x:.1f},{y:.1f}"

    parts = [_frame(title, y_label, x_max, y_max, percent)]
    for index, (name, line) in enumerate(series.items()):
        color = PALETTE[index % len(PALETTE)]
        coords = " ".join(xy(p) for p in line) if len(line) > 1 else f"{xy(line[0])} {xy(line[0])}"
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{coords}">'
                     f"<title>{html.escape(name)}</title></polyline>")
        if index < LEGEND_ROWS:
            y = _TOP + 6 + index * 16
            parts.append(f'<rect x="{WIDTH - _RIGHT + 12}" y="{y}" width="12" height="3" fill="{color}"/>'
                         f'<text x="{WIDTH - _RIGHT + 30}" y="{y + 5}" class="legend">{html.escape(name)}</text>')
    if len(series) > LEGEND_ROWS:
        parts.append(f'<text x="{WIDTH - _RIGHT + 12}" y="{_TOP + 12 + LEGEND_ROWS * 16}" class="legend">'
                     f"and {len(series) - LEGEND_ROWS} more</text>")
    return _svg(title, parts)


def phase_bars(title: str, rows: Sequence[tuple[str, Sequence[float]]], phases: Sequence[str]) -> str:
    """One horizontal bar per ``(name, seconds of each phase)``, the phases stacked in order."""
    if not rows:
        return f'<p class="empty">{html.escape(title)}: no host started</p>'
    total = max(max(sum(seconds) for _, seconds in rows), 1e-9)
    bar, gap = 18, 6
    height = _TOP + len(rows) * (bar + gap) + _BOTTOM
    width = WIDTH - _LEFT - _RIGHT
    parts = [f'<text x="{_LEFT}" y="18" class="title">{html.escape(title)}</text>']
    for row_index, (name, seconds) in enumerate(rows):
        y = _TOP + row_index * (bar + gap)
        parts.append(f'<text x="{_LEFT - 6}" y="{y + 13}" class="axis" text-anchor="end">{html.escape(name[:10])}'
                     f"<title>{html.escape(name)}</title></text>")
        x = float(_LEFT)
        for index, (phase, value) in enumerate(zip(phases, seconds, strict=True)):
            length = value / total * width
            parts.append(f'<rect class="bar" x="{x:.1f}" y="{y}" width="{max(length, 0.5):.1f}" height="{bar}" '
                         f'fill="{PALETTE[index % len(PALETTE)]}"><title>{html.escape(name)}: {phase} '
                         f"{value:.2f} s</title></rect>")
            x += length
    for index, phase in enumerate(phases):
        y = _TOP + 6 + index * 16
        parts.append(f'<rect x="{WIDTH - _RIGHT + 12}" y="{y}" width="12" height="10" '
                     f'fill="{PALETTE[index % len(PALETTE)]}"/><text x="{WIDTH - _RIGHT + 30}" y="{y + 9}" '
                     f'class="legend">{html.escape(phase)}</text>')
    axis_y = _TOP + len(rows) * (bar + gap) + 14
    parts.append(f'<text x="{_LEFT}" y="{axis_y}" class="axis">0 s</text>'
                 f'<text x="{_LEFT + width}" y="{axis_y}" class="axis" text-anchor="end">{total:.2f} s</text>')
    return _svg(title, parts, height=max(height, _TOP + len(phases) * 16 + 12))


def _frame(title: str, y_label: str, x_max: float, y_max: float, percent: bool) -> str:
    """Title, axes, grid lines and their labels."""
    width, height = WIDTH - _LEFT - _RIGHT, HEIGHT - _TOP - _BOTTOM
    out = [f'<text x="{_LEFT}" y="18" class="title">{html.escape(title)}</text>',
           f'<line x1="{_LEFT}" y1="{_TOP + height}" x2="{_LEFT + width}" y2="{_TOP + height}" class="frame"/>',
           f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_TOP + height}" class="frame"/>']
    for step in range(5):
        fraction = step / 4
        y = _TOP + height - fraction * height
        label = f"{fraction:.0%}" if percent else _short(fraction * y_max)
        out.append(f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{_LEFT + width}" y2="{y:.1f}" class="grid"/>'
                   f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" class="axis" text-anchor="end">{label}</text>')
        x = _LEFT + fraction * width
        out.append(f'<text x="{x:.1f}" y="{_TOP + height + 16}" class="axis" text-anchor="middle">'
                   f"{fraction * x_max:.0f} s</text>")
    out.append(f'<text x="14" y="{_TOP + height / 2}" class="axis" transform="rotate(-90 14 {_TOP + height / 2})" '
               f'text-anchor="middle">{html.escape(y_label)}</text>')
    return "".join(out)


def _svg(title: str, parts: Sequence[str], height: int = HEIGHT) -> str:
    return (f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{html.escape(title)}">{"".join(parts)}</svg>')


def _nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 5 times a power of ten at or above ``value`` (1 for nothing)."""
    if value <= 0:
        return 1.0
    scale = 10 ** (len(str(int(value))) - 1) if value >= 1 else 0.1
    while True:
        for factor in (1, 2, 5):
            if factor * scale >= value:
                return float(factor * scale)
        scale *= 10


def _short(value: float) -> str:
    return f"{value / 1e3:.1f}k" if value >= 1e4 else f"{value:.4g}"
