"""PBS Pro / OpenPBS (ALCF Polaris, Aurora, Sophia): ``#PBS`` directives, ``qsub``, ``qstat``, ``qdel``.

Status comes from ``qstat -x -f -F json`` (``job_state``, ``Exit_status``, ``comment``); a ``qstat``
without JSON output (Torque's, or Slurm's Torque wrappers) is read through ``qstat -f`` text instead.
"""

from __future__ import annotations

import json
import re

from hvdrun.errors import JobError
from hvdrun.jobs.base import (
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

_STATES = {"Q": QUEUED, "W": QUEUED, "T": QUEUED, "M": QUEUED, "H": HELD, "S": HELD, "U": HELD,
           "R": RUNNING, "B": RUNNING, "E": EXITING, "F": FINISHED, "X": FINISHED, "C": FINISHED}
_JOB_ID = re.compile(r"([0-9]+(?:\[[0-9]*\])?(?:\.[A-Za-z0-9_.-]+)?)")
_UNKNOWN_JOB = re.compile(r"unknown job id|job has finished|invalid job id", re.IGNORECASE)
_NO_JSON = re.compile(r"unknown option|invalid option|illegal option|usage:", re.IGNORECASE)
_TEXT_FIELD = re.compile(r"\s+([A-Za-z_.]+)\s*=\s*(.*)")


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
            lines.append(f"-W depend=afterok:{':'.join(spec.after)}")
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
        if done.returncode == 0 and done.stdout.lstrip().startswith("{"):
            return _from_json(job_id, done.stdout)
        if _UNKNOWN_JOB.search(done.stderr + done.stdout):
            return JobStatus(job_id, UNKNOWN, reason="qstat: unknown job id")
        if not _NO_JSON.search(done.stderr + done.stdout):
            raise JobError(command_failure(f"qstat -x -f -F json {job_id}", done))
        text = run_scheduler_command(["qstat", "-f", job_id], ok_codes=range(256))
        if text.returncode != 0 or "job_state" not in text.stdout:
            return JobStatus(job_id, UNKNOWN, reason="qstat: unknown job id")
        return _from_text(job_id, text.stdout)



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
