"""``hvdrun --max-restarts``: whole-job restarts that route around the host that failed.

Hosts are real OpenSSH servers in network namespaces (each rank sees its host's own name), or names of this
machine (localhost, 127.0.0.x) where only the restart logic is under test.
"""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import job_processes, wait_until
from tests.integration.test_local_launch import script

pytestmark = pytest.mark.integration

# argv: MARK_FILE HOW (kill: rank 1 kills itself once, on the first attempt; bug: rank 1 always raises;
# hang: every rank prints ready and fails a second later)
FLAKY = """
import os, pathlib, signal, socket, sys, time
import torch
import hvdrun.torch as hvd
hvd.init()
mark, how = pathlib.Path(sys.argv[1]), sys.argv[2]
print(f"RANK {hvd.rank()} node={socket.gethostname()} host={os.environ['HVDRUN_HOSTNAME']} "
      f"restart={os.environ['HVDRUN_RESTART_COUNT']} "
      f"torch={os.environ['TORCHELASTIC_RESTART_COUNT']}/{os.environ['TORCHELASTIC_MAX_RESTARTS']}", flush=True)
if how == "kill" and hvd.rank() == 1 and not mark.exists():
    mark.write_text("failed once")
    os.kill(os.getpid(), signal.SIGKILL)
if how == "bug" and hvd.rank() == 1:
    raise ValueError("a deterministic bug")
if how == "hang":
    print("ready", flush=True)
    time.sleep(1)
    sys.exit(5)
assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [float(hvd.size())] * 3
hvd.shutdown()
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
            "127.0.0.2), so it is the program's, not a node's: ValueError: a deterministic bug") in done.stderr
    assert "hvdrun: error: rank 1 on host 127.0.0.2 exited with code 1" in done.stderr


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
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    try:
        deadline = time.monotonic() + 90
        while "hvdrun: restart 1 of 20" not in lines.get(timeout=max(deadline - time.monotonic(), 0.1)):
            pass
        assert wait_until(lambda: len(job_processes(token)) >= 3, 60)  # attempt 2 under way
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert wait_until(lambda: not job_processes(token), 10), job_processes(token)
    finally:
        proc.kill()


def test_hosts_that_fail_a_check_are_written_and_the_run_leaves_them_out(run_hvdrun, ssh_hosts, tmp_path):
    """``hvdrun check --write-excludes F`` then ``hvdrun --exclude-hosts-file F``: the round trip."""
    worker = script(tmp_path, "flaky.py", FLAKY)
    down, excludes = ssh_hosts.unused_addr(), tmp_path / "bad-hosts"
    hosts = f"{ssh_hosts.addrs[0]}:1,{down}:1,{ssh_hosts.addrs[1]}:1"
    checked = run_hvdrun("check", "-H", hosts, "--timeout", "6", "--write-excludes", str(excludes), *ssh_hosts.args(),
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
