"""hvdrun qsub / qstat / qdel against a real OpenPBS server (tests/pbs_server.py): a server and two MOM hosts named
``aurora-...`` with Aurora's queues (cluster_configs/aurora.yaml) and ALCF's custom resources (``system``,
``filesystems``). Jobs run hvdrun inside the allocation, which reads the real ``$PBS_NODEFILE`` and starts the ranks
over SSH. Only Cray PALS ``mpiexec`` is still a fake (test_scheduler_jobs.py): no server here runs it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sysconfig
import time
from pathlib import Path

import psutil
import pytest
import yaml

from hvdrun.envvars import FORK_SERVER_FROM
from hvdrun.jobs import queue_limits
from hvdrun.jobs.spec import JobRequest, build_spec
from tests import pbs_server as pbs
from tests.conftest import REPO, host_processes, wait_until
from tests.integration.test_queue_limits_servers import usage_error
from tests.integration.test_scheduler_jobs import (
    WORKERS,
    hvdrun,
    job_output,
    site_python_without_hvdrun,
    submitted_id,
    wait_for_state,
)

ALLREDUCE = WORKERS / "allreduce_hosts.py"


@pytest.fixture
def server(pbs_server):
    return pbs_server[0]


@pytest.fixture
def pbs_job(pbs_server, hvdrun_env, tmp_path):
    """(environment, working directory, ``hvdrun qsub`` options) for a job on the test server: its cluster YAML,
    and the SSH key and known hosts the job's hvdrun reaches the other MOM host with."""
    server, hosts = pbs_server
    shutil.copy(ALLREDUCE, tmp_path)
    hvdrun_env.update(PBS_CONF_FILE=server.env["PBS_CONF_FILE"], PATH=server.env["PATH"],
                      HVDRUN_JOBS_DIR=str(tmp_path / "registry"))
    hvdrun_env.pop("SLURM_CONF", None)
    hvdrun_env.pop(FORK_SERVER_FROM)  # a job's fork server stays inside the scheduler's hold on the job
    config = pbs.job_config(tmp_path / "aurora-fixture.yaml")
    options = ("--config", str(config), "--run-args", " ".join(hosts.args()))
    yield hvdrun_env, tmp_path, options
    for record in (tmp_path / "registry").glob("*.json"):  # a failed test's jobs must not hold the nodes
        job_id = json.loads(record.read_text()).get("job_id")  # (a chain's record names its file instead)
        if job_id:
            subprocess.run(["qdel", job_id], env=server.env, capture_output=True, timeout=30)
    assert wait_until(lambda: not leftovers(tmp_path, hosts.addrs), 30), leftovers(tmp_path, hosts.addrs)


def leftovers(workdir: Path, addrs: list[str]) -> list[psutil.Process]:
    """Processes of this test's jobs still alive on a MOM host: the job scripts and launchers PBS started (their
    working directory is the job's) and whatever hvdrun started over SSH. Not OpenPBS's qsub daemon, which the
    first ``qsub`` leaves in the background to speed up the next (the fixture stops it with the server)."""
    found = host_processes(addrs)
    for proc in psutil.process_iter(["cwd", "status", "name"]):
        cwd = proc.info["cwd"]
        if proc.pid != os.getpid() and proc.info["status"] != psutil.STATUS_ZOMBIE and proc.info["name"] != "qsub" \
                and cwd and Path(cwd).is_relative_to(workdir):
            found.append(proc)
    return found


def script_of(cwd: Path) -> str:
    return next((cwd / "hvdrun-jobs").glob("*.pbs.sh")).read_text()


def sleepers(argument: str) -> list[psutil.Process]:
    """Live ``sleep ARGUMENT`` processes: the job's ranks, on every MOM host (they share this machine's kernel)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        if proc.info["name"] == "sleep" and proc.info["cmdline"] == ["sleep", argument] and \
                proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def hosts_of(processes: list[psutil.Process]) -> set[str]:
    """The UTS namespaces (the netns hosts) ``processes`` run in."""
    return {os.readlink(f"/proc/{proc.pid}/ns/uts") for proc in processes}


def test_a_two_node_job_runs_an_allreduce_across_both_mom_hosts(pbs_server, pbs_job):
    """``-- python allreduce_hosts.py`` as a user writes it, with the site's setup putting an interpreter without
    hvdrun (and without torch) first on the job's PATH: every rank still runs with the Python that runs hvdrun."""
    server, _ = pbs_server
    env, cwd, options = pbs_job
    site = site_python_without_hvdrun(cwd)
    result = hvdrun(env, cwd, "qsub", *options, "-n", "2", "--ranks-per-node", "2", "-t", "10",
                    "--setup", f"export PATH={site}:$PATH", "--setup", 'echo "python on PATH: $(command -v python)"',
                    "--report", "job.html", "--wait", "--", "python", "allreduce_hosts.py")
    output = job_output(cwd)
    assert result.returncode == 0, result.stderr + output
    assert f"python on PATH: {site}/python" in output  # the site's interpreter was first
    job_id = submitted_id(result)
    assert re.fullmatch(rf"\d+\.{re.escape(server.nodes[0])}", job_id)
    assert re.search(rf"job {job_id} RUNNING \[R\] on {re.escape(server.nodes[0])}", result.stderr), result.stderr
    # OpenPBS keeps no job history by default: the exit code comes from the file the job script wrote
    assert f"job {job_id} FINISHED, exit code 0" in result.stderr, result.stderr
    oks = re.findall(r"\[(\d)\]<stdout>:rank \d/4 local \d on (\S+) sum=10 ok", output)
    assert sorted(rank for rank, _ in oks) == ["0", "1", "2", "3"], output
    assert {host for _, host in oks} == set(server.nodes), output  # both MOM hosts took part
    script = script_of(cwd)
    assert "#PBS -l select=2:system=fixture" in script and "#PBS -l filesystems=flare" in script
    assert "#PBS -q debug" in script and "#PBS -N allreduce_hosts" in script
    # the job's hvdrun wrote its report (qsub --report, issue #35): every rank on its MOM host, each host reached
    report = (Path(cwd) / "job.html").read_text()
    assert ": succeeded</title>" in report and f" --report {Path(cwd) / 'job.html'} " in script
    hosts = [node for node in server.nodes for _ in range(2)]  # 2 ranks a node, in the node file's order
    assert all(f"<td>{rank}</td><td>{host}</td><td>{rank % 2}</td>" in report for rank, host in enumerate(hosts))


def test_a_failing_job_exits_with_its_code_with_job_history_on_and_off(server, pbs_job):
    env, cwd, options = pbs_job
    args = ("qsub", *options, "-n", "2", "--ranks-per-node", "1", "-t", "10", "--wait", "allreduce_hosts.py", "3", "1")
    without = hvdrun(env, cwd, *args)
    assert without.returncode == 3, without.stderr + job_output(cwd)
    assert re.search(r"job \S+ FINISHED, exit code 3\n", without.stderr), without.stderr
    with server.changed("set server job_history_enable = true", "unset server job_history_enable"):
        kept = hvdrun(env, cwd, *args)
        assert kept.returncode == 3, kept.stderr + job_output(cwd)
        job_id = submitted_id(kept)
        assert f"job {job_id} FINISHED [F], exit code 3" in kept.stderr, kept.stderr  # PBS's own Exit_status
        later = hvdrun(env, cwd, "qstat", job_id)
        assert later.returncode == 0 and "FINISHED [F], exit code 3" in later.stdout, later.stdout + later.stderr
    assert "rank 1 on host" in job_output(cwd) and "exited with code 3" in job_output(cwd)


def test_qdel_of_a_running_job_leaves_no_rank_on_any_host(pbs_server, pbs_job):
    _, hosts = pbs_server
    env, cwd, options = pbs_job
    marker = f"{time.time_ns() % 10**9}.5"  # sleep's argument: a word no other process has
    job_id = submitted_id(hvdrun(env, cwd, "qsub", *options, "-n", "2", "--ranks-per-node", "1", "-t", "10",
                                 "--submit", "--", "sleep", marker))
    running = wait_for_state(env, cwd, job_id, "RUNNING")
    assert re.search(rf"job {job_id} \(pbs\): RUNNING \[R\] on \S+,\S+", running), running
    assert wait_until(lambda: len(hosts_of(sleepers(marker))) == 2, 30), "no rank on each MOM host"
    cancelled = hvdrun(env, cwd, "qdel", job_id)
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, cancelled.stdout + cancelled.stderr
    assert wait_until(lambda: not sleepers(marker), 30), sleepers(marker)
    assert wait_until(lambda: not leftovers(cwd, hosts.addrs), 30), leftovers(cwd, hosts.addrs)
    # no job history (OpenPBS's default) and no exit code written: the job is gone
    gone = "UNKNOWN (qstat: unknown job id; the server keeps no job history, so it forgets a job that ended)"
    assert wait_until(lambda: gone in hvdrun(env, cwd, "qstat", job_id).stdout, 30)


def test_a_job_after_another_waits_held_and_runs_when_it_succeeded(server, pbs_job):
    env, cwd, options = pbs_job
    (cwd / "first.py").write_text("import time\ntime.sleep(6)\nprint('first done', time.time(), flush=True)\n")
    (cwd / "second.py").write_text("import time\nprint('second start', time.time(), flush=True)\n")
    common = (*options, "-n", "1", "--ranks-per-node", "1", "-t", "10")
    first = submitted_id(hvdrun(env, cwd, "qsub", *common, "-o", "first/", "--submit", "first.py"))
    second = hvdrun(env, cwd, "qsub", *common, "-o", "second/", "--after", first, "--wait", "second.py")
    assert second.returncode == 0, second.stderr
    assert re.search(r"job \S+ HELD \[H\]", second.stderr), second.stderr  # PBS holds it until the first ends
    done = float(re.search(r"first done (\S+)", (cwd / "first").joinpath(
        next(p.name for p in (cwd / "first").glob("*.output"))).read_text()).group(1))
    started = float(re.search(r"second start (\S+)", "".join(
        p.read_text() for p in (cwd / "second").glob("*.output"))).group(1))
    assert started > done


def test_max_restarts_inside_a_pbs_job_restarts_after_a_node_fault(pbs_job):
    from tests.integration.test_restarts import FLAKY, ranks

    env, cwd, options = pbs_job
    (cwd / "flaky.py").write_text(FLAKY)
    result = hvdrun(env, cwd, "qsub", *options, "-n", "2", "--ranks-per-node", "1", "-t", "10", "--max-restarts", "1",
                    "--wait", "flaky.py", str(cwd / "mark"), "kill")
    output = job_output(cwd)
    assert result.returncode == 0, result.stderr + output
    assert "hvdrun: restart 1 of 1: attempt 1 ended with a node fault (rank 1 on host " in output, output
    assert [(rank, restart) for rank, _, restart in ranks(output)] == [(0, 0), (0, 1), (1, 0), (1, 1)], output


def test_a_job_the_server_refuses_is_reported_in_one_line(pbs_job):
    """Aurora's least walltime (5 minutes) is a limit only the server checks."""
    env, cwd, options = pbs_job
    result = hvdrun(env, cwd, "qsub", *options, "-n", "1", "-t", "2", "--submit", "allreduce_hosts.py")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert re.fullmatch(r"hvdrun: error: 'qsub -o \S+ -j oe \S+\.pbs\.sh' failed with exit code \d+: "
                        r"qsub: Job violates queue and/or server resource limits\n", result.stderr), result.stderr


def test_a_job_larger_than_the_cluster_waits_with_the_schedulers_reason_and_qdel_cancels_it(pbs_job):
    env, cwd, options = pbs_job
    job_id = submitted_id(hvdrun(env, cwd, "qsub", *options, "-n", "3", "-q", "capacity", "--submit",
                                 "allreduce_hosts.py"))
    waiting = wait_for_state(env, cwd, job_id, "Not enough total nodes")
    assert f"job {job_id} (pbs): QUEUED [Q] (Can Never Run: Not enough total nodes available)" in waiting
    cancelled = hvdrun(env, cwd, "qdel", job_id)
    assert cancelled.returncode == 0 and f"cancelled job {job_id}" in cancelled.stdout, cancelled.stderr
    again = hvdrun(env, cwd, "qdel", job_id)
    assert again.returncode == 0 and "had already ended" in again.stdout, again.stdout + again.stderr



# -- ask the scheduler, then the YAML: this server's `qstat -Qf -F json` -------------------------------------

PBS_SERVER = "(from the PBS server: qstat -Qf -F json)"


@pytest.fixture
def asked(pbs_job, monkeypatch):
    """In-process ``build_spec`` sees the server as ``hvdrun qsub`` does; returns the job's cluster YAML."""
    env, cwd, options = pbs_job
    for name in ("PBS_CONF_FILE", "PATH"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.chdir(cwd)
    return options[1]


def test_a_routing_queue_is_checked_against_the_servers_destinations(server, pbs_job, asked):
    env, cwd, _ = pbs_job
    args = ("qsub", "--config", asked, "-q", "prod", "-n", "300")
    with server.changed("set queue small resources_max.walltime = 06:00:00",
                        "set queue small resources_max.walltime = 12:00:00"):
        assert usage_error(hvdrun(env, cwd, *args, "-t", "08:00:00", "allreduce_hosts.py")) == (
            f"-t/--walltime 08:00:00: queue 'prod' on aurora {PBS_SERVER} sends 300 nodes to 'small' (256-1024 "
            f"nodes), which allows at most 06:00:00; the YAML ({asked}) would allow it")
        within = hvdrun(env, cwd, *args, "-t", "05:00:00", "--dry-run", "allreduce_hosts.py")
        assert within.returncode == 0 and "#PBS -q prod" in within.stdout, within.stderr
    assert usage_error(hvdrun(env, cwd, *args[:3], "-q", "small", "-n", "300", "allreduce_hosts.py")) == (
        f"-q/--queue 'small': queue 'small' on aurora {PBS_SERVER} takes jobs only from a routing queue; "
        "submit to prod")
    refused = usage_error(hvdrun(env, cwd, *args[:3], "-q", "nosuch", "allreduce_hosts.py"))
    assert refused.startswith("-q/--queue 'nosuch': the PBS server (qstat -Qf -F json) has no queue 'nosuch'; "
                              "its queues: "), refused
    assert set(refused.split("its queues: ")[1].split(", ")) == {  # not the ones taking jobs only from prod
        "debug", "debug-scaling", "prod", "capacity", "visualization"}


def test_where_the_server_and_the_yaml_disagree_the_server_decides_with_a_notice(server, asked):
    with server.changed("set queue small resources_max.walltime = 06:00:00",
                        "set queue small resources_max.walltime = 12:00:00"):
        spec = build_spec(JobRequest(command=("allreduce_hosts.py",), config_file=asked, queue="prod", nodes=300,
                                     walltime="05:00:00"))
    assert spec.notices == (f"queue 'prod' on aurora: the PBS server (qstat -Qf -F json) states 'small' (256-1024 "
                            f"nodes, at most 06:00:00); the YAML ({asked}) says 'small' (256-1024 nodes, at most "
                            "12:00:00); the server's limits decided",)


def test_a_server_that_does_not_answer_leaves_the_yaml_to_decide(server, asked, monkeypatch):
    monkeypatch.setattr(queue_limits, "ASK_TIMEOUT_S", 1.0)
    pid = server.daemon_pid("pbs_server.bin")
    os.kill(pid, signal.SIGSTOP)
    try:
        spec = build_spec(JobRequest(command=("allreduce_hosts.py",), config_file=asked, queue="prod", nodes=300,
                                     walltime="08:00:00"))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert spec.notices == ("could not ask the scheduler for queue limits ('qstat -Q -f -F json' did not answer "
                            f"within 1 s); checked against the YAML ({asked}) only",)


def test_the_server_of_another_machine_is_not_believed(server, asked):
    """A dry run for Polaris on an Aurora login node: Aurora's server does not decide Polaris's queues."""
    spec = build_spec(JobRequest(command=("allreduce_hosts.py",), cluster="polaris", queue="prod", nodes=20,
                                 walltime="01:00:00", account="MyProject"))
    assert spec.notices == (f"the PBS server here ({server.nodes[0]}) is not polaris's: queue limits come from the "
                            f"YAML ({REPO / 'cluster_configs' / 'polaris.yaml'}) only",)


# -- jobs longer than a walltime: a chain of 1-minute jobs on the real server (its MOM enforces the walltime) -------

REGRESSION = REPO / "examples" / "linear_regression.py"
# 160 epochs of at least 0.5 s: about 2.3 jobs of 1 minute warned 20 s early on this machine alone (66-72 epochs a
# job), so two jobs never finish it; under the loaded suite an epoch's collectives cost up to 0.3 s more (46-60 epochs
# a job), so the chain may take 4 (it has room for 4; the runs alone took 3 every time)
CHAIN_EPOCHS, SECONDS_PER_EPOCH = "160", "0.5"


@pytest.fixture
def chain_job(server, pbs_job):
    """``pbs_job`` with 1-minute jobs allowed on the debug queue (Aurora's least is 5 minutes), and PBS's own
    client commands and configuration inside the job (a site's /etc/pbs.conf and PATH), for the job's hvdrun to
    read its walltime (qstat) and a chain's job to cancel the rest (qdel)."""
    env, cwd, options = pbs_job
    inside = ("--export", f"PBS_CONF_FILE={env['PBS_CONF_FILE']}", "--setup",
              f"export PATH={pbs.PBS_EXEC / 'bin'}:$PATH")
    with server.changed("set queue debug resources_min.walltime = 00:00:30",
                        f"set queue debug resources_min.walltime = {pbs.LEAST_WALLTIME}"):
        yield env, cwd, (*options, *inside)


def chain_timeline(cwd: Path) -> str:
    """Each job's output lines that tell its story: start, resume, warning, checkpoint, end."""
    words = ("started on", "resumed at", "allocation ends", "warned:", "got SIGTERM", "chain ", "ended with", "exact=")
    lines = []
    for path in sorted((cwd / "hvdrun-jobs").glob("*.output")):
        lines += [f"{path.name}: {line}" for line in path.read_text().splitlines() if any(w in line for w in words)]
    return "\n".join(lines)


def uninterrupted(env, cwd: Path) -> str:
    """The ``exact=`` coefficients of the same training run in one go (2 ranks, this machine)."""
    done = hvdrun(env, cwd, "-np", "2", str(REGRESSION), "--epochs", CHAIN_EPOCHS)
    assert done.returncode == 0, done.stderr
    return re.search(r"exact=(\S+)", done.stdout).group(1)


@pytest.mark.timeout(480)
def test_a_chain_of_one_minute_jobs_resumes_each_from_the_last_checkpoint_and_equals_one_run(chain_job):
    env, cwd, options = chain_job
    result = hvdrun(env, cwd, "qsub", *options, "-n", "2", "--ranks-per-node", "1", "-t", "00:01:00", "--chain", "4",
                    "--warn-before", "20", "--wait", "--", "python", str(REGRESSION), "--epochs", CHAIN_EPOCHS,
                    "--seconds-per-epoch", SECONDS_PER_EPOCH, "--checkpoint", str(cwd / "ckpt.pt"), timeout=420)
    timeline = chain_timeline(cwd)
    print(timeline)
    assert result.returncode == 0, result.stderr + timeline
    chain_id = submitted_id(result)
    assert re.fullmatch(r"chain-\d+\.\S+", chain_id)
    ended = re.search(rf"chain {re.escape(chain_id)} ended at job ([34]): training done \(exit code 0 before any "
                      r"warning\)", result.stderr)
    assert ended, result.stderr
    outputs = sorted((cwd / "hvdrun-jobs").glob("*.output"))
    count = int(ended.group(1))
    assert [p.name.rsplit(".", 2)[-2] for p in outputs] == [str(n) for n in range(1, count + 1)], outputs
    texts = [p.read_text() for p in outputs]
    *warned_jobs, last = texts
    for warned in warned_jobs:  # warned by hvdrun 20 s before the walltime, checkpointed, exited 0
        assert re.search(r"the allocation ends in 0:00:\d\d \(--warn-before 20\): warning every rank with SIGUSR1",
                         warned), warned
        assert re.search(rf"warned: saved epoch \d+ of {CHAIN_EPOCHS}", warned), warned
        assert "ended with exit code 0" in warned
    saved = [int(n) for n in re.findall(r"warned: saved epoch (\d+)", "".join(warned_jobs))]
    resumed = [int(n) for n in re.findall(r"resumed at epoch (\d+)", "".join(texts[1:]))]
    assert resumed == saved and saved == sorted(saved) and 0 < saved[0] and saved[-1] < int(CHAIN_EPOCHS), saved
    assert "warning every rank" not in last and "ended with exit code 0" in last
    exact = set(re.findall(r"exact=(\S+)", last))
    assert exact == {uninterrupted(env, cwd)}  # both ranks, bit for bit an uninterrupted run's
    listed = hvdrun(env, cwd, "qstat", chain_id)
    assert listed.returncode == 0 and f"ended at job {count}: training done" in listed.stdout, listed.stdout
    assert len(re.findall(r"warned at \d\d:\d\d:\d\d", listed.stdout)) == count - 1, listed.stdout


@pytest.mark.timeout(240)
def test_a_chain_whose_first_job_fails_stops_and_cancels_the_rest(chain_job):
    env, cwd, options = chain_job
    result = hvdrun(env, cwd, "qsub", *options, "-n", "2", "--ranks-per-node", "1", "-t", "00:01:00", "--chain", "3",
                    "--wait", "allreduce_hosts.py", "3", "1", timeout=180)
    output = job_output(cwd)
    assert result.returncode == 3, result.stderr + output
    chain_id = submitted_id(result)
    assert f"chain {chain_id} ended at job 1: failed (exit code 3 before any warning)" in result.stderr
    assert "cancelled job" in output, output  # by the failed job's own last line
    assert len(list((cwd / "hvdrun-jobs").glob("*.output"))) == 1  # the others never ran
    listed = hvdrun(env, cwd, "qstat", chain_id).stdout
    assert "ended at job 1: failed" in listed and listed.count("UNKNOWN") == 2, listed


@pytest.mark.timeout(240)
def test_qdel_of_a_chain_leaves_nothing_queued_or_running_on_any_host(pbs_server, chain_job):
    _, hosts = pbs_server
    env, cwd, options = chain_job
    marker = f"{time.time_ns() % 10**9}.7"
    chain_id = submitted_id(hvdrun(env, cwd, "qsub", *options, "-n", "2", "--ranks-per-node", "1", "-t", "00:01:00",
                                   "--chain", "3", "--submit", "--", "sleep", marker))
    assert wait_until(lambda: len(hosts_of(sleepers(marker))) == 2, 60), "the first job never ran on both hosts"
    cancelled = hvdrun(env, cwd, "qdel", chain_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.count("cancelled job") == 3, cancelled.stdout  # the held ones, then the running one
    assert f"chain {chain_id} ended by hvdrun qdel: cancelled" in cancelled.stdout
    assert wait_until(lambda: not sleepers(marker), 30), sleepers(marker)
    assert wait_until(lambda: not leftovers(cwd, hosts.addrs), 30), leftovers(cwd, hosts.addrs)
    seen = []

    def nothing_left() -> bool:  # the server says R until the MOM's report of the end reaches it
        seen.append(hvdrun(env, cwd, "qstat", chain_id).stdout)
        return not any(state in seen[-1] for state in ("RUNNING", "EXITING", "QUEUED", "HELD"))

    assert wait_until(nothing_left, 30), seen[-1]
    assert len(list((cwd / "hvdrun-jobs").glob("*.output"))) == 1, seen[-1]  # nothing started after the qdel


IGNORES_THE_WARNING = """\
import os, signal, sys, time
import hvdrun.torch as hvd
signal.signal(signal.SIGUSR1, lambda *_: print("warned; going on regardless", flush=True))
hvd.init()
if not os.path.exists(sys.argv[1]):  # the first job runs into its walltime; the next one finishes at once
    open(sys.argv[1], "w").close()
    time.sleep(120)
print("finished", flush=True)
"""


@pytest.mark.timeout(240)
def test_a_chain_job_killed_at_its_walltime_after_the_warning_is_continued_by_the_next(chain_job):
    """The MOM enforces the walltime (SIGTERM, then SIGKILL after its kill_delay): the job's script traps the
    SIGTERM, keeps the exit code and judges the chain before the SIGKILL."""
    env, cwd, options = chain_job
    (cwd / "ignores.py").write_text(IGNORES_THE_WARNING)
    result = hvdrun(env, cwd, "qsub", *options, "-n", "1", "--ranks-per-node", "1", "-t", "00:00:40", "--chain", "2",
                    "--warn-before", "15", "--wait", "--", "python", "ignores.py", str(cwd / "mark"), timeout=200)
    first, second = (p.read_text() for p in sorted((cwd / "hvdrun-jobs").glob("*.output")))
    assert result.returncode == 0, result.stderr + first + second
    assert "warned; going on regardless" in first and "=>> PBS: job killed: walltime" in first, first
    assert re.search(r"job 1 exit code 143, after hvdrun's warning before the walltime: job 2 resumes", first), first
    assert (cwd / "hvdrun-jobs").glob("*.1.exitcode") and "finished" in second
    assert "ended at job 2: training done (exit code 0 before any warning)" in result.stderr, result.stderr


# -- Copper around a job (ALCF Aurora): FAKE Copper scripts (tests/fakes/fake_copper), the real PBS server --------

FAKE_COPPER = REPO / "tests" / "fakes" / "fake_copper"
READS_THROUGH = """\
import sys, yaml
import hvdrun.torch as hvd
hvd.init()
print(f"rank {hvd.rank()} yaml from {yaml.__file__}", flush=True)
sys.exit(3 if hvd.rank() == 1 else 0)
"""


def test_copper_around_a_job_that_fails_is_started_read_through_and_stopped(pbs_job):
    """--copper with FAKE Copper scripts (Copper runs only on Aurora): the job's site-packages are read through the
    mount by every rank, and stop_copper.sh runs although a rank fails (exit code 3)."""
    env, cwd, options = pbs_job
    config_path = Path(options[1])
    config = yaml.safe_load(config_path.read_text())
    mount = cwd / "copper_mount"
    config["scheduler"]["copper"]["mount"] = str(mount)  # this test's own, not /tmp/${USER}/copper_mount
    config_path.write_text(yaml.safe_dump(config))
    (cwd / "through.py").write_text(READS_THROUGH)
    result = hvdrun(env, cwd, "qsub", *options, "-n", "2", "--ranks-per-node", "1", "-t", "10", "--copper",
                    "--setup", f"export PATH={FAKE_COPPER}:$PATH", "--wait", "through.py")
    output = job_output(cwd)
    assert result.returncode == 3, result.stderr + output
    assert "fake module: load copper" in output and f"fake copper: launched at {mount}" in output, output
    site = sysconfig.get_paths()["purelib"]
    froms = re.findall(r"rank (\d) yaml from (\S+)", output)
    assert sorted(rank for rank, _ in froms) == ["0", "1"], output
    assert all(path.startswith(f"{mount}{site}/") for _, path in froms), froms  # read through the mount
    assert f"fake copper: stopped {mount}" in output and not mount.exists(), output  # after the failure
    logs = next((cwd / "hvdrun-jobs").glob("*.copper-logs"))
    assert (logs / "fake-copper.log").read_text().splitlines() == [f"fake copper: launched at {mount}",
                                                                   f"fake copper: stopped {mount}"]
