"""Slurm: ``#SBATCH`` directives, ``sbatch --parsable``, ``scontrol show job``, ``scancel``.

Status comes from ``scontrol show job -o`` (it keeps finished jobs for MinJobAge and needs no
accounting database), then from ``sacct`` where accounting is enabled. Partition limits come from
``scontrol --all --oneliner show partition`` (``MaxTime``, ``MinNodes``, ``MaxNodes``, ``Default``, ``State``):
with Slurm's default ``EnforcePartLimits=NO`` a job over them is accepted and then pends for ever
(``PartitionTimeLimit``, ``PartitionNodeLimit``).
"""

from __future__ import annotations

import re

from hvdrun.config import QueueLimits
from hvdrun.errors import JobError, UsageError
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
from hvdrun.schedulers import SLURM
from hvdrun.walltime import slurm_duration_s

_STATES = {"PENDING": QUEUED, "CONFIGURING": QUEUED, "REQUEUED": QUEUED, "REQUEUE_HOLD": HELD,
           "REQUEUE_FED": QUEUED, "RESV_DEL_HOLD": HELD, "SUSPENDED": HELD, "STOPPED": HELD,
           "RUNNING": RUNNING, "COMPLETING": EXITING, "SIGNALING": EXITING, "STAGE_OUT": EXITING,
           "RESIZING": RUNNING}
_JOB_ID = re.compile(r"([0-9]+(?:_[0-9]+)?)(?:;\S+)?")
_FIELD = re.compile(r"(\w+)=(\S*)")
_INVALID_JOB = re.compile(r"invalid job id", re.IGNORECASE)
_CLOSED_STATES = ("INACTIVE", "DRAIN")  # no new job may be queued there


class Slurm(Scheduler):
    """Slurm (``sbatch``/``scontrol``/``scancel``)."""

    kind = SLURM
    rules = ScriptRules("#SBATCH")
    cancel_program = "scancel"
    example_directive = "--constraint=a100"

    def directives(self, spec: JobSpec) -> list[str]:
        if spec.filesystems:
            raise UsageError(f"--filesystems {','.join(spec.filesystems)}: Slurm has no filesystems request "
                             "(ask with --directive '--constraint=...' or --directive '--licenses=...')")
        lines = [f"--job-name={quote(spec.job_name)}", f"--nodes={spec.nodes}",
                 f"--ntasks-per-node={spec.ranks_per_node}"]
        lines += [f"--gpus-per-node={spec.gpus_per_node}"] if spec.gpus_per_node else []
        lines += [f"--time={spec.walltime_hms}"] if spec.walltime_hms else []
        lines += [f"--partition={quote(spec.queue)}"] if spec.queue else []
        lines += [f"--account={quote(spec.account)}"] if spec.account else []
        lines += [f"--output={quote(spec.output)}"]
        lines += [f"--error={quote(spec.error)}"] if spec.error else []
        lines += [f"--dependency={self.dependency(spec)}:{':'.join(spec.after)}"] if spec.after else []
        return [f"#SBATCH {line}" for line in lines]

    def submit_argv(self, spec: JobSpec, script: str) -> list[str]:
        return ["sbatch", "--parsable", script]

    def parse_job_id(self, stdout: str) -> str:
        return first_match(_JOB_ID, stdout, "Slurm job id (sbatch --parsable prints 'ID' or 'ID;CLUSTER')")

    def status(self, job_id: str) -> JobStatus:
        done = run_scheduler_command(["scontrol", "show", "job", "-o", job_id], ok_codes=range(256))
        if done.returncode == 0 and "JobState=" in done.stdout:
            return _from_scontrol(job_id, done.stdout)
        if not _INVALID_JOB.search(done.stderr + done.stdout):
            raise JobError(command_failure(f"scontrol show job -o {job_id}", done))
        return _from_sacct(job_id)

    names_default_queue = True

    def queue_limits_argv(self) -> list[str]:
        return ["scontrol", "--all", "--oneliner", "show", "partition"]

    def parse_queue_limits(self, stdout: str) -> ServerQueues:
        return parse_partitions(stdout)


def _exit_code(text: str, raw_state: str) -> int:
    """``ExitCode=5:0`` -> 5; ``0:15`` (killed by signal 15) -> 143; a failed state with 0:0 -> 1."""
    code, _, signal = text.partition(":")
    value = int(code) if code.isdigit() else 0
    if value == 0 and signal.isdigit() and int(signal):
        value = 128 + int(signal)
    if value == 0 and raw_state not in ("COMPLETED", ""):
        value = 1
    return value


def _status(job_id: str, raw: str, exit_text: str, reason: str | None, nodes: str | None) -> JobStatus:
    raw = raw.split()[0] if raw else ""  # sacct: "CANCELLED by 0"
    state = _STATES.get(raw, FINISHED if raw else UNKNOWN)
    exit_code = _exit_code(exit_text, raw) if state == FINISHED else None
    if reason in ("None", "(null)", ""):
        reason = None
    return JobStatus(job_id, state, raw, exit_code, reason, nodes if nodes not in ("", "(null)") else None)


def _from_scontrol(job_id: str, text: str) -> JobStatus:
    fields = dict(_FIELD.findall(text.splitlines()[0]))
    return _status(job_id, fields.get("JobState", ""), fields.get("ExitCode", "0:0"), fields.get("Reason"),
                   fields.get("NodeList"))


def _from_sacct(job_id: str) -> JobStatus:
    done = run_scheduler_command(["sacct", "-n", "-X", "-P", "-o", "JobID,State,ExitCode,NodeList", "-j", job_id],
                                 ok_codes=range(256), retries=0)
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        parts = line.split("|")
        if len(parts) == 4 and parts[0] == job_id:
            return _status(job_id, parts[1], parts[2], None, parts[3])
    return JobStatus(job_id, UNKNOWN, reason="Slurm no longer knows this job (finished before MinJobAge, "
                                             "and no accounting) or it never existed")


def parse_partitions(text: str) -> ServerQueues:
    """Every partition in ``scontrol --oneliner show partition`` output (one ``Key=Value ...`` line each).

    Raises:
        JobError: no ``PartitionName=`` line in it.
    """
    queues, default = {}, None
    for line in text.splitlines():
        fields = dict(_FIELD.findall(line))
        name = fields.get("PartitionName")
        if not name:
            continue
        limits = QueueLimits(min_nodes=_count(fields.get("MinNodes", ""), 2),
                             max_nodes=_count(fields.get("MaxNodes", ""), 1),
                             max_walltime_s=slurm_duration_s(fields.get("MaxTime", "")))
        queues[name] = ServerQueue(name, limits, enabled=fields.get("State", "UP") not in _CLOSED_STATES)
        if fields.get("Default") == "YES":
            default = name
    if not queues:
        raise JobError("scontrol show partition printed no 'PartitionName=' line")
    return ServerQueues("the Slurm controller", "scontrol show partition", queues, noun="partition",
                        default=default)


def _count(text: str, least: int) -> int | None:
    """``MinNodes`` (a limit from 2 on) or ``MaxNodes`` (from 1 on); ``UNLIMITED`` is none."""
    return int(text) if text.isdigit() and int(text) >= least else None
