"""hvdrun qsub / qstat / qdel against a real Slurm (2 nodes on SSH hosts), Slurm's Torque-style
qsub/qstat/qdel, and FAKE PBS Pro / FAKE Cobalt commands (tests/fakes, tests named "fake"): PBS Pro only for a job
that runs Cray PALS mpiexec (no server here runs it; everything else of PBS is tested against a real OpenPBS in
test_pbs.py), Cobalt because it is retired and has no source.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from hvdrun.envvars import FORK_SERVER_FROM
from tests.conftest import REPO, wait_until

WORKERS = Path(__file__).parent / "workers"
FAKES = REPO / "tests" / "fakes"
PINNED = """\
import os, sys
from hvdrun.runtime import context
world = context.init().world
print(f"rank {world.rank} local {world.local_rank} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} "
      f"device {os.environ.get('HVDRUN_DEVICE_ORDINAL')}", flush=True)
rank = world.rank
context.shutdown()
sys.exit(int(sys.argv[1]) if len(sys.argv) > 2 and rank == int(sys.argv[2]) else 0)
"""


@pytest.fixture
def job_dir(tmp_path, hvdrun_env):
    shutil.copy(WORKERS / "allreduce_hosts.py", tmp_path)
    (tmp_path / "pinned.py").write_text(PINNED)
    hvdrun_env["HVDRUN_JOBS_DIR"] = str(tmp_path / "registry")
    hvdrun_env.pop(FORK_SERVER_FROM)  # a job's fork server stays inside the scheduler's hold on the job
    hvdrun_env["PYTHONPATH"] = str(REPO)
    return tmp_path


def hvdrun(env, cwd, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hvdrun", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def submitted_id(result) -> str:
    assert result.returncode == 0 or result.stdout.strip(), result.stderr
    return result.stdout.strip().splitlines()[0]


def job_output(cwd: Path) -> str:
    return "".join(p.read_text() for p in sorted((cwd / "hvdrun-jobs").glob("*.output")))


def wait_for_state(env, cwd, job_id, word, timeout_s=30.0) -> str:
    seen = []

    def reached() -> bool:
        seen.append(hvdrun(env, cwd, "qstat", job_id).stdout)
        return word in seen[-1]

    assert wait_until(reached, timeout_s), f"job {job_id} never reached {word}: {seen[-1:]}"
    return seen[-1]


def site_python_without_hvdrun(directory: Path) -> Path:
    """``DIRECTORY/site-bin`` holding a ``python`` that cannot import hvdrun (isolated mode), as a site's setup
    would put first on a job's PATH."""
    site = directory / "site-bin"
    site.mkdir()
    (site / "python").write_text(f"#!/bin/sh\nexec {shutil.which('python3') or '/usr/bin/python3'} -I \"$@\"\n")
    (site / "python").chmod(0o755)
    assert subprocess.run([str(site / "python"), "-c", "import hvdrun"], capture_output=True).returncode != 0
    return site


# -- real Slurm ------------------------------------------------------------------------------------------

@pytest.fixture
def slurm_env(slurm_cluster, hvdrun_env, job_dir):
    hvdrun_env.update(slurm_cluster.env)
    return hvdrun_env


def test_slurm_submit_wait_runs_a_two_node_allreduce(slurm_cluster, slurm_env, job_dir):
    result = hvdrun(slurm_env, job_dir, "qsub", "--cluster", "slurm", "-n", "2", "--ranks-per-node", "2", "-t", "5",
                    "--wait", "allreduce_hosts.py")
    assert result.returncode == 0, result.stderr + job_output(job_dir)
    job_id = submitted_id(result)
    assert re.search(rf"job {job_id} RUNNING on ", result.stderr)
    assert f"job {job_id} FINISHED [COMPLETED], exit code 0" in result.stderr
    output = job_output(job_dir)
    oks = re.findall(r"\[(\d)\]<stdout>:rank \d/4 local \d on (\S+) sum=10 ok", output)
    assert sorted(r for r, _ in oks) == ["0", "1", "2", "3"], output
    assert {host for _, host in oks} == set(slurm_cluster.nodes), output  # both nodes took part
    script = next((job_dir / "hvdrun-jobs").glob("*.slurm.sh"))
    shown = subprocess.run(["scontrol", "show", "job", job_id], env=slurm_env, capture_output=True, text=True).stdout
    assert f"Command={script}" in shown  # the saved copy is exactly what was submitted
    assert "#SBATCH --nodes=2" in script.read_text()


def test_slurm_job_restarts_through_srun_after_a_node_fault(slurm_cluster, slurm_env, job_dir):
    """qsub --max-restarts reaches the job's hvdrun, which restarts the ranks it started with srun."""
    from tests.integration.test_restarts import FLAKY, ranks

    (job_dir / "flaky.py").write_text(FLAKY)
    result = hvdrun(slurm_env, job_dir, "qsub", "--cluster", "slurm", "-n", "2", "--ranks-per-node", "1", "-t", "5",
                    "--max-restarts", "1", "--wait", "flaky.py", str(job_dir / "mark"), "kill")
    output = job_output(job_dir)
    assert result.returncode == 0, result.stderr + output
    assert "--max-restarts 1" in next((job_dir / "hvdrun-jobs").glob("*.slurm.sh")).read_text()
    assert "hvdrun: restart 1 of 1: attempt 1 ended with a node fault (rank 1 on host " in output, output
    assert "attempt 2 runs on the same hosts" in output  # two nodes, two ranks: no spare
    assert [(rank, restart) for rank, _, restart in ranks(output)] == [(0, 0), (0, 1), (1, 0), (1, 1)], output


def test_a_bare_python_command_runs_the_jobs_python_when_setup_puts_another_first_on_path(slurm_env, job_dir):
    """The site's setup lines (``module load conda; conda activate``) put an interpreter without hvdrun first
    on PATH: ``-- python pinned.py`` still runs every rank with the Python that runs hvdrun, and the job is
    named after the script, not ``python``."""
    site = site_python_without_hvdrun(job_dir)
    result = hvdrun(slurm_env, job_dir, "qsub", "--cluster", "slurm", "-n", "1", "--ranks-per-node", "2", "-t", "5",
                    "--setup", f"export PATH={site}:$PATH", "--setup", 'echo "python on PATH: $(command -v python)"',
                    "--wait", "--", "python", "pinned.py")
    output = job_output(job_dir)
    assert result.returncode == 0, result.stderr + output
    assert f"python on PATH: {site}/python" in output  # the site's interpreter was first
    assert sorted(re.findall(r"\[(\d)\]<stdout>:rank \d local \d", output)) == ["0", "1"], output
    script = next((job_dir / "hvdrun-jobs").glob("*.slurm.sh")).read_text()
    assert "#SBATCH --job-name=pinned" in script
    assert f"{sys.executable} -m hvdrun --cluster slurm --ranks-per-node 2 -- pinned.py" in script  # its Python


def test_slurm_wait_returns_the_jobs_failing_exit_code(slurm_env, job_dir):
    result = hvdrun(slurm_env, job_dir, "qsub", "--cluster", "slurm", "-n", "2", "--ranks-per-node", "1", "-t", "5",
                    "--wait", "allreduce_hosts.py", "3", "1")
    assert result.returncode == 3, result.stderr + job_output(job_dir)
    assert "FINISHED [FAILED], exit code 3 (NonZeroExitCode)" in result.stderr
    assert "rank 1 on host" in job_output(job_dir) and "exited with code 3" in job_output(job_dir)


def test_slurm_qstat_of_running_and_finished_jobs_and_qdel(slurm_env, job_dir, token):
    job_id = submitted_id(hvdrun(slurm_env, job_dir, "qsub", "--cluster", "slurm", "-n", "2", "-t", "5", "--submit",
                                 "--", "sleep", "300"))
    running = wait_for_state(slurm_env, job_dir, job_id, "RUNNING")
    assert re.search(rf"job {job_id} \(slurm\): RUNNING on \S+", running)
    assert "output: " in running
    # cancel the job's command, not the start-up files of its login shell (bash -l): a `pyenv rehash` in them,
    # killed, leaves its lock behind and every later login waits a minute for it
    assert wait_until(lambda: "started on" in job_output(job_dir), 60), job_output(job_dir)
    cancelled = hvdrun(slurm_env, job_dir, "qdel", job_id)
    assert cancelled.returncode == 0 and f"cancelled job {job_id}" in cancelled.stdout
    finished = wait_for_state(slurm_env, job_dir, job_id, "FINISHED")
    assert "FINISHED [CANCELLED], exit code 143" in finished  # ExitCode=0:15
    again = hvdrun(slurm_env, job_dir, "qdel", job_id)
    assert again.returncode == 0 and "had already ended" in again.stdout
    from tests.conftest import job_processes
    assert wait_until(lambda: not job_processes(token)), "the cancelled job left processes behind"


def test_slurm_qstat_says_why_a_job_waits(slurm_env, job_dir):
    job_id = submitted_id(hvdrun(slurm_env, job_dir, "qsub", "--scheduler", "slurm", "-n", "3", "--submit", "--",
                                 "true"))
    try:
        waiting = wait_for_state(slurm_env, job_dir, job_id, "QUEUED")
        assert re.search(rf"job {job_id} \(slurm\): QUEUED \[PENDING\] \(\w+", waiting), waiting
    finally:
        hvdrun(slurm_env, job_dir, "qdel", job_id)
    unknown = hvdrun(slurm_env, job_dir, "qstat", "999999")
    assert unknown.returncode == 1 and "UNKNOWN" in unknown.stdout


@pytest.mark.timeout(480)
def test_slurm_chain_of_one_minute_jobs_continues_an_elastic_script_from_its_state_dir(slurm_env, job_dir):
    """``hvd.elastic`` state kept by ``--state-dir`` at the warning (no code of the script's own for the walltime):
    3 jobs of 1 minute (4 at most under load), each resuming where the last stopped, and the result an
    uninterrupted run's."""
    slurm_env["PYTHONPATH"] = f"{REPO / 'examples'}:{REPO}"
    worker = WORKERS / "elastic_regression.py"
    result = hvdrun(slurm_env, job_dir, "qsub", "--cluster", "slurm", "-n", "2", "--ranks-per-node", "1", "-t", "1",
                    "--chain", "4", "--warn-before", "20", "--run-args", f"--state-dir {job_dir / 'kept'} --verbose",
                    "--wait", "--", "python", str(worker), "160", "0.5", timeout=420)
    outputs = sorted((job_dir / "hvdrun-jobs").glob("*.output"))
    texts = [p.read_text() for p in outputs]
    print("\n".join(f"{p.name}: {line}" for p, text in zip(outputs, texts, strict=True) for line in text.splitlines()
                    if re.search(r"started on|starts at|allocation ends|kept in|resumed from|chain |ended with|exact=",
                                 line)))
    assert result.returncode == 0, result.stderr + "".join(texts)
    chain_id = submitted_id(result)
    ended = re.search(rf"chain {chain_id} ended at job ([34]): training done \(exit code 0 before any warning\)",
                      result.stderr)  # 3 jobs alone; 4 at most under the loaded suite (see test_pbs.CHAIN_EPOCHS)
    assert ended and len(texts) == int(ended.group(1)), result.stderr
    assert re.search(r"hvdrun: note: the allocation ends at \S+ \S+ \S+ \(in 0:0(0:5\d|1:00)\), from squeue -h -j \d+ "
                     r"-o %L \(time left (0:5\d|1:00)\)", texts[0]), texts[0]  # --verbose: from the controller (%L
    # says 1:00 when the job asks in its first second)
    starts = [int(re.search(r"\[0\]<stdout>:starts at epoch (\d+)", text).group(1)) for text in texts]
    assert starts[0] == 0 and starts == sorted(set(starts)) and starts[-1] < 160, starts  # each resumed the last
    for text in texts[:-1]:
        assert "hvdrun: elastic: the allocation ends soon: the state is kept in " in text, text
        assert "ended with exit code 0" in text
    whole = hvdrun(slurm_env, job_dir, "-np", "2", str(worker), "160", "0")
    assert whole.returncode == 0, whole.stderr
    exact = set(re.findall(r"exact=(\S+)", texts[-1]))
    assert exact == set(re.findall(r"exact=(\S+)", whole.stdout)) and len(exact) == 1  # bit for bit


def test_slurm_chain_qdel_cancels_every_job(slurm_env, job_dir):
    marker = f"{os.getpid()}.{len(str(job_dir))}3"
    chain_id = submitted_id(hvdrun(slurm_env, job_dir, "qsub", "--cluster", "slurm", "-n", "1", "--ranks-per-node",
                                   "1", "-t", "1", "--chain", "3", "--submit", "--", "sleep", marker))
    def sleeping() -> bool:
        return any(p.info["cmdline"] == ["sleep", marker] for p in psutil.process_iter(["cmdline"]))

    assert wait_until(sleeping, 60), "the first job's rank never ran"  # past its script's chain-link begin
    cancelled = hvdrun(slurm_env, job_dir, "qdel", chain_id)
    assert cancelled.returncode == 0 and cancelled.stdout.count("cancelled job") == 3, cancelled.stdout
    seen = []

    def all_cancelled() -> bool:
        seen.append(hvdrun(slurm_env, job_dir, "qstat", chain_id).stdout)
        return seen[-1].count("FINISHED [CANCELLED]") == 3

    assert wait_until(all_cancelled, 30), seen[-1]
    assert "ended by hvdrun qdel: cancelled" in seen[-1]
    assert wait_until(lambda: not sleeping(), 30)


def test_pbs_style_job_through_slurms_torque_wrappers(slurm_cluster, slurm_env, job_dir):
    """Torque-flavoured PBS via Slurm: real qsub/qstat/qdel wrappers, PBS_NODEFILE, SSH launch inside."""
    ssh = " ".join(["--launcher", "ssh", *slurm_cluster.ssh.args()])
    result = hvdrun(slurm_env, job_dir, "qsub", "--scheduler", "pbs", "-n", "2", "-t", "5", "--ranks-per-node", "2",
                    "--run-args", ssh, "--wait", "allreduce_hosts.py", "4", "3")
    assert result.returncode == 4, result.stderr + job_output(job_dir)
    job_id = submitted_id(result)
    assert f"job {job_id} RUNNING [R] on {slurm_cluster.nodes[0]},{slurm_cluster.nodes[1]}" in result.stderr
    assert f"job {job_id} FINISHED [C], exit code 4" in result.stderr  # the wrapper has no Exit_status: read back
    output = job_output(job_dir)
    assert output.count("sum=10 ok") == 4 and "rank 3 on host" in output, output

    job_id = submitted_id(hvdrun(slurm_env, job_dir, "qsub", "--scheduler", "pbs", "-n", "1", "--submit", "--",
                                 "sleep", "300"))
    assert "RUNNING [R]" in wait_for_state(slurm_env, job_dir, job_id, "RUNNING")
    assert "cancelled" in hvdrun(slurm_env, job_dir, "qdel", job_id).stdout
    assert "FINISHED [C]" in wait_for_state(slurm_env, job_dir, job_id, "FINISHED")


# -- FAKE PBS Pro and FAKE Cobalt ------------------------------------------------------------------------

@pytest.fixture
def fake_scheduler(tmp_path, hvdrun_env, job_dir):
    """Put FAKE qsub/qstat/qdel of one scheduler first on PATH; returns ``install(name)``."""
    def install(name: str) -> dict[str, str]:
        bin_dir = tmp_path / f"fake-{name}-bin"
        bin_dir.mkdir()
        for command in ("qsub", "qstat", "qdel"):
            wrapper = bin_dir / command
            wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKES / f"fake_{name}.py"} {command} "$@"\n')
            wrapper.chmod(0o755)
        hvdrun_env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_SCHED_DIR=str(tmp_path / "fake-state"),
                          HOME=str(tmp_path))
        hvdrun_env.pop("SLURM_CONF", None)
        return hvdrun_env
    yield install
    for job in (tmp_path / "fake-state" / "jobs").glob("*"):
        pid = job / "runner.pid"
        if pid.exists() and (job / "state").read_text() != "done":
            subprocess.run(["kill", pid.read_text()], check=False)


POLARIS_IN_TEST = ("--cluster", "polaris", "-A", "MyProject", "--python", sys.executable,
                   "--export", f"HVDRUN_MPIEXEC={FAKES / 'fake_pals_mpiexec.py'}")


def test_fake_pbspro_polaris_job_pins_gpus_in_polaris_order(fake_scheduler, job_dir):
    env = fake_scheduler("pbspro")
    result = hvdrun(env, job_dir, "qsub", *POLARIS_IN_TEST, "-n", "1", "--ranks-per-node", "2", "--wait",
                    "pinned.py")
    output = job_output(job_dir)
    assert result.returncode == 0, result.stderr + output
    job_id = submitted_id(result)
    assert re.fullmatch(r"\d+\.fakepbs-01\.hsn\.cm\.polaris\.alcf\.anl\.gov", job_id)
    assert f"job {job_id} FINISHED [F], exit code 0 (Job run at" in result.stderr
    # PALS mpiexec from the config, GPUs in Polaris's reversed order: local rank L's GPU is device L
    assert "[0]<stdout>:rank 0 local 0 CUDA_VISIBLE_DEVICES=3,2,1,0 device 0" in output, output
    assert "[1]<stdout>:rank 1 local 1 CUDA_VISIBLE_DEVICES=3,2,1,0 device 1" in output, output
    short = job_id.split(".")[0]
    status = hvdrun(env, job_dir, "qstat", short)
    assert status.returncode == 0 and "FINISHED [F], exit code 0" in status.stdout
    again = hvdrun(env, job_dir, "qdel", job_id)
    assert again.returncode == 0 and "had already ended" in again.stdout


def test_fake_cobalt_job_warns_its_ranks_before_the_end_its_environment_carries(fake_scheduler, job_dir):
    from tests.integration.test_walltime_warning import NO_HANDLER

    env = fake_scheduler("cobalt")
    (job_dir / "plain.py").write_text(NO_HANDLER)
    result = hvdrun(env, job_dir, "qsub", "--cluster", "thetagpu-cobalt", "-n", "1", "-A", "MyProject", "-t", "1",
                    "--ranks-per-node", "2", "--python", sys.executable, "--run-args", "--launcher local",
                    "--filesystems", "", "--warn-before", "56", "--wait", "plain.py", "7")
    output = job_output(job_dir) + "".join(p.read_text() for p in (job_dir / "hvdrun-jobs").glob("*.error"))
    assert result.returncode == 0, result.stderr + output
    assert re.search(r"hvdrun: the allocation ends in 0:00:5\d \(--warn-before 56\): warning every rank with SIGUSR1",
                     output), output
    assert sorted(re.findall(r"rank (\d) still here", output)) == ["0", "1"], output


def test_fake_cobalt_thetagpu_job(fake_scheduler, job_dir):
    env = fake_scheduler("cobalt")
    args = ("qsub", "--cluster", "thetagpu-cobalt", "-n", "1", "-A", "MyProject", "-t", "10", "--ranks-per-node", "2",
            "--python", sys.executable, "--run-args", "--launcher local")
    result = hvdrun(env, job_dir, *args, "--filesystems", "", "--wait", "pinned.py", "7", "0")
    output = job_output(job_dir)
    assert result.returncode == 7, result.stderr + output
    job_id = submitted_id(result)
    assert job_id.isdigit()  # the filesystems warning on stderr is not taken for the id
    assert f"job {job_id} FINISHED, exit code 7" in result.stderr  # from the exit file: Cobalt forgets jobs
    assert "[1]<stdout>:rank 1 local 1 CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 device 1" in output, output
    script = next((job_dir / "hvdrun-jobs").glob("*.cobalt.sh"))
    assert os.access(script, os.X_OK)

    env["FAKE_SCHED_HOLD_S"] = "60"
    job_id = submitted_id(hvdrun(env, job_dir, *args, "--submit", "pinned.py"))
    assert "QUEUED [queued]" in hvdrun(env, job_dir, "qstat", job_id).stdout
    assert "cancelled" in hvdrun(env, job_dir, "qdel", job_id).stdout
    assert "had already ended" in hvdrun(env, job_dir, "qdel", job_id).stdout
