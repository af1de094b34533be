#!/usr/bin/env python3
"""FAKE PBS Pro ``qsub`` / ``qstat`` / ``qdel`` for tests (usage: ``fake_pbspro.py qsub ARGS...``).

This replays only what the PBS Pro man pages (qsub.1B, qstat.1B,
pbs_job_attributes.7B) and ALCF's user guides document, as recorded in the project's reference notes:

- ``qsub [-o PATH] [-e PATH] [-j oe] SCRIPT``: ``#PBS`` lines are read up to the first command; ALCF
  rejects a job without ``-A`` ("qsub: Account_Name is required to be set.") or without
  ``filesystems`` ("qsub: Resource: filesystems is required to be set."); prints ``SEQ.SERVER``;
  the job runs with PBS_JOBID, PBS_JOBNAME, PBS_NODEFILE (one line per chunk of ``select=N``),
  PBS_O_WORKDIR, PBS_QUEUE, PBS_ENVIRONMENT=PBS_BATCH, in $HOME;
- ``qstat -x -f -F json ID``: ``{"Jobs": {ID: {job_state, Exit_status, comment, exec_host, ...}}}``;
  an unknown id prints "qstat: Unknown Job Id ID" (exit 153);
- ``qdel ID``: a finished job gives "qdel: Job has finished ID" (exit 35); a killed job's
  ``Exit_status`` is 271 (256 + SIGTERM);
- ``qstat -Q``: not replayed (exit 2). Queues, job history, refusals and everything else PBS does are tested
  against a real OpenPBS server (tests/pbs_server.py); this fake remains only for the jobs that run Cray PALS
  ``mpiexec`` (Polaris's GPU order), which no server here can run.
It is not PBS, and a test through it proves only hvdrun's side of the contract.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import fake_batch

SERVER = "fakepbs-01.hsn.cm.polaris.alcf.anl.gov"


def directives(script: str) -> list[str]:
    words = []
    for line in Path(script).read_text().splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#PBS "):
            words.extend(stripped[5:].split())
        elif stripped and not stripped.startswith("#"):
            break
    return words


def option_pairs(words: list[str]) -> list[tuple[str, str]]:
    pairs, it = [], iter(words)
    for word in it:
        if word.startswith("-") and len(word) == 2:
            pairs.append((word, next(it, "")))
    return pairs


def qsub(args: list[str]) -> int:
    script = args[-1]
    pairs = option_pairs(directives(script)) + option_pairs(args[:-1])  # the command line wins
    options: dict[str, str] = {}
    resources: dict[str, str] = {}
    for flag, value in pairs:
        if flag == "-l":
            for item in value.split(","):
                key, _, val = item.partition("=")
                resources[key] = val
        else:
            options[flag] = value
    if "-A" not in options:
        print("qsub: Account_Name is required to be set.", file=sys.stderr)
        return 2
    if "filesystems" not in resources:
        print("qsub: Resource: filesystems is required to be set.", file=sys.stderr)
        return 2
    nodes = int(re.match(r"\d+", resources.get("select", "1")).group())
    job_id = f"{fake_batch.next_id(8000)}.{SERVER}"
    nodefile = fake_batch.state_dir() / f"nodefile.{job_id.split('.')[0]}"
    nodefile.write_text("".join(f"{h}\n" for h in fake_batch.hosts(nodes)))
    name = options.get("-N", Path(script).name)
    merged = options.get("-j") == "oe"
    output = options.get("-o") or str(Path.cwd() / f"{name}.o{job_id.split('.')[0]}")
    env = {"PBS_JOBID": job_id, "PBS_JOBNAME": name, "PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": os.getcwd(),
           "PBS_QUEUE": options.get("-q", "workq"), "PBS_ENVIRONMENT": "PBS_BATCH", "PBS_O_HOST": "fakelogin"}
    fake_batch.start(job_id, {"argv": ["bash", script], "cwd": str(Path.home()), "env": env, "output": output,
                              "error": None if merged else options.get("-e"), "name": name,
                              "queue": env["PBS_QUEUE"], "hosts": fake_batch.hosts(nodes),
                              "hold_s": os.environ.get("FAKE_SCHED_HOLD_S"), "submitted": time.time()})
    print(job_id)
    return 0


def qstat(args: list[str]) -> int:
    if "-Q" in args or "-Qf" in args:
        print("fake qstat: queues are not replayed (tests ask a real OpenPBS server)", file=sys.stderr)
        return 2
    if not {"-f", "-F", "json", "-x"} <= set(args):
        print("fake qstat: only 'qstat -x -f -F json ID' is replayed", file=sys.stderr)
        return 2
    job_id = args[-1]
    job = fake_batch.read(job_id)
    if job is None:
        print(f"qstat: Unknown Job Id {job_id}", file=sys.stderr)
        return 153
    full_id = f"{job_id.split('.')[0]}.{SERVER}"
    fields = {"Job_Name": job["name"], "Job_Owner": "me@fakelogin", "queue": job["queue"],
              "job_state": {"queued": "Q", "running": "R", "done": "F"}[job["state"]]}
    if job["state"] == "queued":
        fields["comment"] = "Not Running: Insufficient amount of resource: ncpus (R: 64 A: 0 T: 2560)"
    else:
        fields["exec_host"] = "+".join(f"{h}/0*64" for h in job["hosts"])
        chunks = "+".join(f"{h}:ncpus=64" for h in job["hosts"])
        fields["comment"] = f"Job run at Tue Nov 24 at 00:00 on ({chunks})"
    if job["state"] == "done":
        fields["Exit_status"] = 271 if job["exit"] == fake_batch.KILLED else int(job["exit"])
        fields["comment"] += " and finished"
    print(json.dumps({"timestamp": int(time.time()), "pbs_version": "2022.1.3", "pbs_server": SERVER,
                      "Jobs": {full_id: fields}}, indent=4))
    return 0


def qdel(args: list[str]) -> int:
    job_id = args[-1]
    job = fake_batch.read(job_id)
    if job is None:
        print(f"qdel: Unknown Job Id {job_id}", file=sys.stderr)
        return 153
    if job["state"] == "done":
        print(f"qdel: Job has finished {job_id}", file=sys.stderr)
        return 35
    fake_batch.stop(job_id)
    return 0


if __name__ == "__main__":
    sys.exit({"qsub": qsub, "qstat": qstat, "qdel": qdel}[sys.argv[1]](sys.argv[2:]))
