#!/usr/bin/env python3
"""FAKE batch-job runner shared by the FAKE PBS Pro and FAKE Cobalt commands (tests only).

PBS Pro and Cobalt cannot be installed here; ``fake_pbspro.py`` and ``fake_cobalt.py`` replay what
their documentation says their commands print, and use this module to run a submitted script for
real on this machine: ``python fake_batch.py run JOBDIR`` runs detached, optionally stays queued for
``FAKE_SCHED_HOLD_S`` seconds, runs the script with the variables the scheduler would set, and keeps
its state in JOBDIR (``state``: queued/running/done, ``exit``, ``pid``). SIGTERM (``qdel``) stops
the script's process group. Nothing here is scheduler behaviour proven by a real scheduler.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

KILLED = "killed"


def state_dir() -> Path:
    path = Path(os.environ.get("FAKE_SCHED_DIR", "/tmp/fake-sched"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def next_id(start: int) -> int:
    counter = state_dir() / "counter"
    value = int(counter.read_text()) + 1 if counter.exists() else start
    write(counter, str(value))
    return value


def write(path: Path, text: str) -> None:
    """Replace ``path`` atomically: a qstat that reads it meanwhile sees the old text or the new, never ''."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def job_dir(job_id: str) -> Path:
    return state_dir() / "jobs" / job_id.split(".")[0]


def hosts(count: int) -> list[str]:
    names = os.environ.get("FAKE_SCHED_HOSTS", "localhost").split(",")
    return [names[i % len(names)] for i in range(count)]


def start(job_id: str, job: dict) -> None:
    """Record ``job`` (script, env, outputs, cwd) and start its detached runner."""
    directory = job_dir(job_id)
    directory.mkdir(parents=True)
    write(directory / "job.json", json.dumps(job))
    write(directory / "state", "queued")
    subprocess.Popen([sys.executable, __file__, "run", str(directory)], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def read(job_id: str) -> dict | None:
    directory = job_dir(job_id)
    if not (directory / "job.json").exists():
        return None
    job = json.loads((directory / "job.json").read_text())
    job["state"] = (directory / "state").read_text().strip()
    exit_path = directory / "exit"
    job["exit"] = exit_path.read_text().strip() if exit_path.exists() else None
    return job


def stop(job_id: str) -> bool:
    """SIGTERM the job's runner (it stops the script); False when it is not running."""
    directory = job_dir(job_id)
    try:
        pid = int((directory / "runner.pid").read_text())
        if (directory / "state").read_text().strip() == "done":
            return False
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        return False
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (directory / "state").read_text().strip() != "done":
        time.sleep(0.05)
    return True


def run(directory: Path) -> None:
    job = json.loads((directory / "job.json").read_text())
    write(directory / "runner.pid", str(os.getpid()))
    child: list[subprocess.Popen[bytes]] = []

    def on_term(_signum: int, _frame: object) -> None:
        if child:
            try:
                os.killpg(child[0].pid, signal.SIGTERM)
                child[0].wait(10)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(child[0].pid, signal.SIGKILL)
        write(directory / "exit", KILLED)
        write(directory / "state", "done")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    time.sleep(float(job.get("hold_s") or 0))
    started = time.time()
    write(directory / "started", str(started))
    out = open(job["output"], "ab")
    err = open(job["error"], "ab") if job.get("error") else out
    times = {}
    if job.get("times_env"):  # (start variable, end variable, walltime in seconds)
        start_name, end_name, seconds = job["times_env"]
        times = {start_name: str(int(started)), end_name: str(int(started) + seconds)}
    child.append(subprocess.Popen(job["argv"], cwd=job["cwd"], env={**os.environ, **job["env"], **times},
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True))
    write(directory / "state", "running")
    code = child[0].wait()
    write(directory / "exit", str(code))
    write(directory / "state", "done")


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        run(Path(sys.argv[2]))
