"""Host agents and their tree (``--launcher ssh`` past ``HVDRUN_SSH_FANOUT`` hosts) against real OpenSSH servers
in network namespaces: a job across 32 hosts, and on the session's 4 hosts with a fan-out of 2 (hvdrun reaches
h1 and h2, h1's agent reaches h3 and h4) the teardown guarantees, a crash and a broken host beneath another."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from hvdrun.envvars import SSH_FANOUT
from tests.conftest import (
    SshHosts,
    fixture_names,
    fixture_tag,
    host_processes,
    job_processes,
    shm_files,
    start_ssh_hosts,
    stop_ssh_hosts,
    wait_until,
)
from tests.integration.test_local_launch import script
from tests.integration.test_ssh_launch import SLEEPER

pytestmark = pytest.mark.integration

ALLREDUCE = """
import os
import numpy as np
from hvdrun.runtime import context
from hvdrun.runtime.negotiation import Request
runtime = context.init()
rank, size = runtime.world.rank, runtime.world.size
total = runtime.engine.submit(Request("sum", "allreduce", "int64", (1000,)), np.full(1000, rank + 1, np.int64)).wait()
exact = int(total[0]) if (total == total[0]).all() else -1
print(f"RESULT {rank} {size} {os.uname().nodename} {exact} {os.environ['HVDRUN_JOB_ID']}", flush=True)
context.shutdown()
"""
HOSTS_32 = 32


def nothing_left(token: str, hosts: SshHosts) -> bool:
    return not job_processes(token) and not host_processes(hosts.addrs)


def test_32_hosts_in_a_tree_run_an_allreduce_and_leave_nothing(run_hvdrun, hvdrun_env, tmp_path, token):
    """hvdrun reaches 4 hosts, their agents 16, theirs the last 12: 64 ranks, one exact allreduce."""
    names = fixture_names(fixture_tag(3))
    directory = Path(f"/tmp/hvdrun-32-{os.getpid()}")
    hosts = start_ssh_hosts(directory, HOSTS_32, names)
    try:
        worker = script(tmp_path, "allreduce.py", ALLREDUCE)
        # each host's fork server imports what the ranks import, once (auto preloads for scripts of torch only)
        done = run_hvdrun("--ssh-fanout", "4", "--preload", "numpy,hvdrun.runtime.context", "-H",
                          hosts.hosts(2, HOSTS_32), *hosts.args(), worker, timeout=240)
        assert done.returncode == 0, done.stderr
        rows = sorted((line.split("RESULT ", 1)[1].split() for line in done.stdout.splitlines() if "RESULT " in line),
                      key=lambda row: int(row[0]))
        size = 2 * HOSTS_32
        assert [int(row[0]) for row in rows] == list(range(size)) and {row[1] for row in rows} == {str(size)}
        assert all(int(row[3]) == size * (size + 1) // 2 for row in rows), rows
        assert [row[2] for row in rows] == [f"h{1 + rank // 2}" for rank in range(size)]
        job = rows[0][4]
        assert wait_until(lambda: nothing_left(token, hosts), 15), host_processes(hosts.addrs)
        assert not shm_files(job), shm_files(job)
    finally:
        stop_ssh_hosts(directory, names)


@pytest.fixture
def tree_env(hvdrun_env: dict[str, str]) -> dict[str, str]:
    """hvdrun's environment with a fan-out of 2: 4 hosts form a tree of depth 2."""
    hvdrun_env[SSH_FANOUT] = "2"
    return hvdrun_env


def start_sleepers(ssh_hosts: SshHosts, env: dict[str, str], tmp_path: Path, failing: str = "none",
                   ) -> subprocess.Popen[str]:
    """One sleeper rank on each of the 4 hosts; returns once every rank said it is ready."""
    sleeper = script(tmp_path, "sleeper.py", SLEEPER)
    proc = subprocess.Popen([sys.executable, "-m", "hvdrun", "-H", ssh_hosts.hosts(1, 4), *ssh_hosts.args(),
                             "--grace-period", "1", sleeper, failing], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    ready = 0
    while ready < 4:
        ready += "ready" in lines.get(timeout=60)
    return proc


def agent_of(ssh_hosts: SshHosts, addr: str) -> psutil.Process:
    """The agent of the host at ``addr`` (its fork server and guards carry the same command line, below it)."""
    ours = [proc for proc in host_processes([addr]) if "hvdrun.launch.remote.host_agent.main" in proc.cmdline()]
    agents = [proc for proc in ours if proc.ppid() not in {other.pid for other in ours}]
    assert len(agents) == 1, ours
    return agents[0]


def test_sigkill_of_hvdrun_leaves_nothing_on_any_host_of_the_tree(ssh_hosts, tree_env, tmp_path, token):
    proc = start_sleepers(ssh_hosts, tree_env, tmp_path)
    assert wait_until(lambda: len(job_processes(token)) >= 1 + 4 * 2)  # hvdrun + (rank, its child) x 4
    for addr in ssh_hosts.addrs:
        agent_of(ssh_hosts, addr)
    forked = [p for p in host_processes(ssh_hosts.addrs) if "hvdrun.launch.remote.host_agent.main" in p.cmdline()]
    assert len(forked) == 4 * 3  # (agent, fork server, guard) x 4
    assert not [p for p in forked if "HVDRUN_SECRET" in p.environ()]  # the secret came down the channel's stdin
    proc.kill()
    proc.wait(timeout=10)
    assert wait_until(lambda: nothing_left(token, ssh_hosts), 10), host_processes(ssh_hosts.addrs)


def test_a_crash_beneath_another_host_tears_down_every_host(run_hvdrun, ssh_hosts, tree_env, tmp_path, token):
    sleeper = script(tmp_path, "sleeper.py", SLEEPER)
    start = time.monotonic()
    done = run_hvdrun("-H", ssh_hosts.hosts(1, 4), *ssh_hosts.args(), "--grace-period", "2", sleeper, "3")
    assert done.returncode == 3
    assert f"rank 3 on host {ssh_hosts.addrs[3]} exited with code 3" in done.stderr  # h4, reached through h1
    assert "remote rank is about to fail" in done.stderr
    assert f"ranks 0-2 on {','.join(ssh_hosts.addrs[:3])}: stopped by hvdrun after the failure" in done.stderr
    assert time.monotonic() - start < 30
    assert wait_until(lambda: nothing_left(token, ssh_hosts), 10), host_processes(ssh_hosts.addrs)


def test_a_broken_host_beneath_another_is_named(run_hvdrun, ssh_hosts, tree_env, tmp_path):
    h1, h3, h4 = ssh_hosts.addrs[0], ssh_hosts.addrs[2], ssh_hosts.addrs[3]
    bare = "/usr/bin/python3"
    config = tmp_path / "c.yaml"
    config.write_text(f"hosts:\n  - {ssh_hosts.addrs[0]}:1\n  - {ssh_hosts.addrs[1]}:1\n"
                      f"  - {{name: {h3}, slots: 1, python: {bare}}}\n"
                      f"  - {{name: {h4}, slots: 1, python: /opt/no/such/python}}\n")
    done = run_hvdrun("--config", str(config), *ssh_hosts.args(), "hostname")
    assert done.returncode == 1 and done.stdout == ""
    assert f"hvdrun is not installed for {bare} on root@{h3} ({h3}:22)" in done.stderr  # the first, in host order
    assert done.stderr.rstrip().endswith(f"(reached through {h1})")
    config.write_text(config.read_text().replace(f"python: {bare}", f"python: {sys.executable}"))
    done = run_hvdrun("--config", str(config), *ssh_hosts.args(), "hostname")
    assert done.returncode == 1
    assert f"Python /opt/no/such/python not found on root@{h4} ({h4}:22)" in done.stderr
    down, start = ssh_hosts.unused_addr(), time.monotonic()
    done = run_hvdrun("-H", f"{ssh_hosts.hosts(1, 3)},{down}:1", *ssh_hosts.args(), "--start-timeout", "8",
                      "hostname")
    assert time.monotonic() - start < 30  # about --start-timeout, named by the agent that tried
    # a host that is down: the connection times out, or the bridge's ARP gives up first (No route to host)
    assert done.returncode == 1 and any(cause in done.stderr for cause in (
        f"{down} (root@{down}:22) did not answer within", f"cannot connect to root@{down} ({down}:22): No route"))
    assert done.stderr.rstrip().endswith(f"(reached through {h1})")


def test_a_host_whose_agent_dies_is_lost_with_the_hosts_beneath_it(ssh_hosts, tree_env, tmp_path, token):
    proc = start_sleepers(ssh_hosts, tree_env, tmp_path)
    agent_of(ssh_hosts, ssh_hosts.addrs[0]).send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == 255
    h1, h3, h4 = ssh_hosts.addrs[0], ssh_hosts.addrs[2], ssh_hosts.addrs[3]
    stderr = proc.stderr.read()
    assert (f"rank 0 on host {h1} lost its SSH connection (host {h1} down, or sshd killed the session); the ranks of "
            f"the 2 host(s) reached through it went with it: {h3}, {h4}") in stderr, stderr
    assert wait_until(lambda: nothing_left(token, ssh_hosts), 10), host_processes(ssh_hosts.addrs)
