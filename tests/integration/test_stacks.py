"""Where every rank is (issue #22): ``hvdrun stacks``, Ctrl-\\ to hvdrun, and the stall check's report.

Rank 2 of a 4-rank job sits in ``slow_data_loader`` (until the test releases it) while the others wait in
the allreduce 'grad.fc2'. Each report must fold ranks 0,1,3 into one entry, show rank 2 in its function,
and name the divergence from the flight recorders; the job goes on and ends normally afterwards.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from hvdrun.launch.registry import ask_secret
from tests.conftest import REPO, job_processes, wait_until

WORKER = REPO / "tests" / "integration" / "workers" / "late_rank.py"
SLEEP_LINE = next(n for n, line in enumerate(WORKER.read_text().splitlines(), 1) if "the line the reports name" in line)
DIVERGENCE = ("first divergence: rank 2 has not reached #4 allreduce 'grad.fc2' that ranks 0-1,3 wait in: rank 2 "
              "finished #3 'grad.step2'")


def assert_waits_cost_no_core(stdout: str) -> None:
    """Ranks 0,1,3 waited a second or more for rank 2 in 'grad.fc2' (the reports above took that long): a waiting rank
    sleeps between polls instead of spinning a core (a spinning one used about one CPU-second a second)."""
    waits = {int(rank): (float(wall), float(cpu)) for rank, wall, cpu in
             re.findall(r"rank (\d) waited ([\d.]+) s using ([\d.]+) s of CPU", stdout)}
    assert sorted(waits) == [0, 1, 2, 3], stdout
    for rank in (0, 1, 3):
        wall, cpu = waits[rank]
        assert wall > 1 and cpu < wall / 4, (rank, waits)


def launch_args(kind: str, request: pytest.FixtureRequest) -> list[str]:
    if kind == "local":
        return ["-np", "4"]
    if kind == "mpiexec":
        return ["-np", "4", "-H", "localhost:4", "--launcher", "mpiexec"]
    hosts = request.getfixturevalue("ssh_hosts")
    return ["-np", "4", "-H", hosts.hosts(2), *hosts.args()]


def assert_report(text: str) -> None:
    where = f"main thread at late_rank.py:{SLEEP_LINE} in slow_data_loader"
    assert DIVERGENCE in text and f"and waits in no collective ({where})" in text, text
    assert "ranks 0-1,3 (on " in text and "  waiting in: #4 allreduce 'grad.fc2' (4000 B" in text, text
    rank_2 = text.split("rank 2 (on ", 1)[1]
    assert "waiting in: no collective" in rank_2 and f"late_rank.py:{SLEEP_LINE} in slow_data_loader" in rank_2, text
    assert "last collectives: #1 'grad.step0', #2 'grad.step1', #3 'grad.step2'" in rank_2


def assert_top(kind: str, env: dict[str, str]) -> None:
    """``hvdrun top --once --json`` on the same job (issue #35): every rank's vitals, ranks 0,1,3 in 'grad.fc2'
    and rank 2 in none, the hosts folded."""
    shown = subprocess.run([sys.executable, "-m", "hvdrun", "top", "--once", "--json", "--interval", "0.3"], env=env,
                           capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    ranks = {row["rank"]: row for row in view["ranks"]}
    assert view["size"] == 4 and sorted(ranks) == [0, 1, 2, 3] and view["absent"] == {}, view
    assert all(ranks[r]["current"].startswith("allreduce 'grad.fc2' (") for r in (0, 1, 3)), ranks
    assert ranks[2]["current"] is None and all(row["collectives"] >= 3 and row["rss"] > 0 for row in ranks.values())
    # a rank blocked in a collective waits all along (its wait counted while in progress); rank 2 does not wait
    assert all(ranks[r]["wait_share"] > 0.9 for r in (0, 1, 3)) and ranks[2]["wait_share"] < 0.1, ranks
    assert len(view["hosts"]) == (2 if kind == "ssh" else 1), view["hosts"]
    assert sorted(r for host in view["hosts"] for r in host["ranks"]) == [0, 1, 2, 3]


@pytest.mark.parametrize("kind", ["local", "ssh", "mpiexec"])
def test_stacks_on_demand_ctrl_backslash_and_the_stall_report(kind, request, hvdrun_env, token, tmp_path):
    release, jobs = tmp_path / "release", tmp_path / "jobs"
    env = {**hvdrun_env, "HVDRUN_JOBS_DIR": str(jobs), "HOROVOD_STALL_CHECK_TIME_SECONDS": "1"}
    out, err = (tmp_path / "out.txt").open("wb"), (tmp_path / "err.txt").open("wb")
    job = subprocess.Popen([sys.executable, "-m", "hvdrun", *launch_args(kind, request), sys.executable,
                            str(WORKER), str(release)], env=env, cwd=tmp_path, stdout=out, stderr=err)
    try:
        stdout = lambda: (tmp_path / "out.txt").read_text()  # noqa: E731
        stderr = lambda: (tmp_path / "err.txt").read_text()  # noqa: E731
        assert wait_until(lambda: stdout().count("ready") == 4, 90), stderr()
        # the stall check (1 s) on rank 0 prints the report by itself
        assert wait_until(lambda: "where every rank is, as the stall check warns" in stderr(), 30), stderr()
        assert wait_until(lambda: DIVERGENCE in stderr(), 10), stderr()
        # the report's lines reach the launcher as they come (over SSH in chunks): wait for both groups' entries
        assert wait_until(lambda: stderr().split("as the stall check warns", 1)[1].count("last collectives:") >= 2,
                          10), stderr()
        assert_report(stderr().split("as the stall check warns", 1)[1].replace("[0]<stderr>:", ""))
        # the job's registration names where to ask for its secret, and holds no secret itself
        registered = json.loads(next((jobs / "running").glob("*.json")).read_text())
        assert sorted(registered) == ["addr", "command", "job_id", "pid", "port", "secret_socket", "size"]
        # hvdrun stacks from another shell
        asked = subprocess.run([sys.executable, "-m", "hvdrun", "stacks"], env=env, capture_output=True, text=True,
                               timeout=30)
        assert asked.returncode == 0, asked.stderr
        assert asked.stdout.startswith("hvdrun: stacks of 4 of 4 rank(s)\n")
        assert_report(asked.stdout)
        assert_top(kind, env)
        # Ctrl-\ to hvdrun: the same report on hvdrun's stderr, and the job goes on
        before = stderr().count("hvdrun: stacks of 4 of 4 rank(s)")
        job.send_signal(signal.SIGQUIT)
        assert wait_until(lambda: stderr().count("hvdrun: stacks of 4 of 4 rank(s)") > before, 20), stderr()
        release.touch()
        assert job.wait(60) == 0, stderr()
    finally:
        release.touch()
        if job.poll() is None:
            job.kill()
            job.wait(10)
        out.close()
        err.close()
    assert stdout().count("done 4.0") == 4 and stdout().count("starting") == 4
    assert_waits_cost_no_core(stdout())
    assert not list((jobs / "running").glob("*.json"))  # the job's registration went with it
    assert wait_until(lambda: not job_processes(token)), job_processes(token)


def test_stacks_without_a_running_job_is_one_line(tmp_path):
    env = {**os.environ, "HVDRUN_JOBS_DIR": str(tmp_path / "jobs")}
    done = subprocess.run([sys.executable, "-m", "hvdrun", "stacks"], env=env, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("hvdrun: error: no running hvdrun job of this user (looked in "
                           f"{tmp_path / 'jobs' / 'running'})\n")
    named = subprocess.run([sys.executable, "-m", "hvdrun", "stacks", "abc123"], env=env, capture_output=True,
                           text=True, timeout=30)
    assert named.returncode == 2 and named.stderr == "hvdrun: error: no running hvdrun job 'abc123'; running: none\n"


def test_a_registered_job_whose_hvdrun_ended_is_forgotten(tmp_path):
    jobs = tmp_path / "jobs" / "running"
    jobs.mkdir(parents=True)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (jobs / "dead.json").write_text(f'{{"job_id": "dead", "pid": {int(ended.stdout)}, "size": 2, "addr": "x", '
                                    '"port": 1, "secret_socket": "s", "command": "c"}')
    env = {**os.environ, "HVDRUN_JOBS_DIR": str(jobs.parent)}
    done = subprocess.run([sys.executable, "-m", "hvdrun", "stacks"], env=env, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2 and "no running hvdrun job of this user" in done.stderr
    assert not (jobs / "dead.json").exists()



SECRET_HOLDER = """
import os, sys, time
with open(sys.argv[1] + ".tmp", "w") as out:
    out.write(os.environ["HVDRUN_SECRET"])
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""
OTHER_USER_ASKS = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(10)
sock.connect("\\0" + sys.argv[1])
print(repr(sock.recv(4096)))
"""


def test_the_secret_is_served_to_this_user_alone_and_dies_with_a_killed_hvdrun(hvdrun_env, token, tmp_path):
    """The secret stays in hvdrun's memory: ``kill -9`` of hvdrun leaves none on disk (it used to stay in the job's
    registration until some ``hvdrun stacks`` pruned it)."""
    jobs, program, seen = tmp_path / "jobs", tmp_path / "holder.py", tmp_path / "seen-secret"
    program.write_text(SECRET_HOLDER)
    env = {**hvdrun_env, "HVDRUN_JOBS_DIR": str(jobs)}
    job = subprocess.Popen([sys.executable, "-m", "hvdrun", "-np", "2", "-H", "localhost:2", sys.executable,
                            str(program), str(seen)], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: seen.exists() and list((jobs / "running").glob("*.json")), 60)
        registered = json.loads(next((jobs / "running").glob("*.json")).read_text())
        assert ask_secret(registered) == seen.read_text()  # this user gets it
        other = subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", OTHER_USER_ASKS,
                                registered["secret_socket"]], capture_output=True, text=True, timeout=30)
        assert other.stdout == "b''\n", other  # another user is answered nothing
        job.kill()
        job.wait(10)
    finally:
        if job.poll() is None:
            job.kill()
    secret = seen.read_text()
    assert not [path for path in jobs.rglob("*") if path.is_file() and secret in path.read_text()]
    with pytest.raises(OSError):
        ask_secret(registered)
    assert wait_until(lambda: not job_processes(token)), job_processes(token)
    left = subprocess.run([sys.executable, "-m", "hvdrun", "stacks"], env=env, capture_output=True, text=True,
                          timeout=30)
    assert left.returncode == 2 and not list((jobs / "running").glob("*.json"))  # the dead job's entry is pruned


NEVER_JOINS = """
import os, sys
from hvdrun import runtime
if os.environ["HVDRUN_RANK"] == "1":
    while not os.path.exists(sys.argv[1]):
        import time; time.sleep(0.05)
runtime.init()
"""


def test_a_rendezvous_that_times_out_says_where_every_rank_is(run_hvdrun, tmp_path):
    """Rank 1 never calls init(): before the start timeout stops the job, rank 0 says who joined."""
    program = tmp_path / "never_joins.py"
    program.write_text(NEVER_JOINS)
    release = tmp_path / "never"  # never created: the job's end stops rank 1
    done = run_hvdrun("-np", "3", "--start-timeout", "3", "--preload", "none", sys.executable, str(program),
                      str(release), timeout=120)  # the rendezvous alone: a preload's import counts against the timeout
    assert done.returncode == 1, done.stderr
    report = done.stderr.split("[0]<stderr>:hvdrun: where every rank is, as the rendezvous times out\n", 1)[1]
    lines = [line.split("]<stderr>:", 1)[1] for line in report.splitlines()[:8] if "]<stderr>:" in line]
    assert lines[0] == "hvdrun: stacks of 1 of 3 rank(s)" and lines[1] == "rank 0 (on localhost):"
    assert "rank 1: no report: has not joined rank 0 (not in init() yet, or cannot reach rank 0)" in lines
    assert "rank 2: no report: joined rank 0; waits for the other ranks to join" in lines
    assert "rendezvous timed out: ranks 1 never joined rank 0" in done.stderr
    # the job's error blames the rank that never came, not the ones that gave up waiting for it
    headline = done.stderr.split("hvdrun: error: ", 1)[1].splitlines()
    assert headline[0].startswith("rank 1 on localhost never joined the job: still running without having called "
                                  "init() when rank "), headline
    assert headline[1].startswith("rank ") and "'s error: rendezvous timed out: ranks 1 never joined" in headline[1]


def test_an_idle_job_prints_where_every_rank_is_before_it_stops(run_hvdrun, tmp_path):
    """--idle-timeout: nothing printed for 6 s -> the report, then the job stops with exit 124; the job report
    (--report, issue #35) says it was stopped, why, and holds the same stacks report."""
    done = run_hvdrun("-np", "4", "--idle-timeout", "6", "--report", "idle.html", sys.executable, str(WORKER),
                      str(tmp_path / "never"), timeout=120)
    assert done.returncode == 124, done.stderr
    assert_report(done.stderr)
    assert done.stderr.strip().splitlines()[-1] == ("hvdrun: error: no rank printed for 6 s (--idle-timeout); "
                                                    "stopped all 4 workers")
    page = html.unescape((tmp_path / "idle.html").read_text())
    assert ": stopped</title>" in page and "stopped (exit code 124)" in page
    assert "no rank printed for 6 s (--idle-timeout); stopped all 4 workers" in page.split("<h2>Failure</h2>")[1]
    assert_report(page.split("<h2>Last stacks report</h2>")[1])


def test_an_unreadable_jobs_folder_is_one_line(hvdrun_env, tmp_path):
    """``hvdrun stacks`` and ``hvdrun top`` read the running jobs' records: a folder this user cannot read gave a
    PermissionError traceback. Root reads anything, so the command runs without the capabilities that allow it."""
    folder = tmp_path / "jobs"
    (folder / "running").mkdir(parents=True)
    folder.chmod(0)
    hvdrun_env["HVDRUN_JOBS_DIR"] = str(folder)
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        drop = []  # a user's own permissions apply
    else:
        drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
                "--inh-caps=-dac_override,-dac_read_search"]
    try:
        for command in ("stacks", "top"):
            done = subprocess.run([*drop, sys.executable, "-m", "hvdrun", command], env=hvdrun_env,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 2, done.stderr
            assert done.stderr.strip() == (f"hvdrun: error: cannot read hvdrun's running jobs in {folder}/running "
                                           "(Permission denied); give a folder of yours in HVDRUN_JOBS_DIR")
    finally:
        folder.chmod(0o700)
