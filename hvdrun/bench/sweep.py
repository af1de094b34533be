"""``hvdrun bench``: how the allreduce scales over the job's hosts, next to gloo and MPI, in one run.

For every rank count (``--np 1,2,4``; default the powers of two up to the slots, and the slots),
one job on the first N slots of the plan times hvdrun's allreduce and then torch.distributed
gloo's in the same processes (:mod:`hvdrun.bench.bench_job`); when mpi4py and an mpiexec are
at hand, a second job started by mpiexec times MPI's. The report (:data:`SCHEMA`) has every
(library, ranks, size) time with its algorithm and bus bandwidth, hvdrun's speed-up over the
others, and the scaling efficiency of runs that span hosts against the largest run on one host.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hvdrun.bench.bench_job import LIBRARIES, RESULT_TAG
from hvdrun.errors import HvdrunError, UsageError
from hvdrun.launch.plan import JobPlan, RunOptions, plan_job
from hvdrun.measure.capture import run_captured
from hvdrun.measure.timing import bus_bandwidth

SCHEMA = "hvdrun-bench/1"
DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20)


@dataclass(frozen=True)
class BenchOptions:
    """``hvdrun bench``'s own options (the hosts and launcher are in ``run``)."""

    run: RunOptions
    rank_counts: tuple[int, ...] | None = None
    sizes: tuple[int, ...] = DEFAULT_SIZES
    libraries: tuple[str, ...] | None = None
    iterations: int = 5
    warmup: int = 2


@dataclass(frozen=True)
class BenchRow:
    """One library's median time for one size at one rank count."""

    library: str
    ranks: int
    hosts: int
    bytes: int
    seconds: float

    @property
    def algbw(self) -> float:
        """Bytes per second of the buffer: ``bytes / time``."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def busbw(self) -> float:
        """Bytes per second on each ring link (:func:`hvdrun.measure.timing.bus_bandwidth`)."""
        return bus_bandwidth(self.bytes, self.seconds, self.ranks)


@dataclass
class BenchReport:
    """Every row of a bench run, and what could not be measured."""

    rows: list[BenchRow] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    launcher: str = "local"

    def row(self, library: str, ranks: int, nbytes: int) -> BenchRow | None:
        """The row of ``library`` at ``ranks`` and ``nbytes``, if measured."""
        return next((r for r in self.rows if (r.library, r.ranks, r.bytes) == (library, ranks, nbytes)), None)

    def speedup(self, row: BenchRow, other: str) -> float | None:
        """How many times faster hvdrun's ``row`` is than ``other`` at the same ranks and size."""
        theirs = self.row(other, row.ranks, row.bytes)
        return theirs.seconds / row.seconds if theirs and row.seconds > 0 else None

    def efficiency(self) -> list[dict[str, Any]]:
        """Bus bandwidth of each multi-host run over that of the largest one-host run (>= 2 ranks), per
        library, at the largest size."""
        if not self.rows:
            return []
        largest = max(r.bytes for r in self.rows)
        found = []
        for library in sorted({r.library for r in self.rows}):
            mine = sorted((r for r in self.rows if r.library == library and r.bytes == largest), key=lambda r: r.ranks)
            base = next((r for r in reversed(mine) if r.hosts == 1 and r.ranks >= 2), None)
            for row in mine:
                if base is not None and row.hosts > 1 and base.busbw > 0:
                    found.append({"library": library, "bytes": largest, "ranks": row.ranks, "hosts": row.hosts,
                                  "baseline_ranks": base.ranks, "efficiency": row.busbw / base.busbw})
        return found

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (schema :data:`SCHEMA`)."""
        rows = []
        for row in self.rows:
            entry: dict[str, Any] = {**asdict(row), "algbw": row.algbw, "busbw": row.busbw}
            if row.library == "hvdrun":
                entry.update({f"speedup_vs_{other}": self.speedup(row, other) for other in ("gloo", "mpi")})
            rows.append(entry)
        return {"schema": SCHEMA, "launcher": self.launcher, "rows": rows, "efficiency": self.efficiency(),
                "skipped": self.skipped}

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)


def default_rank_counts(slots: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``slots``, and ``slots``."""
    counts, n = [], 1
    while n < slots:
        counts.append(n)
        n *= 2
    return (*counts, slots)


def mpi_available() -> bool:
    """mpi4py imports here (its mpiexec is found when the job starts)."""
    return importlib.util.find_spec("mpi4py") is not None


def _plan(options: BenchOptions, environ: Mapping[str, str], ranks: int | None, libraries: Sequence[str],
          launcher: str | None) -> JobPlan:
    args = ("--libraries", ",".join(libraries), "--sizes", ",".join(map(str, options.sizes)),
            "--iterations", str(options.iterations), "--warmup", str(options.warmup))
    run = replace(options.run, num_proc=ranks, command=("hvdrun.bench.bench_job", *args), module=True,
                  prefix_output=True, launcher=launcher or options.run.launcher)
    return plan_job(run, environ)


def plan_bench(options: BenchOptions, environ: Mapping[str, str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(rank counts, libraries) of the run; checks every option before anything starts. Without hosts
    (-H, hostfile, config, allocation) the ranks run on this machine.

    Raises:
        UsageError: a rank count above the slots, an unknown library, bad host options.
    """
    most = max(options.rank_counts) if options.rank_counts else None
    counts = options.rank_counts or default_rank_counts(len(_plan(options, environ, most, ["hvdrun"], None).slots))
    libraries = options.libraries or (("hvdrun", "gloo", "mpi") if mpi_available() else ("hvdrun", "gloo"))
    unknown = [lib for lib in libraries if lib not in LIBRARIES]
    if unknown:
        raise UsageError(f"--libraries: unknown {unknown[0]!r}; expected some of {', '.join(LIBRARIES)}")
    if "mpi" in libraries and not mpi_available():
        raise UsageError("--libraries mpi needs mpi4py (pip install 'hvdrun[mpi]')")
    for ranks in counts:  # every job's plan is valid (e.g. enough slots) before the first one runs
        _plan(options, environ, ranks, libraries, None)
    return tuple(counts), tuple(libraries)


def run_bench(options: BenchOptions, environ: Mapping[str, str],
              on_progress: Callable[[str], None] = lambda s: None) -> BenchReport:
    """Run every rank count's jobs; a library whose job fails is reported in ``skipped``, not raised."""
    counts, libraries = plan_bench(options, environ)
    report = BenchReport()
    for ranks in counts:
        jobs = [(lib,) for lib in libraries if lib == "mpi"]
        inside = tuple(lib for lib in libraries if lib != "mpi")
        for group, launcher in ([(inside, None)] if inside else []) + [(job, "mpiexec") for job in jobs]:
            on_progress(f"{' and '.join(group)} on {ranks} rank(s)")
            plan = _plan(options, environ, ranks, group, launcher)
            report.launcher = report.launcher if launcher else plan.launcher
            hosts = len({slot.host for slot in plan.slots})
            try:
                job = run_captured(plan)
            except HvdrunError as e:
                report.skipped.append(f"{'/'.join(group)} with {ranks} ranks: {e}")
                continue
            for result in job.rank0_results(RESULT_TAG):
                report.rows.append(BenchRow(result["library"], result["ranks"], hosts, result["bytes"],
                                            result["seconds"]))
            if job.error:
                report.skipped.append(f"{'/'.join(group)} with {ranks} ranks: {job.error}")
    return report
