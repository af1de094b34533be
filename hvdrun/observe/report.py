"""The job report (``--report job.html``): one self-contained HTML file written when the job ends, whether it
succeeded, failed or was stopped.

It holds the command, the hosts, ranks and bindings; each host's start-up phases (connect, stage, spawn, import,
rendezvous); every rank's (or, past 64 ranks, every host's) collectives per second and wait share over the job,
as plots (:mod:`hvdrun.observe.charts`); the straggler table; the failure summary and the last stacks report.
Nothing is fetched and no script is needed to read it (one small script only marks how many plots were drawn, for
a headless browser's check): it opens on a login node's browser or copied home. It shows the command line as
given, arguments included.
"""

from __future__ import annotations

import html
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hvdrun.atomic_files import write_text_atomically
from hvdrun.observe.charts import line_chart, phase_bars
from hvdrun.observe.sampler import History

PHASES = ("connect", "stage", "spawn", "import", "rendezvous")


@dataclass(frozen=True)
class Binding:
    """Where one rank ran: its host, local rank, GPUs and CPUs (as the launcher set them)."""

    rank: int
    host: str
    local_rank: int
    gpus: str
    cpus: str


@dataclass(frozen=True)
class StartupTimes:
    """When each step of the start-up happened, on the launcher's clock (wall seconds) except ``process_start``
    (each rank's own clock, from its vitals): ``reached`` host -> its connection ready (SSH), ``spawned`` when the
    ranks were started, ``entered``/``joined`` rank -> it entered ``init()`` / its rendezvous completed."""

    started: float
    spawned: float
    host_of: Mapping[int, str]
    reached: Mapping[str, float] = field(default_factory=dict)
    entered: Mapping[int, float] = field(default_factory=dict)
    joined: Mapping[int, float] = field(default_factory=dict)
    process_start: Mapping[int, float] = field(default_factory=dict)

    def phases(self) -> list[tuple[str, list[float]]]:
        """Seconds of each of :data:`PHASES` per host (hosts in rank order); a phase not reached counts 0."""
        ranks_of: dict[str, list[int]] = {}
        for rank, host in sorted(self.host_of.items()):
            ranks_of.setdefault(host, []).append(rank)
        return [(host, self._host_phases(host, ranks)) for host, ranks in ranks_of.items()]

    def _host_phases(self, host: str, ranks: Sequence[int]) -> list[float]:
        reached = self.reached.get(host, self.started)
        connect, stage = reached - self.started, self.spawned - reached
        entered = [self.entered[r] for r in ranks if r in self.entered]
        joined = [self.joined[r] for r in ranks if r in self.joined]
        began = [self.process_start[r] for r in ranks if r in self.process_start]
        last_entered = max(entered) if entered else self.spawned
        spawn = min(max(min(began) - self.spawned, 0.0), last_entered - self.spawned) if began else 0.0
        imports = last_entered - self.spawned - spawn
        rendezvous = max(joined) - last_entered if joined and entered else 0.0
        return [max(value, 0.0) for value in (connect, stage, spawn, imports, rendezvous)]


@dataclass
class JobRecord:
    """Everything the report shows of one job (one attempt of a job with restarts)."""

    command: str
    job_id: str
    launcher: str
    attempt: int
    bindings: list[Binding]
    startup: StartupTimes
    history: History
    outcome: str = "running"  # succeeded | failed | stopped
    summary: str = ""  # the failure, as hvdrun printed it
    exit_code: int = 0
    ended: float | None = None
    stacks: str | None = None  # the last stacks report hvdrun printed


def write_report(path: str | Path, job: JobRecord) -> None:
    """Write the report atomically (a reader never sees half a file), under the user's umask."""
    write_text_atomically(path, render(job))


def render(job: JobRecord) -> str:
    """The report as one HTML document."""
    sections = [_summary(job), _bindings(job.bindings), _startup(job), _throughput(job), _stragglers(job)]
    if job.summary:
        sections.append(f"<h2>Failure</h2><pre>{html.escape(job.summary)}</pre>")
    if job.stacks:
        sections.append(f"<h2>Last stacks report</h2><pre>{html.escape(job.stacks)}</pre>")
    title = f"hvdrun job {job.job_id}: {job.outcome}"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_STYLE}</style></head>'
            f"<body><h1>{html.escape(title)}</h1>{''.join(sections)}<script>{_CHECK_PLOTS}</script></body></html>\n")


def _summary(job: JobRecord) -> str:
    ended = job.ended or time.time()
    rows = [("command", job.command), ("job", job.job_id + (f", attempt {job.attempt}" if job.attempt else "")),
            ("launcher", job.launcher), ("ranks", str(len(job.bindings))),
            ("hosts", str(len({b.host for b in job.bindings}))),
            ("started", _clock(job.startup.started)), ("ended", _clock(ended)),
            ("took", f"{ended - job.startup.started:.1f} s"),
            ("outcome", job.outcome + (f" (exit code {job.exit_code})" if job.exit_code else ""))]
    return _table(("", ""), rows, cls="facts")


def _bindings(bindings: Sequence[Binding]) -> str:
    rows = [(str(b.rank), b.host, str(b.local_rank), b.gpus or "-", b.cpus or "-") for b in bindings]
    return "<h2>Hosts, ranks and bindings</h2>" + _table(("rank", "host", "local rank", "GPUs", "CPUs"), rows)


def _startup(job: JobRecord) -> str:
    phases = job.startup.phases()
    rows = [(host, *(f"{value:.2f}" for value in seconds), f"{sum(seconds):.2f}") for host, seconds in phases]
    return ("<h2>Start-up per host</h2>"
            + phase_bars("seconds from hvdrun's start until every rank of the host joined", phases, PHASES)
            + _table(("host", *(f"{p} (s)" for p in PHASES), "total (s)"), rows)
            + "<p class=\"note\">connect: until the host was reached (SSH); stage: until the ranks were started "
              "(staging, the other hosts); spawn: until the host's first rank process ran; import: until its last "
              "rank entered init(); rendezvous: until its last rank joined the job.</p>")


def _throughput(job: JobRecord) -> str:
    history = job.history
    per_rank = bool(history.ranks)
    series = ({f"rank {rank}": points for rank, points in sorted(history.ranks.items())} if per_rank
              else dict(history.hosts.items()))
    rates = {name: [(t, c) for t, c, _ in points] for name, points in series.items()}
    waits = {name: [(t, w) for t, _, w in points] for name, points in series.items()}
    who = "rank" if per_rank else "host (its ranks' mean)"
    start = job.startup.started
    return ("<h2>Collectives and waiting over time</h2>"
            + line_chart(f"collectives per second, per {who}", rates, "collectives / s", start=start)
            + line_chart(f"share of time waiting for collectives, per {who}", waits, "wait share", percent=True,
                         start=start))


def _stragglers(job: JobRecord) -> str:
    last = job.history.last
    scores = last.stragglers if last else {}
    ranks = scores.get("ranks", {})
    host_of = job.startup.host_of
    rows = [(str(rank), host_of.get(int(rank), "?"), f"{share:.0%}", f"{lag * 1e3:.1f}", "yes" if flagged else "")
            for rank, (share, lag, flagged) in sorted(ranks.items(), key=lambda item: -item[1][0])[:20]]
    said = "".join(f"<li>{_clock(at)} {html.escape(line)}</li>" for at, line in scores.get("said", []))
    window = scores.get("window", 0)
    body = (_table(("rank", "host", "came last", "after the median (ms)", "straggler"), rows) if rows else
            "<p>No rank came last in the window's collectives (or the job ended before a sample).</p>")
    return (f"<h2>Stragglers</h2><p class=\"note\">From rank 0's window of the last {window} collectives at the "
            f"last sample.</p>{body}" + (f"<ul>{said}</ul>" if said else "<p>No straggler was named.</p>"))


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    head = "" if not any(header) else "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{cls}">{head}{body}</table>'


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:980px;color:#222}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}td,th{border:1px solid #ddd;padding:2px 8px;text-align:left}
table.facts td:first-child{font-weight:600}pre{background:#f6f6f6;padding:.6em;overflow-x:auto;font-size:.85em}
.note{color:#555;font-size:.85em}.empty{color:#777}svg.plot{display:block;margin:.6em 0}
svg .title{font-size:13px;font-weight:600}svg .axis,svg .legend{font-size:11px;fill:#333}
svg .frame{stroke:#444}svg .grid{stroke:#eee}
"""

# Marks the body with how many plots there are and how many have something drawn: a check for a headless browser.
_CHECK_PLOTS = """
(function(){var plots=document.querySelectorAll('svg.plot'),drawn=0;
for(var i=0;i<plots.length;i++){var b=plots[i].getBBox();
if(b.width>0&&b.height>0&&plots[i].querySelector('polyline,rect.bar'))drawn++;}
document.body.setAttribute('data-plots',plots.length);document.body.setAttribute('data-drawn',drawn);})();
"""
