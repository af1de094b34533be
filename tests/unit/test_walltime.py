"""The allocation's end, the warning clock, and the rule that decides a chain (the real schedulers behind them are in
test_pbs.py and test_scheduler_jobs.py)."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from hvdrun.envvars import DEADLINE, JOB_EVENTS, WARN_BEFORE, WARN_SIGNAL
from hvdrun.errors import JobInterrupted, UsageError
from hvdrun.jobs.chain import DONE, FAILED, GO_ON, UNDECIDED, Chain, Verdict, link_begins, outcome, submit_chain
from hvdrun.launch.warning import WalltimeWarning, WarningClock, plan_warning, warning_clock
from hvdrun.walltime import Deadline, JobEvents, NoDeadline, _pbs_time, find_deadline, time_left, warning_due


def test_outside_a_job_there_is_no_deadline_and_a_note_says_so_only_when_asked():
    with pytest.raises(NoDeadline, match=r"not inside a PBS, Slurm or Cobalt job"):
        find_deadline({})
    assert plan_warning(None, None, {}, verbose=False) == (None, ())
    warning, notes = plan_warning(30, None, {}, verbose=False)
    assert warning is None and notes == ("no deadline: not inside a PBS, Slurm or Cobalt job (no PBS_JOBID, "
                                         "SLURM_JOB_ID or COBALT_JOBID); the job runs without a warning before its "
                                         "end",)


def test_a_cobalt_job_carries_its_end_and_the_ranks_are_told():
    ends = int(time.time()) + 3570
    warning, notes = plan_warning(120, "USR2", {"COBALT_JOBID": "7", "COBALT_ENDTIME": str(ends)}, verbose=True)
    assert warning is not None and warning.deadline.source == "COBALT_ENDTIME of the job's environment"
    assert notes[0].startswith("the allocation ends at ") and "(in 0:59:" in notes[0]
    assert warning.env() == {DEADLINE: f"{ends:.3f}", WARN_BEFORE: "120", WARN_SIGNAL: str(signal.SIGUSR2)}
    with pytest.raises(NoDeadline, match="COBALT_ENDTIME 'soon' is not seconds since the epoch"):
        find_deadline({"COBALT_JOBID": "7", "COBALT_ENDTIME": "soon"})


def test_a_slurm_job_is_asked_about_before_its_torque_variables():
    """Slurm sets PBS_JOBID too (for Torque-style scripts): the end is Slurm's, asked with squeue."""
    with pytest.raises(NoDeadline, match=r"'squeue -h -j 12 -o %L'|squeue' is not on PATH"):
        find_deadline({"SLURM_JOB_ID": "12", "PBS_JOBID": "12", "PATH": "/nonexistent"})


def test_a_scheduler_that_does_not_answer_leaves_the_job_without_a_deadline(tmp_path):
    """A stand-in ``squeue`` that hangs, as a controller that does not answer leaves the real one."""
    (tmp_path / "squeue").write_text("#!/bin/sh\nexec /bin/sleep 30\n")
    (tmp_path / "squeue").chmod(0o755)
    started = time.monotonic()
    with pytest.raises(NoDeadline, match=r"^'squeue -h -j 12 -o %L' did not answer within 0.5 s$"):
        find_deadline({"SLURM_JOB_ID": "12", "PATH": str(tmp_path)}, timeout_s=0.5)
    assert time.monotonic() - started < 10


def test_a_warning_within_the_time_left_is_sent_as_the_ranks_start():
    _, notes = plan_warning(600, None, {"COBALT_JOBID": "7", "COBALT_ENDTIME": f"{time.time() + 60:.0f}"}, False)
    assert notes == (notes[0],) and "within --warn-before 600 s: the ranks are warned (SIGUSR1) as soon as" in notes[0]
    with pytest.raises(UsageError, match="--warn-signal KILL: SIGKILL cannot be caught by hvdrun"):
        plan_warning(600, "KILL", {}, False)


def test_pbs_start_times_read_as_the_server_prints_them():
    assert _pbs_time("Mon Dec  7 23:05:00 2026") == time.mktime((2026, 12, 7, 23, 5, 0, 0, 0, -1))
    assert _pbs_time(1765148700) == 1765148700.0 and _pbs_time("yesterday") is None


def test_the_ranks_time_left_and_whether_the_warning_is_due():
    environ = {DEADLINE: f"{time.time() + 100:.3f}", WARN_BEFORE: "30"}
    assert 99 < (time_left(environ) or 0) < 100.01 and not warning_due(environ)
    assert warning_due({**environ, WARN_BEFORE: "120"})
    assert time_left({}) is None and not warning_due({WARN_BEFORE: "30"})


def _clock(warn_in_s: float, events: JobEvents | None = None) -> tuple[WarningClock, list[str]]:
    said: list[str] = []
    deadline = Deadline(time.time() + 10 + warn_in_s, "test")
    return WarningClock(WalltimeWarning(deadline, 10, signal.SIGUSR1), said.append, events), said


def test_the_clock_warns_once_through_whatever_supervises_the_ranks_then(tmp_path):
    events = JobEvents(tmp_path / "events.json")
    clock, said = _clock(0.3, events)
    delivered: list[int] = []
    done = threading.Event()
    with clock.attached(lambda signum: (delivered.append(signum), done.set())):
        clock.start()
        assert done.wait(5)
    clock.stop()
    assert delivered == [signal.SIGUSR1]
    assert said == ["hvdrun: the allocation ends in 0:00:09 (--warn-before 10): warning every rank with SIGUSR1"] \
        or said == ["hvdrun: the allocation ends in 0:00:10 (--warn-before 10): warning every rank with SIGUSR1"]
    assert events.warned and events.read()["warn_signal"] == "SIGUSR1"


def test_a_warning_due_between_two_attempts_goes_to_the_next(tmp_path):
    clock, _ = _clock(-1)  # already due
    clock.start()
    assert _wait_for(lambda: clock._due)  # fired with nothing attached: held
    delivered: list[int] = []
    with clock.attached(delivered.append):
        pass
    with clock.attached(delivered.append):  # a third attempt gets nothing more: once
        pass
    assert delivered == [signal.SIGUSR1]


def test_a_stop_signal_that_ends_the_job_is_noted_for_the_chain(tmp_path):
    path = tmp_path / "events.json"
    with pytest.raises(JobInterrupted), warning_clock(None, print, {JOB_EVENTS: str(path)}):
        raise JobInterrupted("received SIGTERM; stopped all 2 workers", 143)
    assert JobEvents(path).stop_signal == "SIGTERM" and not JobEvents(path).warned


def _wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


# -- the chain's rule ------------------------------------------------------------------------------------------

def _chain(tmp_path, events: list[dict]) -> Chain:
    paths = []
    for number, noted in enumerate(events, start=1):
        path = tmp_path / f"job.{number}.events.json"
        if noted:
            path.write_text(json.dumps(noted))
        paths.append(str(path))
    return Chain(tmp_path / "job.chain.json", "slurm", len(events), (), tuple(paths))


@pytest.mark.parametrize(("noted", "code", "stopped_by", "decision"), [
    ({"warned_at": 1.0}, 0, None, GO_ON),  # checkpointed and exited 0 after the warning
    ({"warned_at": 1.0}, 143, None, GO_ON),  # killed at the limit after the warning
    ({"stopped_by": "SIGTERM"}, 143, None, GO_ON),  # preempted: hvdrun noted the signal
    ({}, 143, "SIGTERM", GO_ON),  # the script's trap saw it (hvdrun was past its supervision)
    ({}, 0, None, DONE),  # finished before any warning: training done
    ({}, 3, None, FAILED),  # a real error
    ({}, None, None, UNDECIDED),  # no exit code, no warning: killed, or its node lost
])
def test_the_rule_of_a_chain(tmp_path, noted, code, stopped_by, decision):
    assert outcome(_chain(tmp_path, [noted]), 1, code, stopped_by)[0] == decision


def test_the_first_verdict_on_a_chain_stands(tmp_path):
    chain = _chain(tmp_path, [{}, {}])
    first = chain.end(Verdict(1, "training done", 0, "exit code 0 before any warning"))
    later = chain.end(Verdict(0, "cancelled", 143, "hvdrun qdel"))
    assert first == later == chain.verdict() and first.describe() == (
        "ended at job 1: training done (exit code 0 before any warning)")
    assert not list(tmp_path.glob(".*.tmp"))


def test_signals_that_would_break_the_ranks_are_no_warning():
    for name in ("CHLD", "SEGV", "PIPE"):
        with pytest.raises(UsageError, match=f"--warn-signal {name}: SIG{name} would break the ranks"):
            plan_warning(60, name, {}, False)


def _two_jobs(tmp_path, first_code: str | None) -> Chain:
    from hvdrun.jobs.follow import SubmittedJob

    jobs = []
    for number in (1, 2):
        exit_file = tmp_path / f"job.{number}.exitcode"
        if number == 1 and first_code is not None:
            exit_file.write_text(first_code)
        jobs.append(SubmittedJob(str(number), "slurm", "s", "o", None, str(exit_file), 0.0))
    return Chain(tmp_path / "job.chain.json", "slurm", 2, tuple(jobs),
                 tuple(str(tmp_path / f"job.{n}.events.json") for n in (1, 2)))


def test_a_job_that_finds_the_training_done_as_it_starts_runs_nothing(tmp_path):
    """Job 1 ended with exit code 0 before any warning and was killed before its own last line judged it: job 2
    judges it, ends the chain and does not run (nor cancel itself: nothing after it is left here)."""
    said: list[str] = []
    assert not link_begins(_two_jobs(tmp_path, "0"), 2, said.append)
    assert said == ["hvdrun: chain chain-1 ended at job 1: training done (exit code 0 before any warning)",
                    "hvdrun: chain chain-1 ended at job 1: training done (exit code 0 before any warning): job 2 "
                    "does not run"]


def test_a_job_that_starts_again_forgets_its_earlier_events(tmp_path):
    chain = _two_jobs(tmp_path, None)
    JobEvents(chain.events[0]).note_warned("SIGUSR1")
    JobEvents(chain.events[1]).note_stopped("SIGTERM")  # from its run before a requeue
    assert link_begins(chain, 2, print)
    assert JobEvents(chain.events[1]).read() == {} and JobEvents(chain.events[0]).warned


def test_a_chain_refuses_the_output_of_an_earlier_chain(tmp_path, monkeypatch):
    from hvdrun.jobs.spec import JobRequest, build_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    spec = build_spec(JobRequest(command=("train.py",), scheduler="slurm", walltime="10", chain=2,
                                 output=str(tmp_path / "run.output")))
    (tmp_path / "run.chain.json").write_text("{}")
    with pytest.raises(UsageError, match=r"-o/--output: \S+/run.chain.json is an earlier chain's"):
        submit_chain(spec, 2, lambda _spec: "", print)
