"""The decisions between two attempts of ``hvdrun --max-restarts``: what failed, and where to run next."""

from __future__ import annotations

import pytest

from hvdrun.errors import HostSpecError, LaunchError, WorkerFailed
from hvdrun.hosts import Host, excluded_hosts, without_excluded
from hvdrun.launch.job import RunOptions, plan_for_attempt, plan_job
from hvdrun.launch.restarts import Fault, _same_error_elsewhere, fault_of, hosts_for_attempt


def plan(hosts: str, np: int | None = None, spares: int = 0, environ: dict[str, str] | None = None):
    return plan_job(RunOptions(command=("true",), hosts=hosts or None, num_proc=np, spares=spares, max_restarts=2,
                               launcher="ssh"), environ or {})


def test_a_signal_or_an_unreachable_host_is_a_node_fault_and_an_exit_is_not():
    killed = fault_of(WorkerFailed("rank 1 on host h2 was killed by signal 9 (SIGKILL) 1.2 s after start (first "
                                   "failure); stopped the other 1 rank", 137, host="h2", signal=9))
    assert killed == Fault("h2", True, killed.cause, "rank 1 on host h2 was killed by signal 9 (SIGKILL)")
    exited = fault_of(WorkerFailed("rank 1 on host h2 exited with code 1 ...", 1, host="h2",
                                   cause="ValueError: boom"))
    assert not exited.node and exited.cause == "ValueError: boom"
    unreachable = fault_of(LaunchError("cannot connect to h3: timed out", host="h3"))
    assert unreachable.node and unreachable.host == "h3"
    assert fault_of(LaunchError("SSH config file 'x' does not exist")).host is None  # nothing to route around


def test_the_same_program_error_on_another_host_ends_the_retries():
    first = Fault("h2", False, "ValueError: boom", "")
    assert _same_error_elsewhere(Fault("h3", False, "ValueError: boom", ""), [first]) == 0
    assert _same_error_elsewhere(Fault("h2", False, "ValueError: boom", ""), [first]) is None  # same host
    assert _same_error_elsewhere(Fault("h3", False, "KeyError: 'x'", ""), [first]) is None
    assert _same_error_elsewhere(Fault("h3", True, "ValueError: boom", ""), [first]) is None  # a node fault


def test_the_next_attempt_leaves_out_failed_hosts_while_spares_last():
    job = plan("a:1,b:1,c:1,d:1", np=2)
    assert [h.name for h in job.hosts] == ["a", "b", "c", "d"] and len(job.slots) == 2
    assert [h.name for h in hosts_for_attempt(job, ["b"])] == ["a", "c", "d"]
    assert [h.name for h in hosts_for_attempt(job, ["b", "c"])] == ["a", "d"]
    assert [h.name for h in hosts_for_attempt(job, ["b", "c", "d"])] == ["a", "b"]  # too few: the latest two kept
    again = plan_for_attempt(job, hosts_for_attempt(job, ["b"]))
    assert [s.hostname for s in again.slots] == ["a", "c"] and [s.rank for s in again.slots] == [0, 1]


def test_without_spares_the_same_hosts_run_again():
    job = plan("a:2,b:2")
    assert [h.name for h in hosts_for_attempt(job, ["b"])] == ["a", "b"]


def test_spares_hold_the_last_hosts_back():
    job = plan("a:2,b:2,c:2", spares=1)
    assert len(job.slots) == 4 and {s.hostname for s in job.slots} == {"a", "b"}
    with pytest.raises(Exception, match="-np 5 needs more than the 4 slots left after --spares 1"):
        plan("a:2,b:2,c:2", np=5, spares=1)


def test_an_allocations_other_nodes_are_the_spares(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("n1\nn1\nn2\nn2\nn3\nn3\n")
    job = plan("", np=4, environ={"PBS_NODEFILE": str(nodefile)})
    assert [h.name for h in job.hosts] == ["n1", "n2", "n3"] and {s.hostname for s in job.slots} == {"n1", "n2"}
    assert [h.name for h in hosts_for_attempt(job, ["n2"])] == ["n1", "n3"]


def test_excluded_hosts_come_from_the_option_and_the_file(tmp_path):
    path = tmp_path / "excludes"
    path.write_text("# written by hvdrun check\nh3\n\nh4  # broken GPU\n")
    assert excluded_hosts("h1, h2", str(path)) == {"h1", "h2", "h3", "h4"}
    hosts = (Host("h1", 1), Host("h5", 1))
    assert without_excluded(hosts, frozenset({"h1"})) == (Host("h5", 1),)
    with pytest.raises(HostSpecError, match="every host is excluded"):
        without_excluded(hosts, frozenset({"h1", "h5"}))
    with pytest.raises(HostSpecError):
        excluded_hosts("h1;reboot", None)
