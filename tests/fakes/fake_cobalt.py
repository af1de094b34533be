#!/usr/bin/env python3
"""FAKE Cobalt ``qsub`` / ``qstat`` / ``qdel`` for tests (usage: ``fake_cobalt.py qsub ARGS...``).

Cobalt (ALCF, retired) has no public package. This replays only what ALCF's archived ThetaGPU
guides document, as recorded in the project's reference notes:

- ``qsub [--mode script] SCRIPT``: ``#COBALT`` directives are read from the topmost lines and a
  blank line ends them; without ``-n``, ``-t`` and ``-A`` qsub fails ("No required options
  provided"); the script must be executable; a job without ``filesystems`` gets a warning on
  stderr; qsub prints only the job id; the job runs the script path with COBALT_JOBID,
  COBALT_NODEFILE (one short host name per line), COBALT_JOBSIZE, COBALT_PARTNAME;
- ``qstat --header COLS ID``: a header line, a rule of ``=``, one row per queued or running job
  (states ``queued``, ``running``, ...); a finished job is no longer listed;
- ``qdel ID``: deletes the job.
It is not Cobalt, and a test through it proves only hvdrun's side of the contract.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import fake_batch


def directives(script: str) -> list[str]:
    words = []
    for line in Path(script).read_text().splitlines()[1:]:
        if not line.startswith("#COBALT "):
            break
        words.extend(shlex.split(line[len("#COBALT "):]))
    return words


def qsub(args: list[str]) -> int:
    script = args[-1]
    words, options = directives(script), {}
    for index, word in enumerate(words):
        if word.startswith("-"):
            options[word] = words[index + 1] if index + 1 < len(words) else ""
    if not {"-n", "-t", "-A"} <= set(options):
        print("No required options provided", file=sys.stderr)
        return 1
    if not os.access(script, os.X_OK):
        print(f"command {script} is not executable", file=sys.stderr)
        return 1
    if "filesystems=" not in options.get("--attrs", ""):
        print("Warning: no filesystems requested; the job is tagged as needing all of them", file=sys.stderr)
    job_id = str(fake_batch.next_id(400000))
    nodes = fake_batch.hosts(int(options["-n"]))
    nodefile = fake_batch.state_dir() / f"nodefile.{job_id}"
    nodefile.write_text("".join(f"{h}\n" for h in nodes))
    env = {"COBALT_JOBID": job_id, "COBALT_NODEFILE": str(nodefile), "COBALT_JOBSIZE": str(len(nodes)),
           "COBALT_PARTNAME": ",".join(nodes)}
    cwd = Path.cwd()
    fake_batch.start(job_id, {"argv": [str(Path(script).resolve())], "cwd": str(cwd), "env": env,
                              "output": options.get("-o", str(cwd / f"{job_id}.output")),
                              "error": options.get("-e", str(cwd / f"{job_id}.error")),
                              "name": options.get("--jobname", "N/A"), "queue": options.get("-q", "default"),
                              "hosts": nodes, "walltime": options["-t"], "hold_s": os.environ.get("FAKE_SCHED_HOLD_S"),
                              # Cobalt's own variables of the job's start and end (seconds since the epoch), set as
                              # the job starts
                              "times_env": ("COBALT_STARTTIME", "COBALT_ENDTIME", 60 * int(options["-t"]))})
    print(job_id)
    return 0


def qstat(args: list[str]) -> int:
    header = args[args.index("--header") + 1].split(":") if "--header" in args else ["JobID", "State"]
    job_id = args[-1]
    job = fake_batch.read(job_id)
    if job is None or job["state"] == "done":
        return 0
    minutes = int(job["walltime"]) if job["walltime"].isdigit() else 0
    values = {"JobID": job_id, "JobName": job["name"], "User": "me",
              "WallTime": f"{minutes // 60:02d}:{minutes % 60:02d}:00",
              "State": job["state"], "Nodes": str(len(job["hosts"])),
              "Location": ":".join(job["hosts"]) if job["state"] == "running" else "None", "Queue": job["queue"]}
    rows = [header, [values.get(column, "-") for column in header]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("=" * (sum(widths) + 2 * (len(widths) - 1)))
    print("  ".join(v.ljust(w) for v, w in zip(rows[1], widths, strict=True)))
    return 0


def qdel(args: list[str]) -> int:
    job_id = args[-1]
    print("      Deleted Jobs\nJobID  User\n=====================")
    if fake_batch.stop(job_id):
        print(f"{job_id}  me")
    return 0


if __name__ == "__main__":
    sys.exit({"qsub": qsub, "qstat": qstat, "qdel": qdel}[sys.argv[1]](sys.argv[2:]))
