"""Cobalt (ALCF Theta and ThetaGPU, retired): ``#COBALT`` directives, ``qsub``, ``qstat``, ``qdel``.

Cobalt reads directives only from the topmost lines of a script (a blank line ends them), runs the
script *path* it was given (so hvdrun submits its saved copy and never edits it), prints only the
job id, and forgets a job once it ends: its exit code is the one the script writes beside the output.
"""

from __future__ import annotations

import re

from hvdrun.errors import JobError
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
from hvdrun.schedulers import COBALT

QSTAT_HEADER = "JobID:JobName:User:WallTime:State:Nodes:Location:Queue"
_STATES = {"queued": QUEUED, "starting": QUEUED, "running": RUNNING, "exiting": EXITING, "killing": EXITING,
           "user_hold": HELD, "admin_hold": HELD, "maxrun_hold": HELD, "dep_hold": HELD, "dep_fail": HELD,
           "finished": FINISHED, "failed": FINISHED}
_JOB_ID = re.compile(r"([0-9]+)")


class Cobalt(Scheduler):
    """Cobalt's ``qsub``/``qstat``/``qdel`` (``COBALT_CONFIG_FILES`` chooses the instance, as usual)."""

    kind = COBALT
    rules = ScriptRules("#COBALT", blank_line_ends_block=True)
    needs_error_file = True  # Cobalt always writes stderr to its own file
    no_chain = ("Cobalt's --dependencies starts a job only after the others succeeded (a job killed at its walltime "
                "leaves the next in dep_fail for ever), so hvdrun cannot chain Cobalt jobs")
    example_directive = "--attrs mig-mode=True"

    def directives(self, spec: JobSpec) -> list[str]:
        lines = [f"-n {spec.nodes}"]
        lines += [f"-t {spec.walltime_minutes}"] if spec.walltime_minutes else []
        lines += [f"-q {quote(spec.queue)}"] if spec.queue else []
        lines += [f"-A {quote(spec.account)}"] if spec.account else []
        lines += [f"--attrs filesystems={','.join(spec.filesystems)}"] if spec.filesystems else []
        lines += [f"--jobname {quote(spec.job_name)}", f"-o {quote(spec.output)}", f"-e {quote(spec.error)}"]
        lines += [f"--dependencies {':'.join(spec.after)}"] if spec.after else []
        return [f"#COBALT {line}" for line in lines]

    def submit_argv(self, spec: JobSpec, script: str) -> list[str]:
        return ["qsub", "--mode", "script", script]

    def parse_job_id(self, stdout: str) -> str:
        return first_match(_JOB_ID, stdout, "Cobalt job id (qsub prints the job number)")

    def status(self, job_id: str) -> JobStatus:
        done = run_scheduler_command(["qstat", "--header", QSTAT_HEADER, job_id], ok_codes=range(256))
        for line in done.stdout.splitlines():
            fields = line.split()
            if fields and fields[0] == job_id and len(fields) >= 8:
                raw = fields[4]
                reason = "a job it depends on failed" if raw == "dep_fail" else None
                nodes = fields[6] if fields[6] not in ("None", "-") else None
                return JobStatus(job_id, _STATES.get(raw, QUEUED), raw, None, reason, nodes)
        if done.returncode != 0 and "not found" not in (done.stderr + done.stdout).lower() and done.stderr.strip():
            raise JobError(command_failure(f"qstat {job_id}", done))
        return JobStatus(job_id, UNKNOWN, reason="Cobalt lists only queued and running jobs")


