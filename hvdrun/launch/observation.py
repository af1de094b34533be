"""What the launcher watches of a running job for tools and for afterwards: ``--metrics-port``, ``--metrics-file``
and ``--report`` (:mod:`hvdrun.observe`).

:func:`observed` wraps the supervision of one attempt: it opens the sinks before any rank starts (a port that
cannot be served is a usage error, nothing started), samples the ranks' vitals while they run, and writes the
report when the attempt ends, whichever way it ends.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from hvdrun.envvars import CPU_BIND, OMP_NUM_THREADS, Rendezvous
from hvdrun.errors import HvdrunError, JobInterrupted, WorkerFailed
from hvdrun.launch.base import WorkerSpec

if TYPE_CHECKING:
    from hvdrun.launch.output import OutputRouter
    from hvdrun.launch.plan import JobPlan
    from hvdrun.observe.report import Binding, JobRecord
    from hvdrun.observe.sampler import History, Sink

STACKS_HEADER = "hvdrun: stacks of "


class Observation:
    """One attempt as the launcher saw it: when it started, the last stacks report it printed.

    Args:
        started: when hvdrun began the attempt (wall clock).
        write: where hvdrun's own reports go.
    """

    def __init__(self, started: float, write: Callable[[str], None]) -> None:
        self.started = started
        self.reached: dict[str, float] = {}  # host -> when the launcher reached it (SSH)
        self.stacks: str | None = None
        self._write = write

    def write(self, text: str) -> None:
        """Write one of hvdrun's reports, keeping it when it is a stacks report (for the job report)."""
        if text.startswith(STACKS_HEADER):
            self.stacks = text.rstrip("\n")
        self._write(text)


@contextlib.contextmanager
def observed(plan: JobPlan, rendezvous: Rendezvous, specs: Sequence[WorkerSpec], router: OutputRouter,
             observation: Observation, attempt: int = 0) -> Iterator[None]:
    """Sample the job's vitals into the metrics sinks and the report's history while the ranks run; write the
    report when they end.

    Raises:
        UsageError: a metrics port or file that cannot be used (before any rank starts).
    """
    options = plan.options
    if not (options.metrics_port or options.metrics_file or options.report):
        yield
        return
    from hvdrun.observe.sampler import DEFAULT_INTERVAL_S, History, VitalsSampler

    with contextlib.ExitStack() as sinks:
        sampler = VitalsSampler(rendezvous.addr, rendezvous.port, rendezvous.secret,
                                options.metrics_interval_s or DEFAULT_INTERVAL_S,
                                _open_sinks(plan, rendezvous.job_id, sinks, observation.write),
                                History() if options.report else None)
        spawned = time.time()
        sampler.start()
        outcome, summary, code = "succeeded", "", 0
        try:
            yield
        except WorkerFailed as e:
            outcome, summary, code = "failed", str(e), e.exit_code
            raise
        except JobInterrupted as e:
            outcome, summary, code = "stopped", str(e), e.exit_code
            raise
        except HvdrunError as e:
            outcome, summary, code = "failed", str(e), e.exit_code
            raise
        except BaseException as e:
            outcome, summary, code = "stopped", f"{type(e).__name__}: {e}", 1
            raise
        finally:
            sampler.stop()
            if options.report and sampler.history is not None:

                record = _record(plan, rendezvous, specs, router, observation, spawned, attempt, sampler.history)
                record.outcome, record.summary, record.exit_code, record.ended = outcome, summary, code, time.time()
                _write_report(options.report, record, observation.write)


def _open_sinks(plan: JobPlan, job_id: str, stack: contextlib.ExitStack, warn: Callable[[str], None]) -> list[Sink]:
    """The metrics sinks ``plan`` asks for, closed with ``stack``."""
    from hvdrun.observe.metrics import JsonLinesFile, MetricsServer, parse_address

    options = plan.options
    sinks: list[Sink] = []
    if options.metrics_port:
        server = MetricsServer(*parse_address(options.metrics_port), job_id)
        stack.callback(server.close)
        warn(f"hvdrun: metrics of job {job_id} at http://{parse_address(options.metrics_port)[0]}:{server.port}"
             "/metrics\n")
        sinks.append(server)
    if options.metrics_file:
        lines = JsonLinesFile(options.metrics_file, job_id, lambda text: warn(text + "\n"))
        stack.callback(lines.close)
        sinks.append(lines)
    return sinks


def _record(plan: JobPlan, rendezvous: Rendezvous, specs: Sequence[WorkerSpec], router: OutputRouter,
            observation: Observation, spawned: float, attempt: int, history: History) -> JobRecord:
    from hvdrun.observe.report import JobRecord, StartupTimes

    first = history.first
    process_start = {rank: float(v["process_start"]) for rank, v in (first.ranks.items() if first else ())
                     if v.get("process_start")}
    startup = StartupTimes(observation.started, spawned, {s.slot.rank: s.slot.hostname for s in specs},
                           dict(observation.reached), dict(router.entered_init), dict(router.joined), process_start)
    return JobRecord(" ".join(plan.command), rendezvous.job_id, plan.launcher, attempt,
                     [_binding(spec) for spec in specs], startup, history, stacks=observation.stacks)


def _binding(spec: WorkerSpec) -> Binding:
    from hvdrun.observe.report import Binding

    slot = spec.slot
    threads = spec.env.get(OMP_NUM_THREADS)
    cpus = ", ".join(part for part in (f"bind {spec.env[CPU_BIND]}" if spec.env.get(CPU_BIND) else "",
                                       f"OMP_NUM_THREADS={threads}" if threads else "") if part)
    return Binding(slot.rank, slot.hostname, slot.local_rank, ",".join(slot.visible_devices or slot.devices), cpus)


def _write_report(path: str, record: JobRecord, write: Callable[[str], None]) -> None:
    from hvdrun.observe.report import write_report

    try:
        write_report(path, record)
    except OSError as e:
        write(f"hvdrun: warning: cannot write the report {path}: {e.strerror or e}\n")
        return
    write(f"hvdrun: report of job {record.job_id}: {path}\n")
