"""A rank's remote command over SSH: the job's secret reaches the guard through the channel, not the command."""

from __future__ import annotations

import subprocess
import sys

from hvdrun.hosts import Host
from hvdrun.launch.hostprobe import module_command
from hvdrun.launch.launcher import WorkerSpec
from hvdrun.launch.ssh import stdin_preamble, worker_command
from hvdrun.ranks import Slot

SECRET = "5ec7e7" * 8


def spec() -> WorkerSpec:
    slot = Slot(rank=1, local_rank=0, cross_rank=1, size=2, local_size=1, cross_size=2, host=Host("h2", 1),
                host_index=1)
    env = {"HVDRUN_SECRET": SECRET, "HVDRUN_JOB_ID": "j1", "HVDRUN_RANK": "1", "PATH": "/usr/bin:/bin"}
    return WorkerSpec(slot, ("/venv/bin/python", "-u", "train.py"), env, "/work", sys.executable)


def test_the_remote_command_holds_no_secret_and_the_channel_sends_it_first():
    command = worker_command(spec(), 5.0)
    assert SECRET not in command and "HVDRUN_JOB_ID=j1" in command
    assert "--env-from-stdin HVDRUN_SECRET --" in command
    assert stdin_preamble(spec()) == f"{SECRET}\n".encode()


def test_the_guard_reads_the_secret_from_its_lifeline_and_leaves_the_rest_to_it():
    probe = "import os, time; print(os.environ['HVDRUN_SECRET'], flush=True); time.sleep(60)"
    guard = subprocess.Popen([sys.executable, "-m", "hvdrun.launch.remote.guard", "1", "--env-from-stdin",
                              "HVDRUN_SECRET", "--", sys.executable, "-c", probe],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert guard.stdin is not None and guard.stdout is not None
    guard.stdin.write(f"{SECRET}\n")
    guard.stdin.flush()
    assert guard.stdout.readline() == f"{SECRET}\n"
    guard.stdin.close()  # the lifeline ends: the guard stops the worker
    assert guard.wait(timeout=30) != 0


def test_a_hosts_module_command_exports_its_variables_quoted_on_top_of_the_login(tmp_path):
    (tmp_path / "show_env.py").write_text("import os; print(os.environ['LC_HVDRUN'], os.environ.get('HOME'))\n")
    value = "it's $(touch pwned); `touch pwned`"
    command = module_command(str(tmp_path), sys.executable, "show_env", [], {"LC_HVDRUN": value, "BAD-NAME": "x"})
    assert "BAD-NAME" not in command
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30,
                          env={"HOME": "/login-home", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{value} /login-home\n" and not (tmp_path / "pwned").exists()
