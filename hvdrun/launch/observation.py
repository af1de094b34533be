"""What the launcher watches of a job for tools and for afterwards: ``--metrics-port``, ``--metrics-file`` and
``--report`` (:mod:`hvdrun.observe`).

:func:`observed` wraps one attempt from its start: it opens the metrics sinks before any host is reached (a port
that cannot be served is a usage error, nothing started), :meth:`Observation.ranks_starting` starts sampling the
ranks' vitals once rank 0's address is known, and the report is written when the attempt ends, whichever way it
ends (a host that cannot be reached included).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from hvdrun.envvars import CPU_BIND, OMP_NUM_THREADS, Rendezvous
from hvdrun.errors import HvdrunError, JobInterrupted
from hvdrun.interrupts import interrupted_before_ranks
from hvdrun.launch.launcher import WorkerSpec
from hvdrun.protocol.inspection import STACKS_HEADER

if TYPE_CHECKING:
    from hvdrun.launch.output import OutputRouter
    from hvdrun.launch.plan import JobPlan
    from hvdrun.observe.report import Binding, JobRecord
    from hvdrun.observe.sampler import History, Sink, VitalsSampler
    from hvdrun.ranks import Slot


class Observation:
    """One attempt as the launcher saw it: when it started, reached each host and started the ranks, the last stacks
    report it printed, and the sampling of the ranks' vitals.

    Args:
        plan: the attempt's plan (its options say what to watch).
        job_id: the attempt's id (names the report).
        run_id: the job's id across restarts (the ``job`` label of every metric).
        router: the ranks' output (it notes when each rank entered ``init()`` and joined).
        write: where hvdrun's own reports go.
    """

    def __init__(self, plan: JobPlan, job_id: str, router: OutputRouter, write: Callable[[str], None],
                 attempt: int = 0, run_id: str = "") -> None:
        self.plan, self.job_id, self.router, self.attempt = plan, job_id, router, attempt
        self.run_id = run_id or job_id
        self.started, self.spawned = time.time(), 0.0
        self.reached: dict[str, float] = {}  # host -> when the launcher reached it (SSH)
        self.stacks: str | None = None
        self.specs: Sequence[WorkerSpec] = ()
        self.sinks: list[Sink] = []
        self.history: History | None = None
        self._sampler: VitalsSampler | None = None
        self._write = write

    @property
    def wanted(self) -> bool:
        """Whether the plan asks for metrics or a report."""
        options = self.plan.options
        return bool(options.metrics_port or options.metrics_file or options.report)

    def write(self, text: str) -> None:
        """Write one of hvdrun's reports, keeping it when it is a stacks report (for the job report)."""
        if text.startswith(STACKS_HEADER):
            self.stacks = text.rstrip("\n")
        self._write(text)

    def ranks_starting(self, rendezvous: Rendezvous, specs: Sequence[WorkerSpec], reached: dict[str, float]) -> None:
        """The ranks are about to start (rank 0 will serve ``rendezvous``): sample them from now on."""
        self.specs, self.reached, self.spawned = specs, reached, time.time()
        if not self.wanted:
            return
        from hvdrun.observe.sampler import DEFAULT_INTERVAL_S, VitalsSampler

        self._sampler = VitalsSampler(rendezvous.addr, rendezvous.port, rendezvous.secret,
                                      self.plan.options.metrics_interval_s or DEFAULT_INTERVAL_S, self.sinks,
                                      self.history, self.write)
        self._sampler.start()

    def stop_sampling(self) -> None:
        """The attempt ended: no more samples."""
        if self._sampler is not None:
            self._sampler.stop()


@contextlib.contextmanager
def observed(observation: Observation) -> Iterator[None]:
    """Open the metrics sinks the plan asks for, and write the report when the attempt ends.

    Raises:
        UsageError: a metrics port or file that cannot be used (before anything starts).
    """
    if not observation.wanted:
        yield
        return
    report = observation.plan.options.report
    with contextlib.ExitStack() as sinks:
        observation.sinks.extend(_open_sinks(observation, sinks))
        if report:
            from hvdrun.observe.sampler import History

            observation.history = History()
        outcome, summary, code = "succeeded", "", 0
        try:
            yield
        except JobInterrupted as e:
            outcome, summary, code = "stopped", str(e), e.exit_code
            raise
        except HvdrunError as e:  # a failed rank, a host that cannot run ranks
            outcome, summary, code = "failed", str(e), e.exit_code
            raise
        except KeyboardInterrupt as e:  # a stop signal while reaching the hosts (job.py raises the same error)
            stopped = interrupted_before_ranks(e)
            outcome, summary, code = "stopped", str(stopped), stopped.exit_code
            raise
        except BaseException as e:  # what hvdrun did not foresee
            outcome, summary, code = "failed", f"{type(e).__name__}: {e}", 1
            raise
        finally:
            observation.stop_sampling()
            if report:
                _write_report(report, observation, (outcome, summary, code))


def _open_sinks(observation: Observation, stack: contextlib.ExitStack) -> list[Sink]:
    """The metrics sinks the plan asks for, closed with ``stack``."""
    from hvdrun.observe.metrics import JsonLinesFile, MetricsServer, open_to_the_network, parse_address

    options, job_id, warn = observation.plan.options, observation.run_id, observation.write
    sinks: list[Sink] = []
    if options.metrics_port:
        addr, port = parse_address(options.metrics_port)
        server = MetricsServer(addr, port, job_id)
        stack.callback(server.close)
        warn(f"hvdrun: metrics of job {job_id} at http://{addr}:{server.port}/metrics\n")
        if open_to_the_network(addr):
            warn(f"hvdrun: warning: --metrics-port {options.metrics_port} serves the page to the network without "
                 "authentication (anyone who reaches this machine reads the job's hosts, ranks and rates); give "
                 f"127.0.0.1:{server.port} to keep it on this machine\n")
        sinks.append(server)
    if options.metrics_file:
        lines = JsonLinesFile(options.metrics_file, job_id, lambda text: warn(text + "\n"))
        stack.callback(lines.close)
        sinks.append(lines)
    return sinks


def _record(observation: Observation) -> JobRecord:
    from hvdrun.observe.report import JobRecord, StartupTimes
    from hvdrun.observe.sampler import History

    plan, router = observation.plan, observation.router
    history = observation.history or History()
    first = history.first
    process_start = {rank: float(v["process_start"]) for rank, v in (first.ranks.items() if first else ())
                     if v.get("process_start")}
    spawned = observation.spawned or observation.started  # never started: no phase after reaching the hosts
    startup = StartupTimes(observation.started, spawned, {slot.rank: slot.hostname for slot in plan.slots},
                           dict(observation.reached), dict(router.entered_init), dict(router.joined), process_start)
    bindings = ([_binding(spec.slot, spec.env) for spec in observation.specs] if observation.specs
                else [_binding(slot, {}) for slot in plan.slots])  # never started: where they would have run
    return JobRecord(" ".join(plan.command), observation.job_id, plan.launcher, observation.attempt, bindings,
                     startup, history, stacks=observation.stacks)


def _binding(slot: Slot, env: Mapping[str, str]) -> Binding:
    """Where a rank ran: its host, GPUs and, from its environment, its CPU binding and threads."""
    from hvdrun.observe.report import Binding

    threads = env.get(OMP_NUM_THREADS)
    cpus = ", ".join(part for part in (f"bind {env[CPU_BIND]}" if env.get(CPU_BIND) else "",
                                       f"OMP_NUM_THREADS={threads}" if threads else "") if part)
    return Binding(slot.rank, slot.hostname, slot.local_rank, ",".join(slot.visible_devices or slot.devices), cpus)


def _write_report(path: str, observation: Observation, ending: tuple[str, str, int]) -> None:
    """Write the report of the attempt that ended as ``ending`` (outcome, summary, exit code); a report that cannot
    be written is a warning, never an error that would hide the job's own."""
    from hvdrun.observe.report import write_report

    try:
        record = _record(observation)
        (record.outcome, record.summary, record.exit_code), record.ended = ending, time.time()
        write_report(path, record)
    except OSError as e:
        observation.write(f"hvdrun: warning: cannot write the report {path}: {e.strerror or e}\n")
        return
    except Exception as e:  # noqa: BLE001 - the job's outcome, not the report's failure, is hvdrun's error
        observation.write(f"hvdrun: warning: the report {path} failed ({type(e).__name__}: {e})\n")
        return
    observation.write(f"hvdrun: report of job {observation.job_id}: {path}\n")
