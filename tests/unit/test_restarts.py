"""The decisions between two attempts of ``hvdrun --max-restarts``: what failed, and where to run next."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import pytest

from hvdrun.errors import HostSpecError, LaunchError, WorkerFailed
from hvdrun.hosts import Host, excluded_hosts, without_excluded
from hvdrun.launch.job import plan_for_attempt
from hvdrun.launch.plan import RunOptions, plan_job
from hvdrun.launch.restarts import Fault, _same_error_elsewhere, fault_of, hosts_for_attempt, run_with_restarts


def plan(hosts: str, np: int | None = None, spares: int = 0, environ: dict[str, str] | None = None):
    return plan_job(RunOptions(command=("true",), hosts=hosts or None, num_proc=np, spares=spares, max_restarts=2,
                               launcher="ssh"), environ or {})


def test_a_signal_or_an_unreachable_host_is_a_node_fault_and_an_exit_is_not():
    killed = fault_of(WorkerFailed("rank 1 on host h2 was killed by signal 9 (SIGKILL) 1.2 s after start (first "
                                   "failure); stopped the other 1 rank", 137, host="h2", signal=9))
    assert killed == Fault("h2", True, killed.cause, "rank 1 on host h2 was killed by signal 9 (SIGKILL)")
    exited = fault_of(WorkerFailed("rank 1 on host h2 exited with code 1 ...", 1, host="h2",
                                   cause="ValueError: boom"))
    assert not exited.node and exited.cause == "exit code 1\nValueError: boom"
    lost = fault_of(WorkerFailed("rank 1 on host h2 lost its SSH connection ...", 255, host="h2",
                                 note="lost its SSH connection (host h2 down, or sshd killed the session)"))
    assert lost.node and lost.host == "h2"
    mpiexec = fault_of(WorkerFailed("rank 0 on host h1 made mpiexec exit with code 255 ...", 255, host=None,
                                    note="made mpiexec exit with code 255 (see mpiexec's messages above)"))
    assert mpiexec.node and mpiexec.host is None  # a node fault with nothing to route around
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


def failed(host: str | None, code: int = 1, signal: int | None = None, cause: str = "",
           note: str = "") -> WorkerFailed:
    """A rank's failure as :class:`hvdrun.launch.supervision.WorkerGroup` raises it."""
    how = f"was killed by signal {signal}" if signal else note or f"exited with code {code}"
    return WorkerFailed(f"rank 1 on host {host} {how} 0.4 s after start (first failure); stopped the other 1 rank",
                        128 + signal if signal else code, host=host, signal=signal, cause=cause, note=note)


def run(job, failures: list[Exception | None], broken: Mapping[str, str] | None = None):
    """Run ``job`` with one restart fewer than ``failures``; attempt K raises ``failures[K]`` (None: succeeds) and
    the probe finds ``broken``. Returns (each attempt's hosts, the probe's calls, the lines, the error raised)."""
    ran: list[list[str]] = []
    probed: list[list[str]] = []
    lines: list[str] = []

    def attempt(attempt_plan, number: int) -> None:
        ran.append([slot.hostname for slot in attempt_plan.slots])
        if failures[number] is not None:
            raise failures[number]

    def probe(hosts: Sequence[Host]) -> dict[str, str]:
        probed.append([host.name for host in hosts])
        return {host.name: (broken or {})[host.name] for host in hosts if host.name in (broken or {})}

    try:
        run_with_restarts(job, len(failures) - 1, functools.partial(plan_for_attempt, job), attempt, lines.append,
                          probe)
    except (WorkerFailed, LaunchError) as error:
        return ran, probed, lines, error
    return ran, probed, lines, None


def test_a_spare_that_fails_the_probe_is_left_out_and_the_next_spare_taken():
    ran, probed, lines, error = run(plan("a:1,b:1,c:1,d:1", np=2), [failed("b", signal=9), None],
                                    broken={"c": "cannot connect to root@c (c:22): No route to host"})
    assert error is None and ran == [["a", "b"], ["a", "d"]]
    assert probed == [["a", "c"], ["d"]]  # each host probed once
    assert lines == ["hvdrun: before attempt 2: host c failed hvdrun's probe, a node fault: cannot connect to "
                     "root@c (c:22): No route to host",
                     "hvdrun: restart 1 of 1: attempt 1 ended with a node fault (rank 1 on host b was killed by "
                     "signal 9); attempt 2 runs on a, d, without b, c"]


def test_a_host_that_fails_the_probe_runs_again_when_no_spare_is_left():
    ran, probed, lines, error = run(plan("a:1,b:1,c:1", np=2), [failed("b", signal=9), None],
                                    broken={"c": "no answer"})
    assert error is None and ran == [["a", "b"], ["a", "b"]]  # c is down, b only failed once: b runs again
    assert probed == [["a", "c"], ["b"]]
    assert lines[-1].endswith("attempt 2 runs on the same hosts")


def test_every_restart_used_ends_with_the_last_attempts_failure():
    ran, _, lines, error = run(plan("a:1,b:1,c:1,d:1", np=2), [failed("b", 11), failed("c", 12), failed("d", 13)])
    assert isinstance(error, WorkerFailed) and error.exit_code == 13 and len(ran) == 3
    assert [line.split(":")[1] for line in lines] == [" restart 1 of 2", " restart 2 of 2", " not restarting"]
    assert lines[-1] == "hvdrun: not restarting: attempt 3 failed and all 2 restarts are used (--max-restarts 2)"


def test_a_silent_exit_on_two_hosts_is_the_programs_and_a_signal_never_is():
    ran, _, lines, error = run(plan("a:1,b:1,c:1,d:1", np=2), [failed("b", 3), failed("c", 3), None])
    assert isinstance(error, WorkerFailed) and error.exit_code == 3 and len(ran) == 2
    assert lines[-1] == ("hvdrun: not restarting: attempts 1 and 2 failed with the same error on different hosts "
                         "(b, c), so it is the program's, not a node's: exit code 3 and nothing on stderr")
    ran, _, lines, error = run(plan("a:1,b:1,c:1,d:1", np=2), [failed("b", signal=11)] * 3)
    assert isinstance(error, WorkerFailed) and error.exit_code == 139 and len(ran) == 3  # SIGSEGV: a node fault


def test_the_same_error_compares_equal_without_host_names_and_clock_times():
    first = fault_of(failed("10.0.0.2", cause="2026-11-24 12:00:01,250 ERROR cannot reach 10.0.0.2:29500"))
    again = fault_of(failed("10.0.0.3", cause="2026-11-24 12:07:41,003 ERROR cannot reach 10.0.0.3:29500"))
    assert first.cause == again.cause == "exit code 1\n<time> <time> ERROR cannot reach <host>:29500"
    assert fault_of(failed("h1", cause="x on h12")).cause == "exit code 1\nx on h12"  # a name, not a substring
    assert fault_of(failed("b", 3)).cause != fault_of(failed("c", 4)).cause


def test_a_launch_error_that_names_no_host_stops_with_a_line_and_mpiexecs_own_failure_runs_again():
    ran, _, lines, error = run(plan("a:1,b:1,c:1", np=2), [LaunchError("SSH config file 'x' does not exist"), None])
    assert isinstance(error, LaunchError) and len(ran) == 1
    assert lines == ["hvdrun: not restarting: the launch failed naming no host to leave out (a set-up error, the "
                     "same every time): SSH config file 'x' does not exist"]
    note = "made mpiexec exit with code 255 (see mpiexec's messages above)"
    ran, _, lines, error = run(plan("a:1,b:1,c:1", np=2), [failed(None, 255, note=note), None])
    assert error is None and ran == [["a", "b"], ["a", "b"]]
    assert "ended with a node fault" in lines[-1] and lines[-1].endswith("attempt 2 runs on the same hosts")


def test_a_program_error_repeated_on_the_only_host_says_why_it_is_retried():
    from hvdrun.launch.restarts import _same_error_here

    first = again = Fault("h1", False, "exit code 3", "rank 0 exited")
    assert _same_error_here([first]) == ""
    assert _same_error_here([first, again]).startswith(" (the same error as attempt 1, on the same host: with no "
                                                       "other host to run it on, hvdrun cannot tell the program's")
    assert _same_error_here([first, Fault("h1", False, "exit code 4", "")]) == ""
    assert _same_error_here([first, Fault("h1", True, "exit code 3", "")]) == ""  # a node fault


def test_a_stop_signal_as_an_attempt_fails_starts_no_next_attempt():
    import os
    import signal

    from hvdrun.errors import JobInterrupted

    job, ran = plan("a:1,b:1", np=2), []

    def attempt(attempt_plan, number):
        ran.append(number)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives as the attempt fails, before the next one is planned
        raise WorkerFailed("rank 1 on host b exited with code 1", 1, host="b")

    with pytest.raises(JobInterrupted, match="received SIGTERM between two attempts") as stopped:
        run_with_restarts(job, 2, functools.partial(plan_for_attempt, job), attempt, lambda line: None,
                          lambda hosts, deadline: {})
    assert ran == [0] and stopped.value.exit_code == 143
