"""Run a job whose ranks' output is read, not shown: the jobs of ``hvdrun check`` and ``hvdrun bench``."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

from hvdrun.errors import HvdrunError
from hvdrun.launch.job import run_job
from hvdrun.launch.plan import JobPlan


@dataclass(frozen=True)
class CapturedJob:
    """What the ranks printed (each line ``[rank]<stream>:text``) and, when the job failed, why and on which
    host (the first failed rank's, or the one that could not be reached; None when no host is to blame)."""

    stdout: str
    stderr: str
    error: str | None = None
    host: str | None = None

    def rank0_results(self, tag: str) -> list[dict[str, Any]]:
        """The JSON documents rank 0 printed after ``tag`` at the start of a line, in order."""
        start = f"[0]<stdout>:{tag}"
        return [json.loads(line[len(start):]) for line in self.stdout.splitlines() if line.startswith(start)]


def run_captured(plan: JobPlan, tail_lines: int = 6) -> CapturedJob:
    """Run ``plan`` (its output prefixed, kept in memory); a failure's message ends with the ranks' last
    ``tail_lines`` stderr lines."""
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        run_job(plan, console={"stdout": stdout, "stderr": stderr})
    except HvdrunError as e:
        tail = [line for line in stderr.getvalue().splitlines() if line.strip()][-tail_lines:]
        return CapturedJob(stdout.getvalue(), stderr.getvalue(), str(e) + "".join(f"\n  {t}" for t in tail),
                           getattr(e, "host", None))  # WorkerFailed and LaunchError name the host to blame
    return CapturedJob(stdout.getvalue(), stderr.getvalue())
