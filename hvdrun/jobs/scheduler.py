"""The job every back-end renders (:class:`JobSpec`, built by :mod:`hvdrun.jobs.spec`), what every
scheduler back-end provides, the one way scheduler commands are run, and job states.

A back-end (:mod:`hvdrun.jobs.pbs`, :mod:`~hvdrun.jobs.cobalt`, :mod:`~hvdrun.jobs.slurm`) turns a
:class:`~hvdrun.jobs.spec.JobSpec` into directive lines and knows its scheduler's submit, status and
cancel commands and how to read their output. Every command goes through :func:`run_scheduler_command`,
which retries transient failures and, on failure, raises :class:`~hvdrun.errors.JobError` with the
command, its exit code, stdout and stderr.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hvdrun.config import format_hms
from hvdrun.envvars import LC_ALL
from hvdrun.errors import JobError, UsageError

if TYPE_CHECKING:
    from hvdrun.jobs.queue_limits import ServerQueues

# the states hvdrun reports, whatever the scheduler calls them
QUEUED, HELD, RUNNING, EXITING, FINISHED, UNKNOWN = "QUEUED", "HELD", "RUNNING", "EXITING", "FINISHED", "UNKNOWN"
_TRANSIENT = re.compile(r"communication failure|cannot connect to server|socket timed out|"
                        r"unable to contact slurm controller|connection refused", re.IGNORECASE)
COMMAND_TIMEOUT_S = 60.0
CHAIN_ENDED = 3  # `hvdrun chain-link begin`: the chain has ended, this job runs nothing (any other failure is one)


@dataclass(frozen=True)
class JobSpec:
    """A job ready to render: every value validated, every path absolute.

    ``nodes`` counts nodes, or GPUs on one node where the queue's ``unit`` is ``gpus`` (Sophia's
    by-gpu). ``setup`` holds finished shell lines; ``launch`` is the argv of the hvdrun that runs
    inside the allocation.
    """

    scheduler: str
    cluster: str
    nodes: int
    unit: str
    walltime_s: int | None
    queue: str | None
    account: str | None
    filesystems: tuple[str, ...]
    job_name: str
    output: str
    error: str | None
    exit_file: str
    script_path: str
    workdir: str
    setup: tuple[str, ...]
    ranks_per_node: int
    gpus_per_node: int
    system: str | None
    place: str | None
    directives: tuple[str, ...]
    skip_directives: tuple[str, ...]
    after: tuple[str, ...]
    launch: tuple[str, ...]
    template: str | None
    notices: tuple[str, ...] = ()  # one line each for the user (where the queue limits came from, ...)
    after_any: bool = False  # start after the jobs of ``after`` ended however they ended (a chain's next job)
    link: ChainLink | None = None  # the job's place in a chain (hvdrun qsub --chain; jobs/chain.py)

    @property
    def walltime_hms(self) -> str | None:
        """The walltime as ``HH:MM:SS`` (PBS, Slurm)."""
        return format_hms(self.walltime_s) if self.walltime_s else None

    @property
    def walltime_minutes(self) -> int | None:
        """The walltime in whole minutes, rounded up (Cobalt's ``-t``)."""
        return -(-self.walltime_s // 60) if self.walltime_s else None

@dataclass(frozen=True)
class ChainLink:
    """A job's place in a chain: the chain's file, its number there (from 1), and the file where the job's hvdrun
    notes its warning and the stop signal that ended it (``HVDRUN_JOB_EVENTS``)."""

    chain_file: str
    number: int
    events_file: str


@dataclass(frozen=True)
class JobStatus:
    """One job as the scheduler reports it.

    Attributes:
        job_id: the id as given to the scheduler.
        state: QUEUED, HELD, RUNNING, EXITING, FINISHED or UNKNOWN (the scheduler does not know the job).
        raw_state: the scheduler's own word for it (``R``, ``PENDING``, ``dep_hold``, ...).
        exit_code: the job's exit code once FINISHED, when the scheduler knows it.
        reason: why a queued job waits, or how a finished one ended (PBS ``comment``, Slurm ``Reason``).
        nodes: where it runs, when known.
    """

    job_id: str
    state: str
    raw_state: str = ""
    exit_code: int | None = None
    reason: str | None = None
    nodes: str | None = None

    @property
    def done(self) -> bool:
        """True once the job can change no more."""
        return self.state in (FINISHED, UNKNOWN)

    def describe(self) -> str:
        """``RUNNING on n[1-2]``, ``QUEUED (Resources)``, ``FINISHED, exit code 3``."""
        words = self.state + (f" [{self.raw_state}]" if self.raw_state and self.raw_state != self.state else "")
        if self.nodes and self.state == RUNNING:
            words += f" on {self.nodes}"
        if self.exit_code is not None:
            words += f", exit code {self.exit_code}"
        if self.reason:
            words += f" ({self.reason})"
        return words


@dataclass(frozen=True)
class ScriptRules:
    """How a scheduler reads the directive lines at the top of a script.

    Attributes:
        prefix: ``#PBS``, ``#COBALT`` or ``#SBATCH``.
        blank_line_ends_block: Cobalt ignores every directive after a blank line.
        comments_in_block: whether other ``#`` lines may sit between directives (PBS may read them as
            directives, so not there).
    """

    prefix: str
    blank_line_ends_block: bool = False
    comments_in_block: bool = True


def run_scheduler_command(argv: Sequence[str], *, ok_codes: Sequence[int] = (0,), retries: int = 3,
                          timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run one scheduler command; transient failures ("Communication failure", ...) are retried.

    Raises:
        JobError: the program is missing, timed out, or exited with a code outside ``ok_codes``; the
            message has the command, its exit code, stdout and stderr.
    """
    command = shlex.join(argv)
    for attempt in range(retries + 1):
        try:
            done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s,
                                  stdin=subprocess.DEVNULL, env={**os.environ, LC_ALL: "C"})
        except FileNotFoundError:
            raise JobError(f"'{argv[0]}' not found on PATH: run this on a login node of the cluster, or "
                           "load the scheduler's module") from None
        except subprocess.TimeoutExpired as e:
            raise JobError(f"'{command}' did not answer within {timeout_s:g} s") from e
        if done.returncode in ok_codes:
            return done
        if attempt < retries and _TRANSIENT.search(done.stderr + done.stdout):
            time.sleep(min(2.0 * (attempt + 1), 6.0))
            continue
        break
    raise JobError(command_failure(command, done))


def command_failure(command: str, done: subprocess.CompletedProcess[str]) -> str:
    """The message for a failed scheduler command: the command, its exit code, stdout and stderr; one line when
    all it printed is one line of stderr (``qsub: Job violates queue and/or server resource limits``)."""
    parts = [f"'{command}' failed with exit code {done.returncode}"]
    stderr_lines = done.stderr.strip().splitlines()
    if not done.stdout.strip() and len(stderr_lines) == 1:
        return f"{parts[0]}: {stderr_lines[0].strip()}"
    for name, text in (("stdout", done.stdout), ("stderr", done.stderr)):
        text = text.strip()
        parts.append(f"  {name}: " + (text.replace("\n", "\n    ") if text else "(empty)"))
    return "\n".join(parts)


def quote(value: object) -> str:
    """Shell-quote one value for a script line (safe values stay as they are)."""
    return shlex.quote(str(value))


class Scheduler(ABC):
    """One batch scheduler: its directives, its script rules and its commands."""

    kind: str  # its name in hvdrun.schedulers.SCHEDULERS
    rules: ScriptRules
    cancel_program: str = "qdel"
    needs_error_file: bool = False  # its directives always name an error file (no merged output)
    # why it cannot run a chain (hvdrun qsub --chain), None where it can: a job that starts after another ended
    # however it ended (afterany)
    no_chain: str | None = None

    @abstractmethod
    def directives(self, spec: JobSpec) -> list[str]:
        """The directive lines (with their prefix) for ``spec``, in the order a user would write them."""

    def dependency(self, spec: JobSpec) -> str:
        """The dependency type of ``spec.after``: ``afterok``, or ``afterany`` for the next job of a chain."""
        return "afterany" if spec.after_any else "afterok"

    def extra_directive(self, text: str) -> str:
        """A ``--directive`` / ``extra_directives`` item as a full line (the prefix is added when missing)."""
        text = text.strip()
        if "\n" in text or "\0" in text or "\r" in text:
            raise UsageError(f"--directive {text!r}: one directive per option, no line breaks")
        if text.startswith(self.rules.prefix):
            text = text[len(self.rules.prefix):].strip()
        if not text.startswith("-"):
            raise UsageError(f"--directive {text!r}: expected {self.kind} options such as "
                             f"'{self.example_directive}' (the '{self.rules.prefix}' prefix is optional)")
        if " #" in text or "\t#" in text:
            raise UsageError(f"--directive {text!r}: no comments on a directive line "
                             f"({self.kind} may read them as options)")
        return f"{self.rules.prefix} {text}"

    example_directive: str = "-l place=scatter"

    @abstractmethod
    def submit_argv(self, spec: JobSpec, script: str) -> list[str]:
        """The command that submits ``script``."""

    @abstractmethod
    def parse_job_id(self, stdout: str) -> str:
        """The job id in the submit command's output.

        Raises:
            JobError: no job id in it.
        """

    @abstractmethod
    def status(self, job_id: str) -> JobStatus:
        """The job's current status (state UNKNOWN when the scheduler no longer knows it)."""

    def cancel(self, job_id: str) -> bool:
        """Cancel the job; False when it had already finished or is unknown (not an error)."""
        if self.status(job_id).done:
            return False
        done = run_scheduler_command([self.cancel_program, job_id], ok_codes=range(256))
        if done.returncode == 0:
            return True
        if self.status(job_id).done:  # it ended meanwhile: what the user wanted
            return False
        raise JobError(command_failure(f"{self.cancel_program} {job_id}", done))

    names_default_queue: bool = False  # its queue listing names the queue a job without one goes to

    def queue_limits_argv(self) -> list[str] | None:
        """The command that lists every queue with its limits (None: hvdrun does not ask this scheduler)."""
        return None

    def parse_queue_limits(self, stdout: str) -> ServerQueues:
        """The queues in the output of :meth:`queue_limits_argv`.

        Raises:
            JobError: the output is not in the form expected.
        """
        raise JobError(f"hvdrun reads no queue limits from {self.kind}")

    def ask_queues(self, timeout_s: float) -> ServerQueues:
        """Ask the server for its queues and their limits, once, within ``timeout_s``.

        Raises:
            JobError: no answer in time, a failed command (with its last line of output), or an unreadable answer.
        """
        argv = self.queue_limits_argv()
        if argv is None:
            raise JobError(f"hvdrun reads no queue limits from {self.kind}")
        done = run_scheduler_command(argv, ok_codes=range(256), retries=0, timeout_s=timeout_s)
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
            raise JobError(f"'{shlex.join(argv)}' failed with exit code {done.returncode}: {said}")
        return self.parse_queue_limits(done.stdout)

    def submit(self, spec: JobSpec, script: str) -> str:
        """Submit ``script`` and return the job id."""
        argv = self.submit_argv(spec, script)
        done = run_scheduler_command(argv, retries=0)
        try:
            return self.parse_job_id(done.stdout)
        except JobError as e:
            raise JobError(f"{e}\n{command_failure(shlex.join(argv), done)}") from None


def first_match(pattern: re.Pattern[str], text: str, what: str) -> str:
    """The first group of the first line of ``text`` that matches ``pattern`` in full."""
    for line in text.splitlines():
        match = pattern.fullmatch(line.strip())
        if match:
            return match.group(1)
    raise JobError(f"no {what} in the output")
