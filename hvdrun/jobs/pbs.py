"""PBS Pro / OpenPBS (ALCF Polaris, Aurora, Sophia): ``#PBS`` directives, ``qsub``, ``qstat``, ``qdel``.

Status comes from ``qstat -x -f -F json`` (``job_state``, ``Exit_status``, ``comment``). A server without job
history (OpenPBS's default) answers every ``-x`` query with no job and "PBS is not configured to maintain job
history", running jobs too: it is asked again without ``-x``, and a job that has ended is then unknown to it (its
exit code comes from the file the job script wrote). A ``qstat`` without JSON output (Torque's, or Slurm's Torque
wrappers) is read through ``qstat -f`` text instead.
Queue limits come from ``qstat -Qf -F json`` (``queue_type``, ``resources_min``/``resources_max``
``nodect`` and ``walltime``, ``route_destinations``, ``from_route_only``, ``enabled``).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

from hvdrun.config import QueueLimits, QueueRoute
from hvdrun.errors import JobError
from hvdrun.jobs.queue_limits import ServerQueue, ServerQueues
from hvdrun.jobs.scheduler import (
    EXITING,
    FINISHED,
    HELD,
    QUEUED,
    RUNNING,
    UNKNOWN,
    JobSpec,
    JobStatus,
    Scheduler,
    ScriptRules,
    command_failure,
    first_match,
    quote,
    run_scheduler_command,
)
from hvdrun.schedulers import PBS
from hvdrun.walltime import pbs_duration_s

_STATES = {"Q": QUEUED, "W": QUEUED, "T": QUEUED, "M": QUEUED, "H": HELD, "S": HELD, "U": HELD,
           "R": RUNNING, "B": RUNNING, "E": EXITING, "F": FINISHED, "X": FINISHED, "C": FINISHED}
_JOB_ID = re.compile(r"([0-9]+(?:\[[0-9]*\])?(?:\.[A-Za-z0-9_.-]+)?)")
_UNKNOWN_JOB = re.compile(r"unknown job id|job has finished|invalid job id", re.IGNORECASE)
_NO_HISTORY = re.compile(r"not configured to maintain job history", re.IGNORECASE)
_NO_JSON = re.compile(r"unknown option|invalid option|illegal option|usage:", re.IGNORECASE)
_TEXT_FIELD = re.compile(r"\s+([A-Za-z_.]+)\s*=\s*(.*)")
_TRUE = ("true", "t", "yes", "y", "1")


class Pbs(Scheduler):
    """PBS Pro and OpenPBS."""

    kind = PBS
    rules = ScriptRules("#PBS", comments_in_block=False)

    def directives(self, spec: JobSpec) -> list[str]:
        select = f"select={spec.nodes}" + (f":system={spec.system}" if spec.system else "")
        resources = [select]
        if spec.place:
            resources.append(f"place={spec.place}")
        if spec.walltime_hms:
            resources.append(f"walltime={spec.walltime_hms}")
        if spec.filesystems:
            resources.append("filesystems=" + ":".join(spec.filesystems))
        lines = [f"-A {quote(spec.account)}"] if spec.account else []
        lines += [f"-q {quote(spec.queue)}"] if spec.queue else []
        lines += [f"-l {quote(item)}" for item in resources]
        lines += [f"-N {quote(spec.job_name)}", "-k doe", f"-o {quote(spec.output)}"]
        lines += [f"-e {quote(spec.error)}"] if spec.error else ["-j oe"]
        if spec.after:
            lines.append(f"-W depend={self.dependency(spec)}:{':'.join(spec.after)}")
        return [f"#PBS {line}" for line in lines]

    def submit_argv(self, spec: JobSpec, script: str) -> list[str]:
        # the output paths again on the command line: PBS's own precedence, and the only place
        # Torque-style qsub wrappers read them
        paths = ["-o", spec.output, *(["-e", spec.error] if spec.error else ["-j", "oe"])]
        return ["qsub", *paths, script]

    def parse_job_id(self, stdout: str) -> str:
        lines = [line for line in stdout.splitlines() if line.strip()]
        return first_match(_JOB_ID, lines[-1] if lines else "", "PBS job id (e.g. 1234.server)")

    def status(self, job_id: str) -> JobStatus:
        done = run_scheduler_command(["qstat", "-x", "-f", "-F", "json", job_id], ok_codes=range(256))
        unknown = "qstat: unknown job id"
        if _NO_HISTORY.search(done.stderr):
            done = run_scheduler_command(["qstat", "-f", "-F", "json", job_id], ok_codes=range(256))
            unknown += "; the server keeps no job history, so it forgets a job that ended"
        if done.returncode == 0 and done.stdout.lstrip().startswith("{"):
            return _from_json(job_id, done.stdout)
        if _UNKNOWN_JOB.search(done.stderr + done.stdout):
            return JobStatus(job_id, UNKNOWN, reason=unknown)
        if not _NO_JSON.search(done.stderr + done.stdout):
            raise JobError(command_failure(f"qstat -x -f -F json {job_id}", done))
        text = run_scheduler_command(["qstat", "-f", job_id], ok_codes=range(256))
        if text.returncode != 0 or "job_state" not in text.stdout:
            return JobStatus(job_id, UNKNOWN, reason="qstat: unknown job id")
        return _from_text(job_id, text.stdout)

    def queue_limits_argv(self) -> list[str]:
        return ["qstat", "-Q", "-f", "-F", "json"]

    def parse_queue_limits(self, stdout: str) -> ServerQueues:
        return parse_queues(stdout)


def _exit_code(value: object) -> int | None:
    """PBS's ``Exit_status``: 256+N means killed by signal N; negative values are PBS's own failures."""
    try:
        code = int(str(value))
    except ValueError:
        return None
    if code >= 256:
        return 128 + code - 256
    return 1 if code < 0 else code


def _nodes(exec_host: str | None) -> str | None:
    if not exec_host:
        return None
    return ",".join(dict.fromkeys(part.split("/")[0] for part in exec_host.split("+")))


def _status(job_id: str, fields: dict[str, str]) -> JobStatus:
    raw = fields.get("job_state", "")
    state = _STATES.get(raw, QUEUED)
    exit_code = _exit_code(fields["Exit_status"]) if "Exit_status" in fields and state == FINISHED else None
    return JobStatus(job_id, state, raw, exit_code, fields.get("comment"), _nodes(fields.get("exec_host")))


def _from_json(job_id: str, text: str) -> JobStatus:
    try:
        jobs = json.loads(text).get("Jobs") or {}
    except (ValueError, AttributeError) as e:
        raise JobError(f"qstat -F json printed something that is not PBS's JSON: {e}") from e
    short = job_id.split(".")[0]
    for full_id, fields in jobs.items():
        if full_id == job_id or full_id.split(".")[0] == short:
            return _status(full_id, {k: str(v) for k, v in fields.items()})
    return JobStatus(job_id, UNKNOWN, reason="qstat: unknown job id")


def _from_text(job_id: str, text: str) -> JobStatus:
    fields = {}
    for line in text.splitlines():
        match = _TEXT_FIELD.fullmatch(line)
        if match:
            fields[match.group(1)] = match.group(2).strip()
    fields.setdefault("Exit_status", fields.get("exit_status", ""))
    if not fields["Exit_status"]:
        del fields["Exit_status"]
    return _status(job_id, fields)


def parse_queues(text: str) -> ServerQueues:
    """Every queue in ``qstat -Qf -F json`` output: ``{"pbs_server": ..., "Queue": {NAME: {ATTRIBUTE: VALUE,
    RESOURCE_ATTRIBUTE: {RESOURCE: VALUE}}}}``, values that read as JSON numbers printed as numbers.

    Raises:
        JobError: the text is not that JSON.
    """
    try:
        data = json.loads(text)
    except ValueError as e:
        raise JobError(f"qstat -Qf -F json printed something that is not PBS's JSON: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("Queue", {}), dict):
        raise JobError("qstat -Qf -F json printed no 'Queue' object")
    attributes = {str(name): value for name, value in data.get("Queue", {}).items() if isinstance(value, dict)}
    own = {name: _own_limits(value) for name, value in attributes.items()}
    queues = {name: _queue(name, value, own) for name, value in attributes.items()}
    server = data.get("pbs_server")
    return ServerQueues("the PBS server", "qstat -Qf -F json", queues, server=str(server) if server else None)


def _own_limits(attributes: dict[str, object]) -> tuple[QueueLimits, frozenset[str]]:
    """A queue's own ``resources_min.nodect``, ``resources_max.nodect`` and ``resources_max.walltime``, and
    which of them it states."""
    limits = QueueLimits(min_nodes=_count(_resource(attributes, "resources_min", "nodect")),
                         max_nodes=_count(_resource(attributes, "resources_max", "nodect")),
                         max_walltime_s=pbs_duration_s(_resource(attributes, "resources_max", "walltime")))
    return limits, frozenset(name for name in ("min_nodes", "max_nodes", "max_walltime_s")
                             if getattr(limits, name) is not None)


def _queue(name: str, attributes: dict[str, object],
           own: dict[str, tuple[QueueLimits, frozenset[str]]]) -> ServerQueue:
    limits, stated = own[name]
    routes: tuple[QueueRoute, ...] = ()
    if str(attributes.get("queue_type", "")).lower() == "route":
        routes = tuple(_route(dest, own) for dest in str(attributes.get("route_destinations", "")).split(",")
                       if dest.strip())
    return ServerQueue(name, replace(limits, routes=routes), stated | {"routes"},
                       route_only=_true(attributes.get("from_route_only", False)),
                       enabled=_true(attributes.get("enabled", True)))


def _route(destination: str, own: dict[str, tuple[QueueLimits, frozenset[str]]]) -> QueueRoute:
    """One destination of a routing queue (``small``, or ``small@server``: limits unknown), with its limits."""
    name = destination.strip().split("@")[0]
    limits = own[name][0] if name in own and "@" not in destination else QueueLimits()
    return QueueRoute(name, limits.min_nodes or 1, limits.max_nodes, limits.max_walltime_s)


def _resource(attributes: dict[str, object], group: str, resource: str) -> object:
    values = attributes.get(group)
    return values.get(resource) if isinstance(values, dict) else None


def _count(value: object) -> int | None:
    """A node count, printed as a number (or a numeric string); None when absent or not a count."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        count = int(str(value).strip())
    except ValueError:
        return None
    return count if count > 0 else None


def _true(value: object) -> bool:
    """A PBS boolean: ``True``/``False`` (strings in the JSON), or a JSON boolean."""
    return value if isinstance(value, bool) else str(value).strip().lower() in _TRUE
