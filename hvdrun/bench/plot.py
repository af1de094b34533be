"""The picture of a bench run: bus bandwidth against message size, a line per library and rank count."""

from __future__ import annotations

from pathlib import Path

from hvdrun.bench.sweep import BenchReport

_COLOURS = {"hvdrun": "tab:blue", "gloo": "tab:orange", "mpi": "tab:green"}
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def size_label(nbytes: int) -> str:
    """``4K``, ``64M``, ``1G``: the tick labels."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def plot_bench(report: BenchReport, path: str | Path, title: str = "") -> Path:
    """Write the PNG at ``path``: bus bandwidth (GB/s) vs size (log scale); one-rank runs, which move
    no data, are left out. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    counts = sorted({r.ranks for r in report.rows if r.ranks > 1})
    for library in sorted({r.library for r in report.rows}):
        for index, ranks in enumerate(counts):
            rows = sorted((r for r in report.rows if r.library == library and r.ranks == ranks), key=lambda r: r.bytes)
            if rows:
                hosts = rows[0].hosts
                ax.plot([r.bytes for r in rows], [r.busbw / 1e9 for r in rows], marker=_MARKERS[index % len(_MARKERS)],
                        color=_COLOURS.get(library), linestyle="-" if library == "hvdrun" else "--",
                        label=f"{library}, {ranks} ranks on {hosts} host{'s' if hosts > 1 else ''}")
    sizes = sorted({r.bytes for r in report.rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [size_label(s) for s in sizes])
    ax.set_xlabel("message size (bytes, float32 sum)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title or "allreduce bus bandwidth: hvdrun vs gloo vs MPI")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "one-rank runs only: no data moves", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out
