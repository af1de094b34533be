"""``hvdrun qsub --chain N``: training longer than a walltime as up to N jobs, each starting after the previous one
ended (``afterany``), each resuming from the last checkpoint.

The rule, applied to a job of the chain as it ends (its own last line) and again by the next job as it starts
(where the previous one was killed before it could):

- warned by its hvdrun before the walltime (``--warn-before``), or stopped by a signal (killed at the limit,
  preempted, ``qdel`` of that one job): the next job runs and resumes;
- exit code 0 before any warning: training is done, the rest of the chain is cancelled;
- another exit code before any warning: a real error; the chain stops there, the rest is cancelled, and that code
  is the chain's.

The chain's file (beside the jobs' output) lists its jobs; the verdict that ended it is a second file, created once
(the first verdict stands). ``hvdrun qstat CHAIN`` lists the jobs with their states, ``hvdrun qdel CHAIN`` cancels
them all (the last first: cancelling a job releases the one that waits for it), ``--wait`` follows the whole chain.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hvdrun.atomic_files import write_text_atomically
from hvdrun.envvars import jobs_dir
from hvdrun.errors import JobError, JobInterrupted, UsageError
from hvdrun.jobs import scheduler_for
from hvdrun.jobs.follow import SubmittedJob, current_status, follow, read_exit_file, submit
from hvdrun.jobs.scheduler import ChainLink, JobSpec
from hvdrun.walltime import JobEvents

CHAIN_PREFIX = "chain-"
GO_ON, DONE, FAILED, UNDECIDED = "go on", "done", "failed", "undecided"
_HOW_IT_ENDED = {DONE: "training done", FAILED: "failed"}  # a verdict's words for a decision that ends the chain
Echo = Callable[[str], None]


@dataclass(frozen=True)
class Verdict:
    """How the chain ended: at which job (its number from 1, 0 for ``qdel`` of the chain), how, and its code."""

    number: int
    how: str  # "training done", "failed", "ran out", "cancelled"
    exit_code: int
    reason: str

    def describe(self) -> str:
        """``ended at job 3 of 3: training done (exit code 0 before any warning)``."""
        where = f"at job {self.number}" if self.number else "by hvdrun qdel"
        return f"ended {where}: {self.how} ({self.reason})"


@dataclass(frozen=True)
class Chain:
    """A chain as its file lists it."""

    path: Path
    scheduler: str
    length: int
    jobs: tuple[SubmittedJob, ...]
    events: tuple[str, ...]  # each job's events file, by number - 1

    @property
    def chain_id(self) -> str:
        """``chain-`` and the first job's id (what ``hvdrun qstat`` and ``qdel`` take)."""
        return f"{CHAIN_PREFIX}{self.jobs[0].job_id}" if self.jobs else f"{CHAIN_PREFIX}{self.path.stem}"

    @property
    def verdict_path(self) -> Path:
        """The file of the verdict that ended the chain."""
        return self.path.with_suffix(".ended.json")

    def verdict(self) -> Verdict | None:
        """How the chain ended; None while it goes on."""
        try:
            return Verdict(**json.loads(self.verdict_path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def end(self, verdict: Verdict) -> Verdict:
        """Record ``verdict`` unless one is recorded already; returns the one that stands.

        Raises:
            JobError: the verdict cannot be written beside the chain's file.
        """
        try:
            fd, temporary = tempfile.mkstemp(prefix=f".{self.verdict_path.name}.", dir=self.path.parent)
            with os.fdopen(fd, "w") as file:
                file.write(json.dumps(asdict(verdict)))
            try:
                os.link(temporary, self.verdict_path)  # whole, and only if none exists: the first verdict stands
            except FileExistsError:
                pass
            finally:
                os.unlink(temporary)
        except OSError as e:
            raise JobError(f"chain {self.chain_id}: cannot write its verdict in {self.path.parent}: "
                           f"{e.strerror or e}") from None
        return self.verdict() or verdict

    def cancel_after(self, number: int, echo: Echo) -> None:
        """Cancel every job after job ``number``, the last first (cancelling a job would release its successor)."""
        scheduler = scheduler_for(self.scheduler)
        for job in reversed(self.jobs[number:]):
            try:
                if scheduler.cancel(job.job_id):
                    echo(f"hvdrun: chain {self.chain_id}: cancelled job {job.job_id}")
            except JobError as e:
                echo(f"hvdrun: warning: chain {self.chain_id}: could not cancel job {job.job_id}: {e}")


def load_chain(path: str | os.PathLike[str]) -> Chain:
    """The chain of the file ``path``.

    Raises:
        UsageError: no such file, or not a chain's.
    """
    try:
        data = json.loads(Path(path).read_text())
        jobs = tuple(SubmittedJob(**job) for job in data["jobs"])
        return Chain(Path(path), data["scheduler"], int(data["length"]), jobs, tuple(data["events"]))
    except OSError as e:
        raise UsageError(f"chain file {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path} is not a chain's file ({type(e).__name__}: {e})") from None


def _save(chain: Chain) -> None:
    try:
        write_text_atomically(chain.path, json.dumps({
            "scheduler": chain.scheduler, "length": chain.length, "jobs": [asdict(job) for job in chain.jobs],
            "events": list(chain.events)}, indent=1))
    except OSError as e:
        raise UsageError(f"-o/--output: cannot write the chain's file {chain.path}: {e.strerror or e}") from None


# -- submitting -----------------------------------------------------------------------------------------------

def link_spec(spec: JobSpec, chain_file: Path, number: int, previous: str | None) -> JobSpec:
    """Job ``number`` of the chain: its own output, exit code, script and events files (``NAME.N.*``), after the
    previous job however that one ended."""
    stem = Path(spec.exit_file).with_suffix("")
    output = Path(spec.output)
    return replace(spec, output=str(output.with_name(f"{output.stem}.{number}{output.suffix}")),
                   error=str(Path(spec.error).with_name(f"{Path(spec.error).stem}.{number}.error")) if spec.error
                   else None, exit_file=f"{stem}.{number}.exitcode",
                   script_path=f"{stem}.{number}.{spec.scheduler}.sh",
                   after=(previous,) if previous else spec.after, after_any=previous is not None,
                   link=ChainLink(str(chain_file), number, f"{stem}.{number}.events.json"))


def chain_file_of(spec: JobSpec) -> Path:
    """The chain's file: ``NAME-STAMP.chain.json`` beside the jobs' output."""
    return Path(spec.exit_file).with_suffix(".chain.json")


def first_link(spec: JobSpec) -> JobSpec:
    """The first job of a chain of ``spec`` (what ``hvdrun qsub --chain N --dry-run`` prints)."""
    return link_spec(spec, chain_file_of(spec), 1, None)


def submit_chain(spec: JobSpec, length: int, render: Callable[[JobSpec], str], echo: Echo) -> Chain:
    """Submit ``length`` jobs of ``spec``, each after the previous one; returns the chain (recorded for
    ``hvdrun qstat`` / ``qdel``)."""
    chain_file = chain_file_of(spec)
    if chain_file.exists():  # an earlier chain's verdict and events would decide this one
        raise UsageError(f"-o/--output: {chain_file} is an earlier chain's; give each chain its own output (-o DIR/ "
                         "names the files by the time of submission)")
    chain = Chain(chain_file, spec.scheduler, length, (), ())
    previous = None
    for number in range(1, length + 1):
        link = link_spec(spec, chain_file, number, previous)
        chain = replace(chain, events=(*chain.events, link.link.events_file if link.link else ""))
        _save(chain)  # the job's number is in the file before the job can start
        try:
            job = submit(link, render(link))
        except JobError as e:
            if not chain.jobs:
                raise
            echo(f"hvdrun: warning: chain: job {number} of {length} could not be submitted ({e}); the chain has "
                 f"{len(chain.jobs)} jobs")
            chain = replace(chain, length=len(chain.jobs), events=chain.events[:-1])
            _save(chain)  # its last job then knows it is the last
            break
        chain = replace(chain, jobs=(*chain.jobs, job))
        _save(chain)
        previous = job.job_id
    _record(chain)
    return chain


def _record_path(chain_id: str) -> Path:
    return jobs_dir() / f"{chain_id.replace('/', '_')}.json"


def _record(chain: Chain) -> None:
    try:
        jobs_dir().mkdir(parents=True, exist_ok=True)
        _record_path(chain.chain_id).write_text(json.dumps({"chain_file": str(chain.path)}))
    except OSError:
        pass  # a read-only home loses only the convenience: the chain's file still names every job


def is_chain_id(text: str) -> bool:
    """Whether ``text`` names a chain (``chain-ID``, or a chain's file)."""
    return text.startswith(CHAIN_PREFIX) or text.endswith(".chain.json")


def find_chain(text: str) -> Chain:
    """The chain ``text`` names: ``chain-ID`` as ``hvdrun qsub --chain`` printed it, or its file.

    Raises:
        UsageError: no chain of that name was recorded here.
    """
    if text.endswith(".chain.json"):
        return load_chain(text)
    try:
        return load_chain(json.loads(_record_path(text).read_text())["chain_file"])
    except (OSError, ValueError, KeyError):
        raise UsageError(f"no chain {text!r} was submitted from here ({jobs_dir()}); give its file instead "
                         "(NAME.chain.json beside the jobs' output)") from None


# -- the rule, inside the jobs ---------------------------------------------------------------------------------

def outcome(chain: Chain, number: int, exit_code: int | None, stopped_by: str | None = None) -> tuple[str, str]:
    """(GO_ON | DONE | FAILED | UNDECIDED, why) for job ``number`` that ended with ``exit_code`` (None: unknown),
    its script stopped by the signal ``stopped_by`` (None: it was not)."""
    events = JobEvents(chain.events[number - 1])
    if events.warned:
        return GO_ON, f"exit code {exit_code}, after hvdrun's warning before the walltime"
    stopped_by = stopped_by or events.stop_signal
    if stopped_by:
        return GO_ON, f"stopped by {stopped_by} (the walltime, preemption, or qdel) before any warning"
    if exit_code is None:
        return UNDECIDED, "ended without an exit code or a warning (killed, or its node lost)"
    if exit_code == 0:
        return DONE, "exit code 0 before any warning"
    return FAILED, f"exit code {exit_code} before any warning"


def link_ends(chain: Chain, number: int, exit_code: int | None, echo: Echo, stopped_by: str | None = None) -> None:
    """Job ``number`` ends with ``exit_code`` (None: unknown; its script stopped by ``stopped_by``, if it was):
    decide whether the chain goes on, and cancel the rest where not."""
    if chain.verdict() is not None:
        return
    decision, why = outcome(chain, number, exit_code, stopped_by)
    code = 1 if exit_code is None else exit_code
    if decision in _HOW_IT_ENDED:
        _end(chain, Verdict(number, _HOW_IT_ENDED[decision], code, why), number, echo)
    elif number >= chain.length:
        _end(chain, Verdict(number, "ran out", code, f"{why}; the last of {chain.length} jobs"), number, echo)
    else:
        echo(f"hvdrun: chain {chain.chain_id}: job {number} {why}: job {number + 1} resumes")


def link_begins(chain: Chain, number: int, echo: Echo) -> bool:
    """Job ``number`` starts: whether it runs (the chain goes on). The previous job is judged again here, in case
    it was killed before it could judge itself; this job's events of an earlier run (a requeue) are cleared."""
    verdict = chain.verdict()
    if verdict is None and number > 1:
        previous = chain.jobs[number - 2] if len(chain.jobs) >= number - 1 else None
        code = read_exit_file(previous.exit_file) if previous else None
        decision, why = outcome(chain, number - 1, code)
        if decision in _HOW_IT_ENDED:
            verdict = _end(chain, Verdict(number - 1, _HOW_IT_ENDED[decision], code or 0, why), number, echo)
        elif decision == UNDECIDED:
            echo(f"hvdrun: chain {chain.chain_id}: job {number - 1} {why}; this job resumes from its last checkpoint")
    if verdict is not None:
        echo(f"hvdrun: chain {chain.chain_id} {verdict.describe()}: job {number} does not run")
        return False
    JobEvents(chain.events[number - 1]).clear()
    return True


def _end(chain: Chain, verdict: Verdict, last_kept: int, echo: Echo) -> Verdict:
    """End the chain with ``verdict`` (unless one stands already) and cancel its jobs after job ``last_kept``."""
    standing = chain.end(verdict)
    echo(f"hvdrun: chain {chain.chain_id} {standing.describe()}")
    chain.cancel_after(last_kept, echo)
    return standing


# -- following, status and cancel ------------------------------------------------------------------------------

def follow_chain(chain: Chain, echo: Echo, sleep: Callable[[float], None] = time.sleep) -> int:
    """Follow every job of ``chain`` in turn until the chain ends; the exit code of the job that ended it.

    Raises:
        JobInterrupted: Ctrl-C (the chain keeps running).
    """
    for number, job in enumerate(chain.jobs, start=1):
        verdict = chain.verdict()
        if verdict is not None:
            return _ended(chain, verdict, echo)
        echo(f"hvdrun: chain {chain.chain_id}: job {number} of {chain.length} is {job.job_id}")
        try:
            code: int | None = follow(job, echo, sleep)
        except JobInterrupted:
            raise JobInterrupted(f"stopped following chain {chain.chain_id}; it keeps running ('hvdrun qdel "
                                 f"{chain.chain_id}' cancels it)", 130) from None
        except JobError as e:
            if chain.verdict() is None:
                echo(f"hvdrun: chain {chain.chain_id}: {e}")
            code = None
        if chain.verdict() is None and number == len(chain.jobs):
            link_ends(chain, number, code, echo)
    verdict = chain.verdict()
    if verdict is None:
        raise JobError(f"chain {chain.chain_id}: every job ended and none decided the chain; see {chain.path}")
    return _ended(chain, verdict, echo)


def _ended(chain: Chain, verdict: Verdict, echo: Echo) -> int:
    echo(f"hvdrun: chain {chain.chain_id} {verdict.describe()}")
    if verdict.how == "ran out":
        echo(f"hvdrun: warning: chain {chain.chain_id}: training is not done; submit another chain to go on (it "
             "resumes from the last checkpoint)")
    return verdict.exit_code


def describe_chain(chain: Chain) -> list[str]:
    """``hvdrun qstat CHAIN``: the chain, then one line per job with its state and how it ended."""
    verdict = chain.verdict()
    scheduler = scheduler_for(chain.scheduler)
    lines = [f"chain {chain.chain_id} ({chain.scheduler}, {len(chain.jobs)} jobs): "
             f"{verdict.describe() if verdict else 'going on'}"]
    for number, job in enumerate(chain.jobs, start=1):
        status = current_status(scheduler, job.job_id, job.exit_file)
        events = JobEvents(chain.events[number - 1])
        warned_at = events.warned_at
        notes = [f"warned at {time.strftime('%H:%M:%S', time.localtime(warned_at))}"] if warned_at else []
        notes += [f"stopped by {events.stop_signal}"] if events.stop_signal else []
        lines.append(f"  {number}  {job.job_id}  {status.describe()}" + (f"  ({', '.join(notes)})" if notes else ""))
    lines.append(f"  output: {Path(chain.jobs[0].output).parent if chain.jobs else chain.path.parent}")
    return lines


def cancel_chain(chain: Chain, echo: Echo) -> None:
    """``hvdrun qdel CHAIN``: the chain ends (cancelled) and every job still queued or running is cancelled."""
    standing = chain.end(Verdict(0, "cancelled", 143, "hvdrun qdel"))
    chain.cancel_after(0, echo)
    echo(f"hvdrun: chain {chain.chain_id} {standing.describe()}")
