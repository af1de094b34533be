"""Submit a rendered job, follow it to its end, and find it again later (``hvdrun qstat`` / ``qdel``).

``hvdrun qsub --submit`` writes the script next to the job's output and submits that file (Cobalt
runs the path it is given, so the copy is never edited), then records the job in a small registry
(``$HVDRUN_JOBS_DIR``, default ``~/.hvdrun/jobs``) so that ``hvdrun qstat ID`` knows its scheduler,
its output and the file its exit code is written to.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hvdrun.envvars import jobs_dir
from hvdrun.errors import JobError, JobInterrupted, UsageError
from hvdrun.jobs import DEFAULT_SCHEDULER, SCHEDULERS, scheduler_for
from hvdrun.jobs.scheduler import FINISHED, UNKNOWN, JobSpec, JobStatus, Scheduler
from hvdrun.schedulers import SLURM

_FIRST_POLL_S, _MAX_POLL_S = 0.25, 30.0  # polls every tenth of the job's age: quick for short jobs, gentle on
# the scheduler for long ones
_GRACE_UNKNOWN_S = 15.0  # a job just submitted may not be visible yet (PBS routing queues)
Echo = Callable[[str], None]


@dataclass(frozen=True)
class SubmittedJob:
    """What the registry keeps about one submitted job."""

    job_id: str
    scheduler: str
    script: str
    output: str
    error: str | None
    exit_file: str
    submitted_at: float


def _record_path(job_id: str) -> Path:
    return jobs_dir() / (re.sub(r"[^A-Za-z0-9_.\[\]-]", "_", job_id) + ".json")


def record(job: SubmittedJob) -> None:
    """Remember ``job`` (best effort: a read-only home only loses the convenience)."""
    try:
        jobs_dir().mkdir(parents=True, exist_ok=True)
        _record_path(job.job_id).write_text(json.dumps(asdict(job), indent=1))
    except OSError:
        pass


def lookup(job_id: str) -> SubmittedJob | None:
    """The recorded job ``job_id`` (a PBS short id finds ``1234.server`` too), or None."""
    candidates = [_record_path(job_id), *sorted(jobs_dir().glob(f"{job_id.split('.')[0]}.*.json"))]
    for path in candidates:
        try:
            return SubmittedJob(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
    return None


def write_script(spec: JobSpec, text: str) -> None:
    """Save the script that will be submitted next to the job's output (exactly what is submitted)."""
    path = Path(spec.script_path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        Path(spec.output).parent.mkdir(parents=True, exist_ok=True)
        if spec.error:
            Path(spec.error).parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as e:
        raise UsageError(f"-o/--output: cannot write the job script to {path}: {e.strerror}") from e
    path.chmod(0o755)  # Cobalt runs the script itself


def submit(spec: JobSpec, text: str) -> SubmittedJob:
    """Write ``text`` next to the job's output, submit it and record the job."""
    write_script(spec, text)
    scheduler = scheduler_for(spec.scheduler)
    job_id = scheduler.submit(spec, spec.script_path)
    job = SubmittedJob(job_id, spec.scheduler, spec.script_path, spec.output, spec.error, spec.exit_file, time.time())
    record(job)
    return job


def read_exit_file(path: str | None) -> int | None:
    """The exit code the job script wrote, or None when it has not (yet)."""
    if not path:
        return None
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.lstrip("-").isdigit() else None


def current_status(scheduler: Scheduler, job_id: str, exit_file: str | None) -> JobStatus:
    """The scheduler's status, completed with the exit code the script wrote where the scheduler has none."""
    status = scheduler.status(job_id)
    written = read_exit_file(exit_file)
    if status.state == UNKNOWN and written is not None:
        return replace(status, state=FINISHED, exit_code=written, reason=None)
    if status.state == FINISHED and written is not None and (status.exit_code is None or status.exit_code == 0):
        return replace(status, exit_code=written)
    return status


def follow(job: SubmittedJob, echo: Echo, sleep: Callable[[float], None] = time.sleep) -> int:
    """Poll ``job`` until it ends, printing each change of state; return its exit code.

    Raises:
        JobError: the scheduler lost the job and it left no exit code.
        JobInterrupted: Ctrl-C (the job keeps running).
    """
    scheduler = scheduler_for(job.scheduler)
    last, started = "", time.monotonic()
    try:
        while True:
            status = current_status(scheduler, job.job_id, job.exit_file)
            age = time.monotonic() - started
            interval = min(max(_FIRST_POLL_S, age / 10), _MAX_POLL_S)
            if status.state == UNKNOWN and age < _GRACE_UNKNOWN_S:
                sleep(interval)
                continue
            description = status.describe()
            if description != last:
                echo(f"hvdrun: job {job.job_id} {description}")
                last = description
            if status.done:
                return _final_code(job, status)
            sleep(interval)
    except KeyboardInterrupt:
        raise JobInterrupted(f"stopped following job {job.job_id}; it keeps running "
                             f"('hvdrun qdel {job.job_id}' cancels it)", 130) from None


def _final_code(job: SubmittedJob, status: JobStatus) -> int:
    if status.exit_code is not None:
        return status.exit_code
    raise JobError(f"job {job.job_id} is no longer known to {job.scheduler} and left no exit code in "
                   f"{job.exit_file}; its output is in {job.output}")


def scheduler_of(job_id: str, kind: str | None) -> tuple[Scheduler, SubmittedJob | None]:
    """The back-end for ``job_id``: ``kind`` if given, else the recorded one, else guessed from PATH."""
    job = lookup(job_id)
    kind = kind or (job.scheduler if job else None) or (SLURM if shutil.which("sbatch") else DEFAULT_SCHEDULER)
    if kind not in SCHEDULERS:
        raise UsageError(f"--scheduler {kind!r}: expected one of {', '.join(SCHEDULERS)}")
    return scheduler_for(kind), job
