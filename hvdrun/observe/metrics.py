"""Metrics for tools: the live view's numbers served in Prometheus' text format (``--metrics-port``, by the
``prometheus_client`` library) and appended as JSON lines (``--metrics-file``, for sites where no port can be
reached). Both are sinks of the launcher's :class:`~hvdrun.observe.sampler.VitalsSampler`.
"""

from __future__ import annotations

import ipaddress
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hvdrun.errors import UsageError
from hvdrun.observe.rates import RankRates, Sample, fold_hosts

DEFAULT_ADDR = "127.0.0.1"

# name, help, the RankRates attribute; gauges of the last interval
_GAUGES = (
    ("collectives_per_second", "Collectives the rank submitted per second, last interval", "collectives_per_s"),
    ("bytes_per_second", "Bytes of the collectives the rank submitted per second", "bytes_per_s"),
    ("wait_share", "Share of the interval the rank's threads were blocked waiting for collectives", "wait_share"),
    ("optimizer_steps_per_second", "Optimizer steps per second", "steps_per_s"),
    ("resident_memory_bytes", "Resident memory of the rank's process", "rss"),
    ("gpu_memory_bytes", "GPU memory torch holds on the rank's device", "gpu_bytes"),
    ("last_arrival_share", "Share of the straggler window's collectives the rank came last in", "last_share"),
    ("straggler", "1 when rank 0's straggler watch flags the rank", "straggler"),
)
_COUNTERS = (
    ("collectives", "Collectives the rank submitted since init()", "collectives"),
    ("optimizer_steps", "Optimizer steps since init()", "steps"),
)


def parse_address(text: str) -> tuple[str, int]:
    """``PORT`` or ``ADDR:PORT`` (``0.0.0.0:9400`` serves every interface; the default is this machine only).

    Raises:
        UsageError: not a port number.
    """
    addr, _, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise UsageError(f"--metrics-port {text!r}: expected PORT or ADDR:PORT with a port from 0 to 65535")
    return addr.strip("[]") or DEFAULT_ADDR, number


def open_to_the_network(addr: str) -> bool:
    """Whether a page served at ``addr`` can be read from other machines (anything but a loopback address or
    ``localhost``)."""
    if addr == "localhost":
        return False
    try:
        return not ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name: whatever it resolves to, it was named to be reached
        return True


class _Collector:
    """Yields the latest sample's metrics when Prometheus scrapes."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.latest: tuple[Sample, list[RankRates]] | None = None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        latest = self.latest
        size = GaugeMetricFamily("hvdrun_job_ranks", "Ranks of the job", labels=["job"])
        reporting = GaugeMetricFamily("hvdrun_job_ranks_reporting", "Ranks that answered the last sample",
                                      labels=["job"])
        if latest is None:
            yield size
            yield reporting
            return
        sample, rows = latest
        size.add_metric([self.job_id], sample.size)
        reporting.add_metric([self.job_id], len(sample.ranks))
        yield size
        yield reporting
        labels = ["job", "rank", "host"]
        for name, text, attribute in _GAUGES:
            gauge = GaugeMetricFamily(f"hvdrun_rank_{name}", text, labels=labels)
            for row in rows:
                value = getattr(row, attribute)
                if value is not None:
                    gauge.add_metric([self.job_id, str(row.rank), row.host], float(value))
            yield gauge
        for name, text, attribute in _COUNTERS:
            counter = CounterMetricFamily(f"hvdrun_rank_{name}", text, labels=labels)
            for row in rows:
                counter.add_metric([self.job_id, str(row.rank), row.host], float(getattr(row, attribute)))
            yield counter


class MetricsServer:
    """Serves the job's metrics at ``http://ADDR:PORT/metrics`` until :meth:`close`.

    Raises:
        UsageError: the address cannot be served (a port in use, an address not of this machine).
    """

    def __init__(self, addr: str, port: int, job_id: str) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self._collector = _Collector(job_id)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self._collector)  # type: ignore[arg-type]
        try:
            self._server, self._thread = start_http_server(port, addr, registry)
        except OSError as e:
            raise UsageError(f"--metrics-port: cannot serve metrics on {addr}:{port}: {e.strerror or e}") from None
        self.port = self._server.server_port

    def __call__(self, sample: Sample, rows: list[RankRates]) -> None:
        """A sink: the next scrape sees this sample."""
        self._collector.latest = (sample, rows)

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


class JsonLinesFile:
    """Appends one JSON line per sample to ``path`` (``{"time", "job_id", "size", "ranks": [...], "hosts": [...]}``).

    Raises:
        UsageError: the file cannot be opened for appending.
    """

    def __init__(self, path: str, job_id: str, warn: Callable[[str], None]) -> None:
        self.path, self.job_id, self._warn = Path(path), job_id, warn
        self._lock = threading.Lock()
        try:
            self._file = self.path.open("a", encoding="utf-8")
        except OSError as e:
            raise UsageError(f"--metrics-file {path}: cannot append to it: {e.strerror or e}") from None
        self._failed = False

    def __call__(self, sample: Sample, rows: list[RankRates]) -> None:
        """A sink: one line for this sample."""
        line = json.dumps({"time": sample.time, "job_id": self.job_id, "size": sample.size,
                           "ranks": [row.as_dict() for row in rows],
                           "hosts": [host.as_dict() for host in fold_hosts(rows)]})
        with self._lock:
            try:
                self._file.write(line + "\n")
                self._file.flush()
            except (OSError, ValueError) as e:
                if not self._failed:  # a full disk: the job goes on, without its metrics
                    self._failed = True
                    self._warn(f"hvdrun: warning: cannot append to --metrics-file {self.path}: {e}; the job goes on")

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._file.close()
