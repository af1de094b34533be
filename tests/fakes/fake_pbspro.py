#!/usr/bin/env python3
"""FAKE PBS Pro ``qsub`` / ``qstat`` / ``qdel`` for tests (usage: ``fake_pbspro.py qsub ARGS...``).

PBS Pro cannot be installed here. This replays only what the PBS Pro man pages (qsub.1B, qstat.1B,
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
- ``qstat -Q -f -F json`` (or ``-Qf``): every queue of the site's server (``FAKE_PBS_SITE``: polaris, the
  default, or aurora), in PBS Pro's own JSON as read from openpbs/openpbs: ``src/cmds/qstat.c`` (status_que,
  prt_attr) and, for PBS Pro 2022 as ALCF runs it, ``src/lib/Libcmds/pbs_json.c`` before commit 74106a6a
  (4-space indent, ``"key":value``): a prologue (``timestamp``, ``pbs_version``, ``pbs_server``), then
  ``"Queue": {NAME: {...}}``, each ``resources_max.nodect``-style attribute nested as ``"resources_max":
  {"nodect": ...}``, and every value that reads as a JSON number printed as a number (``"nodect":2``,
  ``"walltime":"01:00:00"``, booleans as ``"True"``). The queues are the sites' as ALCF's guides describe them
  (the cluster YAMLs' facts), set as ``qmgr`` would: ``FAKE_PBS_QUEUES`` names a JSON file
  ``{QUEUE: {ATTRIBUTE: VALUE or null}}`` merged over them (a null drops the attribute, ``{QUEUE: null}`` the
  queue); ``FAKE_PBS_QSTAT_DELAY_S`` makes ``qstat -Q`` answer that late (a server that does not answer).
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

SERVERS = {"polaris": "fakepbs-01.hsn.cm.polaris.alcf.anl.gov", "aurora": "fakepbs-01.hostmgmt.cm.aurora.alcf.anl.gov"}
SERVER = SERVERS[os.environ.get("FAKE_PBS_SITE", "polaris")]
_ENABLED = {"enabled": "True", "started": "True"}


def _execution(low: int | None, high: int | None, walltime: str, **more: str) -> dict[str, str]:
    """An execution queue as ``qmgr -c "set queue Q ..."`` would leave it."""
    queue = {"queue_type": "Execution", "total_jobs": "0",
             "state_count": "Transit:0 Queued:0 Held:0 Waiting:0 Running:0 Exiting:0 Begun:0 "}
    queue.update({"resources_max.nodect": str(high)} if high else {})
    queue.update({"resources_max.walltime": walltime, **({"resources_min.nodect": str(low)} if low else {})})
    return {**queue, "resources_assigned.ncpus": "0", "resources_assigned.nodect": "0", **more, **_ENABLED}


def _route(low: int, high: int, walltime: str, destinations: str) -> dict[str, str]:
    return {"queue_type": "Route", "total_jobs": "0", "resources_max.nodect": str(high),
            "resources_max.walltime": walltime, "resources_min.nodect": str(low),
            "route_destinations": destinations, **_ENABLED}


ROUTED = {"from_route_only": "True"}
QUEUES = {
    "polaris": {
        "debug": _execution(1, 2, "01:00:00"), "debug-scaling": _execution(1, 10, "01:00:00"),
        "prod": _route(10, 496, "24:00:00", "small,medium,large,backfill-small,backfill-medium,backfill-large"),
        "small": _execution(10, 24, "03:00:00", **ROUTED), "medium": _execution(25, 99, "06:00:00", **ROUTED),
        "large": _execution(100, 496, "24:00:00", **ROUTED),
        "backfill-small": _execution(10, 24, "03:00:00", **ROUTED),
        "backfill-medium": _execution(25, 99, "06:00:00", **ROUTED),
        "backfill-large": _execution(100, 496, "24:00:00", **ROUTED),
        "preemptable": _execution(1, 10, "72:00:00"), "demand": _execution(1, 56, "01:00:00"),
        "capacity": _execution(1, 4, "168:00:00"),
    },
    "aurora": {
        "debug": _execution(1, 2, "01:00:00"), "debug-scaling": _execution(2, 256, "01:00:00"),
        "prod": _route(256, 10624, "24:00:00", "small,medium,large"),
        "small": _execution(256, 1024, "12:00:00", **ROUTED), "medium": _execution(1025, 1999, "18:00:00", **ROUTED),
        "large": _execution(2000, 10624, "24:00:00", **ROUTED),
        "capacity": _execution(1, 16, "168:00:00"), "visualization": _execution(1, 32, "08:00:00"),
    },
}


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


def queues() -> dict[str, dict[str, str]]:
    """The site's queues, with the test's ``FAKE_PBS_QUEUES`` changes."""
    site = {name: dict(attributes) for name, attributes in QUEUES[os.environ.get("FAKE_PBS_SITE", "polaris")].items()}
    changes = os.environ.get("FAKE_PBS_QUEUES")
    for name, attributes in (json.loads(Path(changes).read_text()) if changes else {}).items():
        if attributes is None:
            site.pop(name, None)
            continue
        queue = site.setdefault(name, {})
        for key, value in attributes.items():
            queue.pop(key, None) if value is None else queue.__setitem__(key, str(value))
    return site


def pbs_value(text: str) -> object:
    """A value as PBS prints it in JSON: a number where the text reads as a JSON number, else the string."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, int | float) and not isinstance(value, bool) else text


def queue_json(attributes: dict[str, str]) -> dict[str, object]:
    """``resources_max.nodect`` -> ``{"resources_max": {"nodect": ...}}``, as qstat's prt_attr nests them."""
    shown: dict[str, object] = {}
    for key, value in attributes.items():
        name, _, resource = key.partition(".")
        if resource:
            group = shown.setdefault(name, {})
            assert isinstance(group, dict)
            group[resource] = pbs_value(value)
        else:
            shown[name] = pbs_value(value)
    return shown


def qstat_queues() -> int:
    time.sleep(float(os.environ.get("FAKE_PBS_QSTAT_DELAY_S") or 0))
    document = {"timestamp": int(time.time()), "pbs_version": "2022.1.3", "pbs_server": SERVER,
                "Queue": {name: queue_json(attributes) for name, attributes in queues().items()}}
    print(json.dumps(document, indent=4, separators=(",", ":")))  # PBS Pro 2022's printer: "key":value
    return 0


def qstat(args: list[str]) -> int:
    if "-Q" in args or "-Qf" in args:
        if not {"-F", "json"} <= set(args):
            print("fake qstat: only 'qstat -Q -f -F json' is replayed for queues", file=sys.stderr)
            return 2
        return qstat_queues()
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
