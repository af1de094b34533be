"""Elastic recovery times: from a rank's death to training going on, and from a new host in discovery
to it training.

    python benchmarks/elastic.py              # 3 repeats of each scenario, on this machine
    python benchmarks/elastic.py --repeats 5

Runs ``tests/integration/workers/elastic_train.py`` under ``hvdrun`` (local launcher) and reads the
timestamps the workers print:

* death: 4 ranks, worker K SIGKILLs itself mid-step; seconds from its last line to the survivors'
  first completed step at size 3 (they roll back to the last commit first). K = 2, and K = 0 (the
  rank that serves the round's rendezvous).
* growth: 2 ranks from a discovery script; the script's file gains a slot; seconds from that write
  to the first completed step at size 3 (the new worker starts Python and torch, joins at the
  running workers' next commit, receives the state).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "tests" / "integration" / "workers" / "elastic_train.py"


def _hvdrun(args: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hvdrun", *args, str(TRAIN)], env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def death(victim: int) -> float:
    """Seconds from worker ``victim``'s death to the survivors' first step at size 3."""
    env = {**os.environ, "ELASTIC_STEPS": "30", "ELASTIC_KILL_WORKER": str(victim), "ELASTIC_KILL_STEP": "12",
           "ELASTIC_STEP_SLEEP": "0.02", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as cwd:
        stdout, stderr = _hvdrun(["-np", "4", "-H", "localhost:4", "--min-np", "2"], env, cwd).communicate(timeout=300)
    killed = float(re.search(r"killing myself at step \d+ t=([\d.]+)", stdout).group(1))  # type: ignore[union-attr]
    resumed = min(float(t) for t in re.findall(r"step \d+ size 3 t=([\d.]+)", stdout))
    return resumed - killed


def growth() -> float:
    """Seconds from a slot appearing in discovery to the first step at size 3."""
    with tempfile.TemporaryDirectory() as cwd:
        listing, script = Path(cwd, "hosts.txt"), Path(cwd, "discover.sh")
        listing.write_text("localhost:2\n")
        script.write_text(f"#!/bin/sh\ncat {listing}\n")
        script.chmod(0o755)
        env = {**os.environ, "ELASTIC_STEPS": "400", "ELASTIC_STEP_SLEEP": "0.02", "ELASTIC_MARK_DIR": cwd,
               "OMP_NUM_THREADS": "1"}
        job = _hvdrun(["--min-np", "2", "--host-discovery-script", str(script)], env, cwd)
        while not Path(cwd, "step10").exists():
            time.sleep(0.01)
        added = time.time()
        listing.write_text("localhost:3\n")
        stdout, _ = job.communicate(timeout=300)
    return min(float(t) for t in re.findall(r"step \d+ size 3 t=([\d.]+)", stdout)) - added


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    scenarios = {"rank 2 of 4 SIGKILLed -> training on 3": lambda: death(2),
                 "rank 0 of 4 SIGKILLed -> training on 3": lambda: death(0),
                 "slot added to discovery -> training on 3": growth}
    print(f"{os.cpu_count()} CPUs; local launcher; median of {args.repeats}\n")
    print("| scenario | median | all runs |\n|---|---|---|")
    for name, measure in scenarios.items():
        runs = [measure() for _ in range(args.repeats)]
        print(f"| {name} | {statistics.median(runs):.2f} s | {', '.join(f'{r:.2f}' for r in runs)} |", flush=True)


if __name__ == "__main__":
    main()
