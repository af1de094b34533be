"""``--warn-before`` on this machine, inside a Cobalt job's environment (Cobalt is retired and has no source: a job's
end is the ``COBALT_ENDTIME`` it carries, set here as the fake Cobalt would). The real servers' deadlines are in
test_pbs.py (qstat) and test_scheduler_jobs.py (squeue)."""

from __future__ import annotations

import re
import time

import pytest

NO_HANDLER = """\
import sys, time
import hvdrun.torch as hvd
hvd.init()
left = hvd.time_left()
print(f"rank {hvd.rank()} starts with {left:.0f} s left", flush=True)
time.sleep(float(sys.argv[1]))
print(f"rank {hvd.rank()} still here", flush=True)
"""

HANDLER_BEFORE_INIT = """\
import signal, time
import hvdrun.torch as hvd
heard = []
signal.signal(signal.SIGUSR1, lambda *_: heard.append(time.time()))
hvd.init()
time.sleep(1)
print(f"rank {hvd.rank()} heard the warning {len(heard)} time(s)", flush=True)
"""

STOP_LOOP = """\
import signal, sys, time
import torch
import hvdrun.torch as hvd
stop = False
signal.signal(signal.SIGUSR2, lambda *_: globals().update(stop=True))  # only a flag in the handler
hvd.init()
if hvd.rank() == 1 and not open(sys.argv[1]).read():  # the first attempt fails before the warning
    open(sys.argv[1], "w").write("failed once")
    sys.exit(5)
for step in range(1_000):
    time.sleep(0.05)
    if hvd.allreduce(torch.tensor(float(stop)), op=hvd.Max, name="stop").item():
        print(f"rank {hvd.rank()} stops at step {step} with {hvd.time_left():.0f} s left", flush=True)
        break
"""


@pytest.fixture
def cobalt_job(hvdrun_env):
    """The environment of a Cobalt job whose allocation ends in ``seconds``."""

    def ending_in(seconds: float) -> dict[str, str]:
        hvdrun_env.update(COBALT_JOBID="4242", COBALT_ENDTIME=f"{time.time() + seconds:.0f}")
        return hvdrun_env

    return ending_in


def test_a_script_without_a_handler_outlives_the_warning(run_hvdrun, cobalt_job, tmp_path):
    cobalt_job(22)
    (tmp_path / "plain.py").write_text(NO_HANDLER)
    done = run_hvdrun("-np", "2", "--warn-before", "20", "--verbose", "plain.py", "6")
    assert done.returncode == 0, done.stderr
    assert re.search(r"hvdrun: note: the allocation ends at .* from COBALT_ENDTIME of the job's environment",
                     done.stderr), done.stderr
    assert re.search(r"hvdrun: the allocation ends in 0:00:(1\d|20|21) \(--warn-before 20\): warning every rank "
                     r"with SIGUSR1", done.stderr), done.stderr  # 22 s less hvdrun's start (18 s seen under load)
    assert "passed SIGUSR1 to 2 running workers" in done.stderr
    assert sorted(re.findall(r"rank (\d) still here", done.stdout)) == ["0", "1"], done.stdout
    lefts = [int(n) for n in re.findall(r"starts with (\d+) s left", done.stdout)]
    assert len(lefts) == 2 and all(15 <= n <= 22 for n in lefts), lefts


def test_the_documented_stop_loop_gets_the_warning_in_the_attempt_after_a_restart(run_hvdrun, cobalt_job, tmp_path):
    """The first attempt fails before the warning is due; the warning reaches the restarted ranks."""
    cobalt_job(26)
    (tmp_path / "loop.py").write_text(STOP_LOOP)
    (tmp_path / "mark").write_text("")
    done = run_hvdrun("-np", "2", "--warn-before", "20", "--warn-signal", "USR2", "--max-restarts", "1",
                      "loop.py", str(tmp_path / "mark"), timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("warning every rank with SIGUSR2") == 1, done.stderr
    assert "hvdrun: restart 1 of 1" in done.stderr, done.stderr
    stops = re.findall(r"rank (\d) stops at step \d+ with (\d+) s left", done.stdout)
    assert sorted(rank for rank, _ in stops) == ["0", "1"], done.stdout


@pytest.mark.parametrize("preload", ["auto", "none"])  # ranks forked by the fork server, or new interpreters
def test_a_warning_due_before_the_ranks_start_reaches_them_as_they_start_and_ends_none(run_hvdrun, cobalt_job,
                                                                                      tmp_path, preload):
    cobalt_job(30)
    (tmp_path / "plain.py").write_text(NO_HANDLER)
    done = run_hvdrun("-np", "2", "--warn-before", "60", "--preload", preload, "plain.py", "2")
    assert done.returncode == 0, done.stderr
    assert "within --warn-before 60 s: the ranks are warned (SIGUSR1) as soon as they start, and again in " \
           "hvd.init() where their script has its handler by then" in done.stderr
    assert "passed SIGUSR1 to 2 running workers" in done.stderr, done.stderr
    assert sorted(re.findall(r"rank (\d) still here", done.stdout)) == ["0", "1"], done.stdout


def test_a_rank_that_was_still_starting_at_the_warning_hears_it_in_init(run_hvdrun, cobalt_job, tmp_path):
    """Sent as the ranks start, the warning finds them ignoring it; their handler, installed before
    ``hvd.init()`` as the documented loop does, hears it there."""
    cobalt_job(30)
    (tmp_path / "handler.py").write_text(HANDLER_BEFORE_INIT)
    done = run_hvdrun("-np", "2", "--warn-before", "60", "handler.py")
    assert done.returncode == 0, done.stderr
    heard = dict(re.findall(r"rank (\d) heard the warning (\d) time", done.stdout))
    assert set(heard) == {"0", "1"} and all(int(n) >= 1 for n in heard.values()), done.stdout
