"""``hvdrun --max-restarts``: whole-job restarts that route around the host that failed.

Hosts are real OpenSSH servers in network namespaces (each rank sees its host's own name), or names of this
machine (localhost, 127.0.0.x) where only the restart logic is under test.
"""

from __future__ import annotations

import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import job_processes, wait_until, where_it_hangs
from tests.integration.test_local_launch import script

pytestmark = pytest.mark.integration

# Through the numpy runtime (hvdrun.runtime), not hvdrun.torch: the launcher's restarts are the subject, and a rank
# then starts without torch's import (2-3 CPU-s each).
# argv: MARK_FILE HOW (kill: rank 1 kills itself once, on the first attempt; bug: rank 1 always raises;
# hang: every rank prints ready and fails a second later)
FLAKY = """
import os, pathlib, signal, socket, sys, time
import numpy as np
from hvdrun.runtime import context
from hvdrun.runtime.negotiation import Request
world = context.init().world
mark, how = pathlib.Path(sys.argv[1]), sys.argv[2]
print(f"RANK {world.rank} node={socket.gethostname()} host={os.environ['HVDRUN_HOSTNAME']} "
      f"restart={os.environ['HVDRUN_RESTART_COUNT']} "
      f"torch={os.environ['TORCHELASTIC_RESTART_COUNT']}/{os.environ['TORCHELASTIC_MAX_RESTARTS']}", flush=True)
engine = context.current().engine
engine.submit(Request("printed", "allreduce", "float64", (1,)), np.ones(1)).wait()  # every rank's line is out
if how == "kill" and world.rank == 1 and not mark.exists():
    mark.write_text("failed once")
    os.kill(os.getpid(), signal.SIGKILL)
if how == "bug" and world.rank == 1:
    raise ValueError("a deterministic bug")
if how == "hang":
    print("ready", flush=True)
    time.sleep(1)
    sys.exit(5)
total = engine.submit(Request("sum", "allreduce", "float64", (3,)), np.ones(3)).wait()
assert total.tolist() == [float(world.size)] * 3
context.shutdown()
"""


def ranks(stdout: str, where: str = "node") -> list[tuple[int, str, int]]:
    """(rank, its node's own name or the host name hvdrun gave it, restart count) of every rank's report."""
    found = re.findall(r"RANK (\d+) node=(\S+) host=(\S+) restart=(\d+)", stdout)
    return sorted((int(r), node if where == "node" else host, int(count)) for r, node, host, count in found)


def test_a_node_fault_restarts_once_without_the_failed_host(run_hvdrun, ssh_hosts, tmp_path):
    worker = script(tmp_path, "flaky.py", FLAKY)
    hosts = ",".join(f"{addr}:1" for addr in ssh_hosts.addrs[:3])
    done = run_hvdrun("-np", "2", "-H", hosts, *ssh_hosts.args(), "--max-restarts", "2", "--output-dir", "logs",
                      worker, str(tmp_path / "mark"), "kill", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (f"hvdrun: restart 1 of 2: attempt 1 ended with a node fault (rank 1 on host {ssh_hosts.addrs[1]} was "
            f"killed by signal 9 (SIGKILL)); attempt 2 runs on {ssh_hosts.addrs[0]}, {ssh_hosts.addrs[2]}, without "
            f"{ssh_hosts.addrs[1]}") in done.stderr
    assert ranks(done.stdout) == [(0, "h1", 0), (0, "h1", 1), (1, "h2", 0), (1, "h3", 1)]
    assert "torch=1/2" in done.stdout  # torchrun's names too
    assert "RANK 1 node=h3 " in (tmp_path / "logs" / "attempt.1" / "rank.1" / "stdout").read_text()
    assert "RANK 1 node=h2 " in (tmp_path / "logs" / "attempt.0" / "rank.1" / "stdout").read_text()


def test_without_a_spare_host_the_restart_uses_the_same_hosts(run_hvdrun, ssh_hosts, tmp_path):
    worker = script(tmp_path, "flaky.py", FLAKY)
    done = run_hvdrun("-H", ssh_hosts.hosts(1), *ssh_hosts.args(), "--max-restarts", "1", worker,
                      str(tmp_path / "mark"), "kill", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "attempt 2 runs on the same hosts" in done.stderr
    assert ranks(done.stdout) == [(0, "h1", 0), (0, "h1", 1), (1, "h2", 0), (1, "h2", 1)]


def test_a_deterministic_bug_stops_after_two_attempts_on_different_hosts(run_hvdrun, tmp_path):
    worker = script(tmp_path, "flaky.py", FLAKY)
    done = run_hvdrun("-np", "2", "-H", "localhost:1,127.0.0.1:1,127.0.0.2:1,127.0.0.3:1", "--max-restarts", "5",
                      worker, str(tmp_path / "mark"), "bug", timeout=120)
    assert done.returncode == 1
    assert done.stderr.count("hvdrun: restart ") == 1
    assert ("hvdrun: not restarting: attempts 1 and 2 failed with the same error on different hosts (127.0.0.1, "
            "127.0.0.2), so it is the program's, not a node's: exit code 1, ValueError: a deterministic bug"
            ) in done.stderr
    assert "hvdrun: error: rank 1 on host 127.0.0.2 exited with code 1" in done.stderr


# argv: DIR HOW; no torch, no rendezvous. Every rank reports its attempt and torchrun's run id; rank 0 then waits to
# be stopped; rank 1 waits for rank 0's report and fails: HOW=code: exits 11, 12, ... (another code each attempt);
# silent: os._exit(3) with nothing on stderr; segv: killed by SIGSEGV
FAILING = """
import os, pathlib, signal, sys, time
where, how = pathlib.Path(sys.argv[1]), sys.argv[2]
rank, attempt = int(os.environ["HVDRUN_RANK"]), int(os.environ["HVDRUN_RESTART_COUNT"])
print(f"RANK {rank} attempt={attempt} run_id={os.environ['TORCHELASTIC_RUN_ID']}", flush=True)
(where / f"{attempt}.{rank}").touch()
if rank == 0:
    time.sleep(600)
while not (where / f"{attempt}.0").exists():
    time.sleep(0.01)
if how == "code":
    sys.exit(11 + attempt)
if how == "silent":
    os._exit(3)
os.kill(os.getpid(), signal.SIGSEGV)
"""
FOUR_LOCAL_HOSTS = "localhost:1,127.0.0.1:1,127.0.0.2:1,127.0.0.3:1"


def test_every_restart_used_exits_with_the_last_attempts_code(run_hvdrun, tmp_path):
    worker = script(tmp_path, "failing.py", FAILING)
    done = run_hvdrun("-np", "2", "-H", FOUR_LOCAL_HOSTS, "--max-restarts", "2", worker, str(tmp_path), "code",
                      timeout=120)
    assert done.returncode == 13, done.stderr[-3000:]  # the third attempt's
    announced = [line for line in done.stderr.splitlines() if line.startswith("hvdrun: ") and "error:" not in line]
    assert announced == [
        "hvdrun: restart 1 of 2: attempt 1 ended with an error (rank 1 on host 127.0.0.1 exited with code 11); "
        "attempt 2 runs on localhost, 127.0.0.2, without 127.0.0.1",
        "hvdrun: restart 2 of 2: attempt 2 ended with an error (rank 1 on host 127.0.0.2 exited with code 12); "
        "attempt 3 runs on localhost, 127.0.0.3, without 127.0.0.2",
        "hvdrun: not restarting: attempt 3 failed and all 2 restarts are used (--max-restarts 2)"]
    assert "hvdrun: error: rank 1 on host 127.0.0.3 exited with code 13" in done.stderr
    reports = re.findall(r"RANK (\d) attempt=(\d) run_id=(\w+)", done.stdout)
    assert sorted((rank, attempt) for rank, attempt, _ in reports) == [(r, a) for r in "01" for a in "012"]
    assert len({run_id for _, _, run_id in reports}) == 1  # TORCHELASTIC_RUN_ID is the same on every attempt


def test_a_silent_exit_on_two_hosts_stops_early_and_a_signal_restarts(run_hvdrun, tmp_path):
    worker = script(tmp_path, "failing.py", FAILING)
    done = run_hvdrun("-np", "2", "-H", FOUR_LOCAL_HOSTS, "--max-restarts", "5", worker, str(tmp_path), "silent",
                      timeout=120)
    assert done.returncode == 3
    assert done.stderr.count("hvdrun: restart ") == 1
    assert ("hvdrun: not restarting: attempts 1 and 2 failed with the same error on different hosts (127.0.0.1, "
            "127.0.0.2), so it is the program's, not a node's: exit code 3 and nothing on stderr") in done.stderr
    for leftover in tmp_path.glob("[0-9].[0-9]"):
        leftover.unlink()
    done = run_hvdrun("-np", "2", "-H", FOUR_LOCAL_HOSTS, "--max-restarts", "2", worker, str(tmp_path), "segv",
                      timeout=120)
    assert done.returncode == 128 + signal.SIGSEGV  # a signal is a node fault: every restart is used
    assert done.stderr.count("ended with a node fault (rank 1 on host ") == 2
    assert "hvdrun: not restarting: attempt 3 failed and all 2 restarts are used" in done.stderr


def test_hosts_that_fail_the_probe_before_a_restart_are_left_out(run_hvdrun, ssh_hosts, tmp_path):
    """After h2's rank dies, the spares are probed: one unreachable, one without the Python the YAML names; the
    restart runs on the next spare."""
    worker = script(tmp_path, "flaky.py", FLAKY)
    h1, h2, h3, h4 = ssh_hosts.addrs
    down = ssh_hosts.unused_addr()
    config = tmp_path / "c.yaml"
    config.write_text(f"hosts:\n  - {h1}:1\n  - {h2}:1\n  - {down}:1\n"
                      f"  - {{name: {h3}, slots: 1, python: /opt/no/such/python}}\n  - {h4}:1\n")
    done = run_hvdrun("-np", "2", "--config", str(config), *ssh_hosts.args(), "--max-restarts", "1", worker,
                      str(tmp_path / "mark"), "kill", timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    announced = [line for line in done.stderr.splitlines() if line.startswith("hvdrun: ")]
    assert announced[0].startswith(f"hvdrun: before attempt 2: host {down} failed hvdrun's probe, a node fault: "
                                   f"cannot connect to root@{down} ({down}:22): ")
    assert announced[1] == (f"hvdrun: before attempt 2: host {h3} failed hvdrun's probe, a node fault: Python "
                            f"/opt/no/such/python not found on root@{h3} ({h3}:22); install it there or set "
                            "'python:' or 'venv:' for that host in the cluster YAML")
    assert announced[2] == (f"hvdrun: restart 1 of 1: attempt 1 ended with a node fault (rank 1 on host {h2} was "
                            f"killed by signal 9 (SIGKILL)); attempt 2 runs on {h1}, {h4}, without {h2}, {down}, {h3}")
    assert len(announced) == 3
    assert ranks(done.stdout) == [(0, "h1", 0), (0, "h1", 1), (1, "h2", 0), (1, "h4", 1)]


def test_ctrl_c_between_two_attempts_leaves_nothing(hvdrun_env, ssh_hosts, tmp_path, token):
    """The spare's "sshd" is this test's socket: once the probe before attempt 2 connects to it, hvdrun is between
    two attempts, and SIGINT there ends the job with 130."""
    worker = script(tmp_path, "flaky.py", FLAKY)
    spare = ssh_hosts.local_addr  # this machine: with --launcher ssh it is reached over SSH too, on port 22
    try:
        listener = socket.create_server((spare, 22))
    except OSError as e:
        pytest.skip(f"port 22 of {spare} is taken here: {e}")
    with listener:
        listener.settimeout(120)
        hosts = f"{ssh_hosts.addrs[0]}:1,{ssh_hosts.addrs[1]}:1,{spare}:1"
        proc = subprocess.Popen([sys.executable, "-m", "hvdrun", "-np", "2", "-H", hosts, "--launcher", "ssh",
                                 *ssh_hosts.args(), "--max-restarts", "3", worker, str(tmp_path / "mark"), "kill"],
                                env=hvdrun_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            probe, _ = listener.accept()  # attempt 1 ended (h2's rank was killed); the spare is being probed
            proc.send_signal(signal.SIGINT)
            probe.close()
            listener.close()
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 130, err.decode()[-3000:]
    assert "between two attempts; nothing is running" in err.decode()
    assert b"restart=1" not in out  # attempt 2 never started
    assert wait_until(lambda: not job_processes(token), 15), job_processes(token)


def test_spares_hold_hosts_back_and_excluded_hosts_are_never_used(run_hvdrun, tmp_path):
    worker = script(tmp_path, "flaky.py", FLAKY)
    (tmp_path / "bad").write_text("# written by hand\n127.0.0.2\n")
    done = run_hvdrun("-H", "localhost:1,127.0.0.1:1,127.0.0.2:1,127.0.0.3:1,127.0.0.4:1", "--exclude-hosts",
                      "127.0.0.1", "--exclude-hosts-file", "bad", "--spares", "1", "--max-restarts", "1", worker,
                      str(tmp_path / "mark"), "kill", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]  # 2 ranks (4 hosts left, one held back), then the spare
    assert "attempt 2 runs on localhost, 127.0.0.4, without 127.0.0.3" in done.stderr
    assert ranks(done.stdout, "host") == [(0, "localhost", 0), (0, "localhost", 1), (1, "127.0.0.3", 0),
                                          (1, "127.0.0.4", 1)]


def test_every_host_excluded_or_held_back_is_a_usage_error(run_hvdrun, tmp_path):
    done = run_hvdrun("-H", "localhost:1,127.0.0.1:1", "--exclude-hosts", "localhost,127.0.0.1", "true")
    assert done.returncode == 2 and "every host is excluded" in done.stderr
    done = run_hvdrun("-H", "localhost:1,127.0.0.1:1", "--spares", "2", "true")
    assert done.returncode == 2 and "--spares 2 holds back every one of the 2 host(s)" in done.stderr


def test_ctrl_c_during_restarts_leaves_nothing(hvdrun_env, tmp_path, token):
    worker = script(tmp_path, "flaky.py", FLAKY)
    proc = subprocess.Popen([sys.executable, "-m", "hvdrun", "-np", "2", "--max-restarts", "20", worker,
                             str(tmp_path / "mark"), "hang"], env=hvdrun_env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []
    threading.Thread(target=lambda: [(lines.put(line), seen.append(line)) for line in proc.stderr],
                     daemon=True).start()
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    try:
        deadline = time.monotonic() + 90
        while "hvdrun: restart 1 of 20" not in lines.get(timeout=max(deadline - time.monotonic(), 0.1)):
            pass
        assert wait_until(lambda: len(job_processes(token)) >= 3, 60)  # attempt 2 under way
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=30) == 130
        except subprocess.TimeoutExpired:
            pytest.fail(f"hvdrun did not end within 30 s of SIGINT\n{where_it_hangs(proc, ''.join(seen))}")
        assert wait_until(lambda: not job_processes(token), 10), job_processes(token)
    finally:
        proc.kill()


def test_hosts_that_fail_a_check_are_written_and_the_run_leaves_them_out(run_hvdrun, ssh_hosts, tmp_path):
    """``hvdrun check --write-excludes F`` then ``hvdrun --exclude-hosts-file F``: the round trip."""
    worker = script(tmp_path, "flaky.py", FLAKY)
    down, excludes = ssh_hosts.unused_addr(), tmp_path / "bad-hosts"
    hosts = f"{ssh_hosts.addrs[0]}:1,{down}:1,{ssh_hosts.addrs[1]}:1"
    checked = run_hvdrun("check", "-H", hosts, "--write-excludes", str(excludes), *ssh_hosts.args(),  # h1, h2 pass
                         timeout=120)
    assert checked.returncode == 1 and f"\n{down}\n" in excludes.read_text()
    done = run_hvdrun("-H", hosts, *ssh_hosts.args(), "--exclude-hosts-file", str(excludes), worker,
                      str(tmp_path / "mark"), "ok", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ranks(done.stdout) == [(0, "h1", 0), (1, "h2", 0)]


def test_restarts_under_the_mpiexec_launcher(run_hvdrun, tmp_path):
    worker = script(tmp_path, "flaky.py", FLAKY)
    done = run_hvdrun("-np", "2", "--launcher", "mpiexec", "--max-restarts", "1", worker, str(tmp_path / "mark"),
                      "kill", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hvdrun: restart 1 of 1: attempt 1 ended with a node fault (rank 1 on host localhost" in done.stderr
    assert [(rank, restart) for rank, _, restart in ranks(done.stdout)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
