"""When the allocation this process runs in ends, as its scheduler says, and the durations schedulers print.

Inside a PBS job the server knows the job's start (``stime``) and its ``Resource_List.walltime``
(``qstat -f -F json $PBS_JOBID``); inside a Slurm job the controller knows the time left (``squeue -h -j
$SLURM_JOB_ID -o %L``); a Cobalt job carries its end in its environment (``COBALT_ENDTIME``, seconds since the
epoch). Outside a job, or where the scheduler does not answer in time, there is no deadline and the caller is told
why in one line. It imports nothing of hvdrun but the variable names, so the launcher and the jobs' code can both
read it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hvdrun.envvars import DEADLINE, LC_ALL, WARN_BEFORE, WARN_SIGNAL

ASK_TIMEOUT_S = 10.0  # the scheduler's answer; past it the job runs without a deadline
_PBS_CONF = "/etc/pbs.conf"
_PBS_DURATION = re.compile(r"(?:(?:([0-9]+):)?([0-9]+):)?([0-9]+)(?:\.[0-9]+)?")
# Slurm's time forms: minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]]
_SLURM_TIME = re.compile(r"(?:([0-9]+)-)?([0-9]+)(?::([0-9]+))?(?::([0-9]+))?")
_SLURM_UNLIMITED = ("UNLIMITED", "INFINITE")


@dataclass(frozen=True)
class Deadline:
    """The moment the allocation ends (seconds since the epoch) and where that was read."""

    ends_at: float
    source: str

    def time_left(self, now: float | None = None) -> float:
        """Seconds until the end (negative once past it)."""
        return self.ends_at - (time.time() if now is None else now)

    def describe(self, now: float | None = None) -> str:
        """``ends at 2026-12-07 23:05:00 UTC (in 0:04:12), from qstat ...``."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.ends_at))
        left = max(self.time_left(now), 0.0)
        return f"ends at {stamp} (in {format_duration(left)}), from {self.source}"


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` of a non-negative number of seconds (rounded down)."""
    whole = int(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def pbs_duration_s(value: object) -> int | None:
    """A PBS duration: ``[[hours:]minutes:]seconds[.ms]`` (printed ``HH:MM:SS``), or seconds as a number; None
    when absent or not a duration."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return int(value) or None
    match = _PBS_DURATION.fullmatch(str(value).strip())
    if not match:
        return None
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return (hours * 3600 + minutes * 60 + seconds) or None


def slurm_duration_s(text: str) -> int | None:
    """Seconds of a Slurm time (``UNLIMITED``: None): ``30``, ``30:00``, ``01:00:00``, ``1-00:00:00``, ``2-12``."""
    match = None if text.upper() in _SLURM_UNLIMITED else _SLURM_TIME.fullmatch(text.strip())
    if match is None:
        return None
    days, first, second, third = match.groups()
    if days is not None:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
    elif third is not None:  # hours:minutes:seconds
        hours, minutes, seconds = int(first), int(second), int(third)
    else:  # minutes[:seconds]
        hours, minutes, seconds = 0, int(first), int(second or 0)
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds or None


class NoDeadline(Exception):
    """Why this allocation's end is not known (one line for the user)."""


def find_deadline(environ: Mapping[str, str], timeout_s: float = ASK_TIMEOUT_S) -> Deadline:
    """The end of the allocation ``environ`` belongs to.

    Raises:
        NoDeadline: not inside a PBS, Slurm or Cobalt job, the job has no walltime, or its scheduler did not answer
            within ``timeout_s`` (the message says which).
    """
    if environ.get("SLURM_JOB_ID"):  # first: Slurm sets PBS_JOBID too, for Torque-style scripts
        return _slurm_deadline(environ, environ["SLURM_JOB_ID"], timeout_s)
    if environ.get("PBS_JOBID"):
        return _pbs_deadline(environ, environ["PBS_JOBID"], timeout_s)
    if environ.get("COBALT_JOBID"):
        return _cobalt_deadline(environ)
    raise NoDeadline("not inside a PBS, Slurm or Cobalt job (no PBS_JOBID, SLURM_JOB_ID or COBALT_JOBID)")


def pbs_program(name: str, environ: Mapping[str, str]) -> str:
    """A PBS client program: in ``PBS_EXEC/bin`` of the PBS configuration file (``PBS_CONF_FILE``, else
    /etc/pbs.conf), else on PATH. The configuration's first: a job's PATH may lack PBS's directory, or find a
    Torque-style wrapper of another scheduler there first (Slurm's ``qstat``)."""
    conf = environ.get("PBS_CONF_FILE") or _PBS_CONF
    try:
        settings = dict(line.strip().split("=", 1) for line in Path(conf).read_text().splitlines() if "=" in line)
    except OSError:
        settings = {}
    own = Path(settings.get("PBS_EXEC", "/nonexistent")) / "bin" / name
    return str(own) if os.access(own, os.X_OK) else (shutil.which(name, path=environ.get("PATH")) or name)


def _ask(argv: list[str], environ: Mapping[str, str], timeout_s: float) -> str:
    """The stdout of ``argv``, or NoDeadline with the reason it gave none."""
    command = " ".join(argv)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
                              env={**environ, LC_ALL: "C"}, check=False)
    except FileNotFoundError:
        raise NoDeadline(f"'{argv[0]}' is not on PATH here, so the job's end is unknown") from None
    except subprocess.TimeoutExpired:
        raise NoDeadline(f"'{command}' did not answer within {timeout_s:g} s") from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise NoDeadline(f"'{command}' failed with exit code {done.returncode}: {said}")
    return done.stdout


def _pbs_deadline(environ: Mapping[str, str], job_id: str, timeout_s: float) -> Deadline:
    argv = [pbs_program("qstat", environ), "-f", "-F", "json", job_id]
    command = f"qstat -f -F json {job_id}"
    try:
        jobs = json.loads(_ask(argv, environ, timeout_s)).get("Jobs") or {}
    except (ValueError, AttributeError):
        raise NoDeadline(f"'{command}' printed something that is not PBS's JSON") from None
    fields = next((value for name, value in jobs.items() if name.split(".")[0] == job_id.split(".")[0]), None)
    if not isinstance(fields, dict):
        raise NoDeadline(f"'{command}' does not list job {job_id}")
    resources = fields.get("Resource_List")
    walltime = pbs_duration_s(resources.get("walltime") if isinstance(resources, dict) else None)
    if walltime is None:
        raise NoDeadline(f"job {job_id} has no walltime ({command}: no Resource_List.walltime)")
    started = _pbs_time(fields.get("stime"))
    if started is None:
        raise NoDeadline(f"job {job_id} has no start time yet ({command}: no stime)")
    return Deadline(started + walltime, f"{command} (stime + Resource_List.walltime {format_duration(walltime)})")


def _pbs_time(value: object) -> float | None:
    """PBS's ``stime``: ``Mon Dec  7 23:05:00 2026`` in the server's local time, or seconds since the epoch."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    try:
        return time.mktime(time.strptime(" ".join(str(value).split()), "%a %b %d %H:%M:%S %Y"))
    except ValueError:
        return None


def _slurm_deadline(environ: Mapping[str, str], job_id: str, timeout_s: float) -> Deadline:
    asked = time.time()
    text = _ask(["squeue", "-h", "-j", job_id, "-o", "%L"], environ, timeout_s).strip()
    left = slurm_duration_s(text) if text else None
    if left is None:
        raise NoDeadline(f"job {job_id} has no time limit (squeue -h -j {job_id} -o %L: {text or 'nothing'})")
    return Deadline(asked + left, f"squeue -h -j {job_id} -o %L (time left {text})")


def _cobalt_deadline(environ: Mapping[str, str]) -> Deadline:
    text = environ.get("COBALT_ENDTIME", "")
    try:
        return Deadline(float(text), "COBALT_ENDTIME of the job's environment")
    except ValueError:
        raise NoDeadline(f"COBALT_ENDTIME {text!r} is not seconds since the epoch") from None


def time_left(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds until the allocation ends, as hvdrun told the ranks (``HVDRUN_DEADLINE``); None without one."""
    text = (os.environ if environ is None else environ).get(DEADLINE, "")
    try:
        return float(text) - time.time() if text else None
    except ValueError:
        return None


def warning_due(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the time left is within ``--warn-before`` (``HVDRUN_WARN_BEFORE``): the moment hvdrun warns."""
    environ = os.environ if environ is None else environ
    left = time_left(environ)
    try:
        lead = float(environ.get(WARN_BEFORE, ""))
    except ValueError:
        return False
    return left is not None and left <= lead


def warn_again_if_due(environ: Mapping[str, str] | None = None) -> bool:
    """In a rank's ``init()``: where the warning is already due and the script has its handler for the warning's
    signal by now, raise the signal here (a rank still starting when hvdrun sent it had it ignored, a rank under
    mpiexec could not be reached before it joined). Returns whether it did."""
    environ = os.environ if environ is None else environ
    text = environ.get(WARN_SIGNAL, "")
    if not text.isdigit() or not warning_due(environ):
        return False
    try:
        handler = signal.getsignal(int(text))
    except ValueError:
        return False
    if not callable(handler):  # ignored or the default: nothing of the script's would hear it
        return False
    signal.raise_signal(int(text))
    return True


class JobEvents:
    """What a job of a chain leaves for the next (``HVDRUN_JOB_EVENTS``, a JSON file written whole or not at all):
    when its hvdrun warned the ranks before the walltime, and the stop signal that ended it, if one did."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def read(self) -> dict[str, object]:
        """The events noted so far (none when the file is missing or unreadable)."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @property
    def warned(self) -> bool:
        """Whether the job's hvdrun warned its ranks."""
        return "warned_at" in self.read()

    @property
    def warned_at(self) -> float | None:
        """When the job's hvdrun warned its ranks (seconds since the epoch), if it did."""
        value = self.read().get("warned_at")
        return float(value) if isinstance(value, int | float) else None

    def clear(self) -> None:
        """Forget the events of an earlier run of the job (a requeued job starts again)."""
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass  # unreadable to us as well: its events are read as none

    @property
    def stop_signal(self) -> str | None:
        """The stop signal (``SIGTERM``) that ended the job's hvdrun, if one did."""
        value = self.read().get("stopped_by")
        return str(value) if value else None

    def note_warned(self, signal_name: str) -> None:
        """Note that the ranks were warned now, with ``signal_name``."""
        self._note(warned_at=time.time(), warn_signal=signal_name)

    def note_stopped(self, signal_name: str) -> None:
        """Note that ``signal_name`` stopped the job's hvdrun now."""
        self._note(stopped_by=signal_name, stopped_at=time.time())

    def _note(self, **values: object) -> None:
        from hvdrun.atomic_files import write_text_atomically

        try:
            write_text_atomically(self.path, json.dumps({**self.read(), **values}))
        except OSError as e:  # the job goes on; the chain then treats the job as ended without a word
            import sys

            print(f"hvdrun: warning: cannot note the job's events in {self.path}: {e.strerror or e}", file=sys.stderr,
                  flush=True)
