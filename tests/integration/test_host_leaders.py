"""The rendezvous through host leaders (runtime/rendezvous/leader.py): a host's ranks join its local rank 0, which
joins rank 0 for them and relays failures, reports and goodbyes. Ranks given host names of their own
(``spawn_ranks(hosts=...)``) are separate hosts to the runtime; 3 hosts x 2 ranks: ranks 2 and 4 lead theirs."""

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.integration.test_runtime import worker

WORKER = worker("host_leaders.py")
HOSTS = [("a", 2), ("b", 2), ("c", 2)]


def _finish(procs: dict) -> dict[int, tuple[str, str]]:
    return {rank: proc.communicate(timeout=90) for rank, proc in procs.items()}


def test_ranks_join_through_their_hosts_leaders_and_reports_come_back_through_them(spawn_ranks):
    procs = spawn_ranks(WORKER, 6, args=("stacks",), hosts=HOSTS)
    outputs = _finish(procs)
    for rank, (stdout, stderr) in outputs.items():
        assert procs[rank].returncode == 0 and f"rank {rank}: ok" in stdout, stderr[-2000:]
    assert "reports from ranks [0, 1, 2, 3, 4, 5], absent []" in outputs[0][0]


@pytest.mark.parametrize("victim, named", [(5, "rank 5 (host c,"), (4, "rank 4 (host c,"), (0, "rank 0")],
                         ids=["a-leaders-rank-dies", "a-leader-dies", "rank-0-dies"])
def test_a_death_anywhere_reaches_every_rank_through_the_leaders(spawn_ranks, victim, named):
    procs = spawn_ranks(WORKER, 6, args=("die", str(victim)), hosts=HOSTS)
    assert_the_others_raised_naming(procs, _finish(procs), victim, named)


def assert_the_others_raised_naming(procs: dict, outputs: dict[int, tuple[str, str]], victim: int, named: str) -> None:
    """``victim`` was killed (the worker's ``die`` mode); every other rank raised within a bound, naming ``named``."""
    assert procs[victim].returncode == -9
    for rank, (stdout, stderr) in outputs.items():
        if rank == victim:
            continue
        assert procs[rank].returncode == 0, stderr[-2000:]
        seconds = float(re.search(r"raised after ([\d.]+) s", stdout).group(1))
        assert seconds < 30, stdout  # a bound against hanging, not a timing claim
        assert named in stdout, stdout


def test_a_rank_that_never_comes_is_named_exactly(spawn_ranks):
    procs = spawn_ranks(WORKER, 6, ranks=[0, 1, 2, 4, 5], args=("ok",), hosts=HOSTS,
                        env={"HVDRUN_START_TIMEOUT": "3"})
    outputs = _finish(procs)
    assert all(proc.returncode != 0 for proc in procs.values())
    assert "ranks 3 never joined rank 0" in outputs[0][1], outputs[0][1][-2000:]
    assert "ranks 3 never joined rank 0" in outputs[2][1], outputs[2][1][-2000:]  # its leader hears rank 0's error


def test_any_rank_of_a_host_may_lead_it(spawn_ranks):
    """Leadership does not depend on HVDRUN_LOCAL_RANK (mpiexec may place ranks otherwise than planned): here every
    rank claims local rank 0; the first of each host to bind its local socket leads, the others join it."""
    procs = spawn_ranks(WORKER, 6, args=("stacks",), hosts=HOSTS, env={"HVDRUN_LOCAL_RANK": "0"})
    outputs = _finish(procs)
    for rank, (stdout, stderr) in outputs.items():
        assert procs[rank].returncode == 0 and f"rank {rank}: ok" in stdout, stderr[-2000:]
    assert "reports from ranks [0, 1, 2, 3, 4, 5], absent []" in outputs[0][0]


def test_a_leader_that_dies_in_the_rendezvous_fails_its_hosts_ranks_at_once(spawn_ranks):
    procs = spawn_ranks(WORKER, 6, ranks=[0, 2, 3, 4, 5], args=("ok",), hosts=HOSTS,
                        env={"HVDRUN_START_TIMEOUT": "60"})  # rank 1 never comes: the table never does
    assert wait_until(lambda: any(_leads(procs[rank].pid) for rank in (2, 3)), 60), "no rank of host b leads it"
    time.sleep(0.5)  # the other one joined it meanwhile (or is about to: either way it must fail at once)
    leader = next(rank for rank in (2, 3) if _leads(procs[rank].pid))
    local = 5 - leader
    procs[leader].kill()
    _, stderr = procs[local].communicate(timeout=30)  # far below the start timeout
    assert procs[local].returncode != 0
    assert "this host's leader" in stderr, stderr[-2000:]
    assert "local rank 0" not in stderr  # the leader is whichever rank bound the socket first (local rank 1 here too)


def _leads(pid: int) -> bool:
    """Whether process ``pid`` listens on an abstract Unix socket of the rendezvous (it leads its host)."""
    inodes = {line.split()[-2] for line in Path("/proc/net/unix").read_text().splitlines()[1:]
              if line.split()[-1].startswith("@hvdrun-rdv-") and line.split()[5] == "01"}  # state 01: listening
    try:
        links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    except OSError:  # it ended, or an fd closed while we looked
        return False
    sockets = [link.removeprefix("socket:[").removesuffix("]") for link in links if link.startswith("socket:")]
    return any(inode in inodes for inode in sockets)


def test_a_hosts_leader_stops_its_host_at_once_when_one_of_its_ranks_fails_without_waiting_for_rank_0(spawn_ranks,
                                                                                                       tmp_path):
    """A rank of host b that is not its leader reports a failure while rank 0 is stopped (it relays nothing): b's
    leader tells b's ranks itself (rank 0 tells the others once it runs again)."""
    flag = tmp_path / "reporter"
    procs = spawn_ranks(WORKER, 6, args=("report", str(flag)), hosts=HOSTS)
    assert wait_until(lambda: any(_leads(procs[rank].pid) for rank in (2, 3)), 60), "no rank of host b leads it"
    time.sleep(2)  # every rank waits for the flag (6 processes share 2 cores in CI)
    leader = next(rank for rank in (2, 3) if _leads(procs[rank].pid))
    os.kill(procs[0].pid, signal.SIGSTOP)
    try:
        flag.write_text(str(5 - leader))
        stdout, stderr = procs[leader].communicate(timeout=30)  # far below any timeout of the job
    finally:
        os.kill(procs[0].pid, signal.SIGCONT)
    assert f"rank {leader} raised after" in stdout and f"rank {5 - leader} gives up" in stdout, (stdout, stderr[-2000:])
