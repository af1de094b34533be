"""The job's secret never appears on a command line (``ps`` shows command lines to every user of a node).

Each rank scans every process's ``/proc/PID/cmdline`` and ``ps`` output for the secret while the whole job
runs (the namespace hosts share this machine's process table), then proves with an allreduce that the ranks
still authenticate to each other. Open MPI and Cray PALS are not installed here (PALS runs as the FAKE in
tests/fakes); srun's and Open MPI's lines are checked in tests/unit/test_mpiexec_command.py, SSH's remote
command in tests/unit/test_ssh_command.py.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.test_local_launch import script
from tests.integration.test_mpiexec_launch import FAKE_PALS

pytestmark = pytest.mark.integration

SCAN = """
import json, os, subprocess
import numpy as np
from hvdrun.runtime import context
from hvdrun.runtime.negotiation import Request
runtime = context.init()
def total(name):
    return runtime.engine.submit(Request(name, "allreduce", "float64", (4,)), np.ones(4)).wait()
total("before")  # every rank, guard and launcher of the job is running now
secret = os.environ["HVDRUN_SECRET"].encode()
leaks = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            line = f.read()
    except OSError:
        continue
    if secret in line:
        leaks.append(line.replace(b"\\0", b" ").decode(errors="replace")[:300])
ps = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True).stdout
leaks += [row.decode(errors="replace")[:300] for row in ps.splitlines() if secret in row]
ok = total("scan").tolist() == [runtime.world.size] * 4
total("after")
print("SCAN " + json.dumps({"rank": runtime.world.rank, "leaks": leaks, "ok": ok}), flush=True)
context.shutdown()
"""


def scans(stdout: str) -> list[dict]:
    return sorted((json.loads(line.split("SCAN ", 1)[1]) for line in stdout.splitlines() if "SCAN " in line),
                  key=lambda r: r["rank"])


def assert_hidden(done, size: int) -> None:
    assert done.returncode == 0, done.stderr
    found = scans(done.stdout)
    assert [(r["rank"], r["ok"]) for r in found] == [(rank, True) for rank in range(size)], done.stdout
    assert [r["leaks"] for r in found] == [[]] * size


@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_the_secret_is_on_no_command_line_on_this_machine(run_hvdrun, tmp_path, launcher):
    done = run_hvdrun("--launcher", launcher, "-np", "2", script(tmp_path, "scan.py", SCAN), timeout=120)
    assert_hidden(done, 2)


@pytest.mark.parametrize("launcher", ["ssh", "mpiexec"])
def test_the_secret_is_on_no_command_line_across_ssh_hosts(run_hvdrun, ssh_hosts, tmp_path, launcher):
    done = run_hvdrun("--launcher", launcher, "-H", ssh_hosts.hosts(1), *ssh_hosts.args(),
                      script(tmp_path, "scan.py", SCAN), timeout=120)
    assert_hidden(done, 2)


def test_the_secret_is_on_no_command_line_of_a_fake_pals_mpiexec(run_hvdrun, hvdrun_env, tmp_path):
    hvdrun_env["HVDRUN_MPIEXEC"] = str(FAKE_PALS)
    done = run_hvdrun("--launcher", "mpiexec", "--mpi-flavour", "pals", "-np", "2", script(tmp_path, "scan.py", SCAN),
                      timeout=120)
    assert_hidden(done, 2)
