"""The launcher's view of its running job: every rank's vitals sampled from rank 0 at a fixed interval (a daemon
thread), each sample's rates handed to the sinks (``--metrics-port``, ``--metrics-file``) and kept, thinned, for
the report (:class:`History`).

A sample that rank 0 does not answer (the ranks have not reached ``init()`` yet, or ended, or run with the MPI
backend and no rendezvous) is skipped; the sampler never holds up or fails the job.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hvdrun.errors import RendezvousError
from hvdrun.observe.rates import RankRates, Sample, fold_hosts, rates, take_sample

DEFAULT_INTERVAL_S = 5.0
MAX_POINTS = 600  # points kept per series: past it, every other one is dropped (the report's plots stay light)
RANK_SERIES_UP_TO = 64  # jobs of at most this many ranks keep a series per rank; larger ones per host

Sink = Callable[[Sample, list[RankRates]], None]


@dataclass
class History:
    """The job's rates over time, for the report: per rank (up to :data:`RANK_SERIES_UP_TO` ranks) and per host,
    ``[time, collectives per s, wait share]`` points; the first and last samples (start-up times, straggler
    scores)."""

    ranks: dict[int, list[tuple[float, float, float]]] = field(default_factory=dict)
    hosts: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    first: Sample | None = None
    last: Sample | None = None

    def add(self, sample: Sample, rows: list[RankRates]) -> None:
        """Keep one sample's rates."""
        self.first = self.first or sample
        self.last = sample
        if sample.size <= RANK_SERIES_UP_TO:
            for row in rows:
                _append(self.ranks.setdefault(row.rank, []), (sample.time, row.collectives_per_s, row.wait_share))
        for host in fold_hosts(rows):
            _append(self.hosts.setdefault(host.host, []),
                    (sample.time, host.collectives_per_s_per_rank, host.mean_wait_share))


def _append(series: list[tuple[float, float, float]], point: tuple[float, float, float]) -> None:
    series.append(point)
    if len(series) > MAX_POINTS:
        del series[1::2]


class VitalsSampler:
    """Samples the job whose rank 0 serves ``addr:port`` every ``interval_s`` until :meth:`stop`.

    Args:
        sinks: called with each sample and its rates (the first sample has none and is not passed on).
        history: where the samples are kept for the report; None: not kept.
    """

    def __init__(self, addr: str, port: int, secret: str, interval_s: float, sinks: Sequence[Sink],
                 history: History | None = None, warn: Callable[[str], None] = lambda text: None) -> None:
        self._target = (addr, port, secret)
        self._interval_s, self._sinks, self.history = interval_s, list(sinks), history
        self._warn, self._warned = warn, False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hvdrun-vitals", daemon=True)

    def start(self) -> None:
        """Start sampling."""
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling (waits for a sample in progress, a few seconds at most)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(10.0)

    def _run(self) -> None:
        before: Sample | None = None
        while not self._stopped.wait(self._interval_s if before else min(self._interval_s, 1.0)):
            try:
                before = self._sample(before)
            except (OSError, ValueError, EOFError, RendezvousError):
                continue  # rank 0 not there (yet, or any more)
            except Exception as e:  # noqa: BLE001 - an odd answer or a sink's failure: say it once, go on
                if not self._warned:
                    self._warned = True
                    self._warn(f"hvdrun: warning: a sample of the ranks' vitals failed ({type(e).__name__}: {e}); "
                               "the job goes on\n")

    def _sample(self, before: Sample | None) -> Sample | None:
        """Take one sample; hand its rates to the sinks and the history; the sample the next rates start from."""
        after = take_sample(*self._target)
        if not after.ranks:
            return before
        if before is not None:
            rows = rates(before, after)
            for sink in self._sinks:
                sink(after, rows)
            if self.history is not None:
                self.history.add(after, rows)
        return after
