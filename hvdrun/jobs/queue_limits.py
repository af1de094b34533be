"""Queue limits: ask the scheduler, then the YAML.

``hvdrun qsub`` checks a job's nodes and walltime against its queue before the queue sees it. The scheduler
knows its queues; the cluster YAML (``scheduler.queues``) holds facts that go stale. So:

1. When the scheduler's command is on PATH, the server is asked once, with a short timeout, for every queue
   and its limits (:meth:`~hvdrun.jobs.scheduler.Scheduler.ask_queues`: PBS ``qstat -Qf -F json``, Slurm ``scontrol
   show partition``). A laptop without them is not asked and the YAML decides, silently.
2. A limit the server states decides; one it does not state (a PBS queue without ``resources_max.walltime``,
   Sophia's by-gpu sizes, which a hook enforces) is the YAML's. A server that does not answer, or answers in a
   form hvdrun cannot read, leaves the YAML to decide, with a one-line notice.
3. When the server and the YAML disagree on the verdict or on a limit, the error or the notice says which
   source decided: ``-t/--walltime 05:00:00: queue 'prod' on aurora (from the PBS server: qstat -Qf -F json)
   sends 10 nodes to 'tiny' (1-512 nodes), which allows at most 04:00:00; the YAML (aurora.yaml) would allow
   it``. A queue the server does not have is an error that lists the server's queues.

The server here may not be the cluster's (a dry run for Aurora on a Polaris login node): a PBS server whose
name names another shipped cluster and not this one is not believed (a notice says so).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from hvdrun.config import QueueLimits, QueueRoute, SchedulerDefaults, available_clusters, format_hms, load_cluster
from hvdrun.errors import HvdrunError, UsageError
from hvdrun.jobs import scheduler_for
from hvdrun.schedulers import PBS

ASK_TIMEOUT_S = 5.0  # a server slower than this leaves the YAML to decide (scontrol alone retries for 9 s)
_LIMIT_FIELDS = ("min_nodes", "max_nodes", "max_walltime_s", "routes")


@dataclass(frozen=True)
class ServerQueue:
    """One queue (Slurm: partition) as its scheduler states it.

    Attributes:
        name: the queue's name.
        limits: its limits, in the cluster YAML's shape (a routing queue's ``routes`` are its destinations).
        stated: the :class:`QueueLimits` fields the server states; a stated ``None`` means "no limit".
        route_only: it takes jobs only from a routing queue (PBS ``from_route_only``).
        enabled: it accepts jobs now (PBS ``enabled``; Slurm ``State`` other than INACTIVE or DRAIN).
    """

    name: str
    limits: QueueLimits
    stated: frozenset[str] = frozenset(_LIMIT_FIELDS)
    route_only: bool = False
    enabled: bool = True


@dataclass(frozen=True)
class ServerQueues:
    """Every queue one server states, and how it was asked.

    Attributes:
        source: who answered, e.g. ``the PBS server``.
        command: what answered, e.g. ``qstat -Qf -F json``.
        queues: the queues by name.
        noun: what the scheduler calls a queue (``queue``, ``partition``).
        default: the queue a job without one goes to, when the answer names it (Slurm's ``Default=YES``).
        server: the server's name, when the answer gives it (PBS ``pbs_server``).
    """

    source: str
    command: str
    queues: Mapping[str, ServerQueue]
    noun: str = "queue"
    default: str | None = None
    server: str | None = None

    @property
    def label(self) -> str:
        """``the PBS server (qstat -Qf -F json)``."""
        return f"{self.source} ({self.command})"


@dataclass(frozen=True)
class ServerAnswer:
    """What asking gave: the queues, or why there are none (``problem``; both None: not asked)."""

    queues: ServerQueues | None = None
    problem: str | None = None


@dataclass(frozen=True)
class QueueDecision:
    """The limits a job was checked against (``unit`` counts ``-n``) and the notices to show the user."""

    limits: QueueLimits | None
    notices: tuple[str, ...] = ()


@dataclass(frozen=True)
class QueueJob:
    """The job being checked, and the YAML facts about its machine."""

    queue: str | None
    nodes: int
    walltime_s: int | None
    cluster: str
    defaults: SchedulerDefaults
    yaml_source: str | None = None  # the cluster YAML's path (None: no YAML)


@dataclass(frozen=True)
class Refusal:
    """Why a job does not fit: ``{asked}: {where} (from {source}) {rule}``."""

    asked: str
    where: str
    rule: str
    source: str = ""
    from_server: bool = False

    def __str__(self) -> str:
        tag = f" (from {self.source})" if self.source else ""
        return f"{self.asked}: {self.where}{tag} {self.rule}"


@dataclass(frozen=True)
class _Sourced:
    """Queue limits and, for each field, the source that stated it (empty: no server answered)."""

    limits: QueueLimits | None
    sources: Mapping[str, str] = field(default_factory=dict)
    server_fields: frozenset[str] = frozenset()

    def source(self, name: str) -> str:
        return self.sources.get(name, "")


def ask_scheduler(kind: str, queue: str | None, timeout_s: float | None = None) -> ServerAnswer:
    """Ask scheduler ``kind`` for its queues when its command is on PATH (the patch point of unit tests).

    Not asked (an empty answer): the command is missing, the scheduler has no such command (Cobalt), or no
    queue was named and the scheduler names no default. ``timeout_s``: :data:`ASK_TIMEOUT_S` by default.
    """
    backend = scheduler_for(kind)
    argv = backend.queue_limits_argv()
    if argv is None or shutil.which(argv[0]) is None or (queue is None and not backend.names_default_queue):
        return ServerAnswer()
    try:
        return ServerAnswer(backend.ask_queues(timeout_s or ASK_TIMEOUT_S))
    except HvdrunError as e:
        return ServerAnswer(problem=str(e).splitlines()[0])


def decide(job: QueueJob, answer: ServerAnswer) -> QueueDecision:
    """Check ``job`` against the server's limits where it stated them, else the YAML's.

    Raises:
        UsageError: the job does not fit, or the queue is unknown; the message names the source that decided.
    """
    notices = [_not_asked(job, answer.problem)] if answer.problem else []
    server = answer.queues
    if server is not None and job.yaml_source and _other_machine(server.server, job.cluster):
        notices.append(f"{server.source} here ({server.server}) is not {job.cluster}'s: queue limits come from "
                       f"the YAML ({job.yaml_source}) only")
        server = None
    queue = job.queue if job.queue is not None or server is None else server.default
    if server is None or queue is None:
        return QueueDecision(_check_yaml(job), tuple(notices))
    return _decide_with_server(job, server, queue, notices)


def _not_asked(job: QueueJob, problem: str) -> str:
    yaml = f"the YAML ({job.yaml_source})" if job.yaml_source else "no queue limits (no cluster YAML)"
    return f"could not ask the scheduler for queue limits ({problem}); checked against {yaml} only"


def _other_machine(server: str | None, cluster: str) -> bool:
    """True when the server's name (``polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov``) names another shipped PBS
    cluster and not ``cluster``: its queues are not the job's."""
    if not server:
        return False
    words = set(re.split(r"[^a-z0-9]+", server.lower()))
    if cluster.lower() in words:
        return False
    return any(name in words for name in available_clusters() if name != cluster and _is_pbs_cluster(name))


def _is_pbs_cluster(name: str) -> bool:
    try:
        scheduler = load_cluster(name).scheduler
    except HvdrunError:
        return False
    return scheduler is not None and scheduler.kind == PBS


def _check_yaml(job: QueueJob) -> QueueLimits | None:
    """The check of the YAML alone (no server answered), with today's messages."""
    limits = job.defaults.queues.get(job.queue) if job.queue else None
    if job.queue is not None and job.defaults.queues and limits is None:
        raise UsageError(f"-q/--queue {job.queue!r} is not a queue of {job.cluster}; allowed: "
                         f"{', '.join(job.defaults.queues)}")
    refusal = _refuse(_Sourced(limits), job, _where(job.queue, job.cluster))
    if refusal:
        raise UsageError(str(refusal))
    return limits


def _where(queue: str | None, cluster: str, default: bool = False) -> str:
    if queue is None:
        return cluster
    return f"queue {queue!r}{' (the default)' if default else ''} on {cluster}"


def _decide_with_server(job: QueueJob, server: ServerQueues, queue: str, notices: list[str]) -> QueueDecision:
    stated = _server_queue(job, server, queue)
    yaml = job.defaults.queues.get(queue)
    yaml_label = f"the YAML ({job.yaml_source})"
    if yaml is None and job.defaults.queues and job.queue is not None:
        notices.append(f"-q/--queue {queue!r} is not among the queues of {yaml_label}, but {server.label} has it: "
                       "the server decided")
    where = _where(queue, job.cluster, default=job.queue is None)
    merged = _merge(stated, yaml, f"{server.source}: {server.command}", f"the YAML: {job.yaml_source}")
    refusal = _refuse(merged, job, where)
    yaml_refusal = _refuse(_Sourced(yaml), job, where) if job.yaml_source else None
    if refusal is not None:
        remark = _yaml_remark(refusal, yaml_refusal, yaml_label) if refusal.from_server and yaml else ""
        raise UsageError(f"{refusal}{remark}")
    if yaml_refusal is not None:
        notices.append(f"{where}: {server.label} accepts {yaml_refusal.asked}, which {yaml_label} refuses (it "
                       f"{yaml_refusal.rule}); the server decided")
    elif yaml is not None:
        notices += _differences(where, stated, yaml, server.label, yaml_label)
    return QueueDecision(merged.limits, tuple(notices))


def _server_queue(job: QueueJob, server: ServerQueues, queue: str) -> ServerQueue:
    """The server's queue ``queue``; an unknown, route-only or disabled one is a UsageError."""
    stated = server.queues.get(queue)
    tag = f"{server.noun} {queue!r} on {job.cluster} (from {server.source}: {server.command})"
    if stated is None:
        stale = f" (the YAML {job.yaml_source} lists it: it is stale)" if queue in job.defaults.queues else ""
        names = [name for name, q in server.queues.items() if not q.route_only]
        raise UsageError(f"-q/--queue {queue!r}: {server.label} has no {server.noun} {queue!r}; its "
                         f"{server.noun}s: {', '.join(names) or 'none'}{stale}")
    if stated.route_only:
        routers = [name for name, q in server.queues.items() if any(r.name == queue for r in q.limits.routes)]
        raise UsageError(f"-q/--queue {queue!r}: {tag} takes jobs only from a routing queue; submit to "
                         f"{' or '.join(routers) or 'the queue that routes to it'}")
    if not stated.enabled:
        raise UsageError(f"-q/--queue {queue!r}: {tag} is not enabled: it accepts no jobs now")
    return stated


def _merge(server: ServerQueue, yaml: QueueLimits | None, server_tag: str, yaml_tag: str) -> _Sourced:
    """The server's limits where it states them, the YAML's elsewhere (and the YAML's unit and sizes). A queue
    the YAML counts in GPUs (Sophia's by-gpu: -n is GPUs on one node) takes no node count from the server."""
    in_gpus = yaml is not None and yaml.unit != "nodes"
    from_server = frozenset(n for n in _LIMIT_FIELDS if (n in server.stated or yaml is None)
                            and not (in_gpus and n in ("min_nodes", "max_nodes", "routes")))
    base = yaml or QueueLimits()
    merged = replace(base, **{n: getattr(server.limits, n) for n in from_server})
    sources = {n: server_tag if n in from_server else yaml_tag for n in _LIMIT_FIELDS}
    sources["nodes_allowed"] = sources["machine"] = yaml_tag
    return _Sourced(merged, sources, from_server)


def _refuse(sourced: _Sourced, job: QueueJob, where: str) -> Refusal | None:
    """The first limit ``job`` breaks (None: it fits)."""
    routes = sourced.limits.routes if sourced.limits else ()
    return (_refuse_nodes(sourced, job, where) or _refuse_walltime(sourced, job, where)
            or (_refuse_route(sourced, routes, job, where) if routes else None))


def _refusal(sourced: _Sourced, name: str, asked: str, where: str, rule: str) -> Refusal:
    return Refusal(asked, where, rule, sourced.source(name), name in sourced.server_fields)


def _refuse_nodes(sourced: _Sourced, job: QueueJob, where: str) -> Refusal | None:
    limits, nodes, asked = sourced.limits, job.nodes, f"-n/--nodes {job.nodes}"
    unit = limits.unit if limits else "nodes"
    if limits and limits.nodes_allowed and nodes not in limits.nodes_allowed:
        return _refusal(sourced, "nodes_allowed", asked, where,
                        f"takes {' '.join(map(str, limits.nodes_allowed))} {unit}")
    low = limits.min_nodes if limits else None
    high, high_field = limits.max_nodes if limits else None, "max_nodes"
    if job.defaults.max_nodes is not None and (high is None or job.defaults.max_nodes < high):
        high, high_field = job.defaults.max_nodes, "machine"
    if low is not None and nodes < low or high is not None and nodes > high:
        broken = "min_nodes" if low is not None and nodes < low else high_field
        return _refusal(sourced, broken, asked, where, f"takes {_span(low, high, unit)}")
    return None


def _span(low: int | None, high: int | None, unit: str) -> str:
    if high is None:
        return f"at least {low} {unit}"
    if (low or 1) == high:
        return f"exactly {high} {unit[:-1] if high == 1 else unit}"
    return f"{low or 1} to {high} {unit}"


def _refuse_walltime(sourced: _Sourced, job: QueueJob, where: str) -> Refusal | None:
    """The walltime against the machine's limit and the queue's."""
    limits, walltime_s = sourced.limits, job.walltime_s
    if walltime_s is None:
        return None
    asked = f"-t/--walltime {format_hms(walltime_s)}"
    machine = job.defaults.max_walltime_s
    if machine and walltime_s > machine:
        return _refusal(sourced, "machine", asked, job.cluster, f"runs no job longer than {format_hms(machine)}")
    if limits and limits.max_walltime_s and walltime_s > limits.max_walltime_s:
        return _refusal(sourced, "max_walltime_s", asked, where, f"allows at most {format_hms(limits.max_walltime_s)}")
    return None


def _refuse_route(sourced: _Sourced, routes: Sequence[QueueRoute], job: QueueJob, where: str) -> Refusal | None:
    """PBS routes a job to the first destination whose limits take it, in the order listed."""
    fits = [r for r in routes if r.min_nodes <= job.nodes and (r.max_nodes is None or job.nodes <= r.max_nodes)]
    if not fits:
        spans = ", ".join(f"{r.name} {r.min_nodes}-{r.max_nodes or 'up'}" for r in routes)
        return _refusal(sourced, "routes", f"-n/--nodes {job.nodes}", where,
                        f"routes no job of that size (its queues: {spans})")
    walltime_s = job.walltime_s or 0
    if any(not r.max_walltime_s or walltime_s <= r.max_walltime_s for r in fits):
        return None
    route = fits[0]
    span = f"{route.min_nodes}-{route.max_nodes}" if route.max_nodes else f"{route.min_nodes} or more"
    asked = f"-t/--walltime {format_hms(walltime_s)}"
    return _refusal(sourced, "routes", asked, where, f"sends {job.nodes} nodes to {route.name!r} ({span} nodes), "
                                                     f"which allows at most {format_hms(route.max_walltime_s or 0)}")


def _yaml_remark(refusal: Refusal, yaml: Refusal | None, yaml_label: str) -> str:
    """``; the YAML (...) would allow it`` after a refusal the server decided, where the YAML differs."""
    if yaml is None:
        return f"; {yaml_label} would allow it"
    if (yaml.asked, yaml.rule) == (refusal.asked, refusal.rule):
        return ""
    if yaml.asked == refusal.asked:
        return f"; {yaml_label} says it {yaml.rule}"
    return f"; {yaml_label} would refuse {yaml.asked}: it {yaml.rule}"


def _differences(where: str, server: ServerQueue, yaml: QueueLimits, server_label: str,
                 yaml_label: str) -> list[str]:
    """One notice when limits both sources state differ (the job fits both)."""
    names = [n for n in _LIMIT_FIELDS if n in server.stated and getattr(yaml, n)
             and _normal(server.limits, n) != _normal(yaml, n)]
    if not names:
        return []
    routes = _differing_routes(server.limits.routes, yaml.routes)
    theirs = ", ".join(_describe(server.limits, n, routes) for n in names)
    ours = ", ".join(_describe(yaml, n, routes) for n in names)
    return [f"{where}: {server_label} states {theirs}; {yaml_label} says {ours}; the server's limits decided"]


def _differing_routes(server: Sequence[QueueRoute], yaml: Sequence[QueueRoute]) -> set[str] | None:
    """The destinations whose limits differ, when both list the same ones (None: the lists differ)."""
    if [r.name for r in server] != [r.name for r in yaml]:
        return None
    return {ours.name for ours, theirs in zip(server, yaml, strict=True) if ours != theirs}


def _normal(limits: QueueLimits, name: str) -> object:
    value = getattr(limits, name)
    return (value or 1) if name == "min_nodes" else value


def _describe(limits: QueueLimits, name: str, routes: set[str] | None) -> str:
    """One limit in words; of ``routes``, the destinations named in ``routes`` (None: all of them)."""
    if name == "min_nodes":
        return f"at least {limits.min_nodes or 1} nodes"
    if name == "max_nodes":
        return f"at most {limits.max_nodes} nodes" if limits.max_nodes else "no node limit"
    if name == "max_walltime_s":
        return f"at most {format_hms(limits.max_walltime_s)}" if limits.max_walltime_s else "no walltime limit"
    shown = [r for r in limits.routes if routes is None or r.name in routes]
    return ("routes to " if routes is None else "") + ", ".join(
        f"{r.name!r} ({r.min_nodes}-{r.max_nodes or 'up'} nodes, "
        f"{f'at most {format_hms(r.max_walltime_s)}' if r.max_walltime_s else 'no walltime limit'})" for r in shown)
