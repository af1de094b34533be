"""``hvdrun qsub`` asks the scheduler for its queue limits, then the YAML: a real slurmctld whose partitions have
limits (tests/infra/slurm_cluster.sh: ``short`` MaxTime=00:10:00 MaxNodes=1, ``wide`` MinNodes=2
MaxTime=1-00:00:00). A real PBS server's queues are asked in test_pbs.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from hvdrun.envvars import FORK_SERVER_FROM
from hvdrun.errors import UsageError
from hvdrun.jobs import queue_limits
from hvdrun.jobs.spec import JobRequest, build_spec
from tests.conftest import REPO

CONTROLLER = "(from the Slurm controller: scontrol show partition)"
SLURM_YAML = """\
name: myslurm
scheduler:
  kind: slurm
  walltime: "5"
  queues:
    debug: {}
    short: {max_nodes: 2, max_walltime: "00:05:00"}
    wide: {min_nodes: 2}
"""


@pytest.fixture
def workdir(tmp_path, hvdrun_env, monkeypatch):
    """A directory with train.py and the Slurm YAML, which is the working directory of in-process calls too."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "myslurm.yaml").write_text(SLURM_YAML)
    hvdrun_env.update(PYTHONPATH=str(REPO), HVDRUN_JOBS_DIR=str(tmp_path / "registry"))
    hvdrun_env.pop(FORK_SERVER_FROM)  # a job's fork server stays inside the scheduler's hold on the job
    monkeypatch.chdir(tmp_path)
    return tmp_path


def qsub(env, cwd, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hvdrun", "qsub", "--python", sys.executable, *args], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


def usage_error(result) -> str:
    """The one line of a usage error (exit code 2)."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("hvdrun: error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr.removeprefix("hvdrun: error: ").rstrip("\n")


# -- real Slurm ------------------------------------------------------------------------------------------

@pytest.fixture
def slurm_env(slurm_cluster, hvdrun_env, workdir):
    hvdrun_env.update(slurm_cluster.env)
    return hvdrun_env


def test_slurm_refuses_a_job_over_its_partitions_limits_naming_the_controller(slurm_env, workdir):
    def refused(*args: str) -> str:
        return usage_error(qsub(slurm_env, workdir, "--scheduler", "slurm", *args, "--dry-run", "train.py"))

    short, wide = f"queue 'short' on slurm {CONTROLLER}", f"queue 'wide' on slurm {CONTROLLER}"
    assert refused("-q", "short", "-n", "2", "-t", "5") == f"-n/--nodes 2: {short} takes exactly 1 node"
    assert refused("-q", "short", "-t", "20") == f"-t/--walltime 00:20:00: {short} allows at most 00:10:00"
    assert refused("-q", "wide", "-n", "1", "-t", "5") == f"-n/--nodes 1: {wide} takes at least 2 nodes"
    assert refused("-q", "nosuch") == ("-q/--queue 'nosuch': the Slurm controller (scontrol show partition) has no "
                                       "partition 'nosuch'; its partitions: debug, short, wide")


def test_slurm_runs_a_job_within_its_partitions_limits(slurm_cluster, slurm_env, workdir):
    result = qsub(slurm_env, workdir, "--cluster", "slurm", "-q", "short", "-n", "1", "-t", "5", "--ranks-per-node",
                  "1", "--wait", "--", "true")
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.split()[0]
    shown = subprocess.run(["scontrol", "show", "job", job_id], env=slurm_env, capture_output=True, text=True).stdout
    assert "Partition=short" in shown and "JobState=COMPLETED" in shown, shown


def test_slurm_and_the_yaml_disagree_and_the_controller_decides(slurm_cluster, slurm_env, workdir, monkeypatch):
    yaml = str(workdir / "myslurm.yaml")
    assert usage_error(qsub(slurm_env, workdir, "--config", yaml, "-q", "short", "-n", "2", "train.py")) == (
        f"-n/--nodes 2: queue 'short' on myslurm {CONTROLLER} takes exactly 1 node; the YAML ({yaml}) would allow it")
    for name, value in slurm_cluster.env.items():
        monkeypatch.setenv(name, value)
    spec = build_spec(JobRequest(command=("train.py",), config_file=yaml, queue="short", walltime="8"))
    assert spec.notices == (f"queue 'short' on myslurm: the Slurm controller (scontrol show partition) accepts "
                            f"-t/--walltime 00:08:00, which the YAML ({yaml}) refuses (it allows at most 00:05:00); "
                            "the server decided",)
    spec = build_spec(JobRequest(command=("train.py",), config_file=yaml, queue="wide", nodes=2))
    assert spec.notices == ()  # MinNodes=2 both ways: the controller's MaxTime, which the YAML does not state, is quiet
    shown = qsub(slurm_env, workdir, "--config", yaml, "-q", "short", "-t", "8", "--dry-run", "train.py")
    assert shown.returncode == 0 and "#SBATCH --partition=short" in shown.stdout, shown.stderr
    assert "hvdrun: note: queue 'short' on myslurm: the Slurm controller (scontrol show partition) accepts " \
           "-t/--walltime 00:08:00" in shown.stderr, shown.stderr


def test_without_an_answering_slurm_the_yaml_decides(workdir, hvdrun_env, monkeypatch):
    if not shutil.which("scontrol"):
        pytest.skip("slurm-client is not installed (make test installs it)")
    yaml = str(workdir / "myslurm.yaml")
    no_slurm = {**hvdrun_env, "PATH": str(workdir / "empty-bin")}  # a laptop: no scontrol, silently the YAML
    ok = qsub(no_slurm, workdir, "--config", yaml, "-q", "short", "-n", "2", "--dry-run", "train.py")
    assert ok.returncode == 0 and "#SBATCH --partition=short" in ok.stdout, ok.stderr
    assert usage_error(qsub(no_slurm, workdir, "--config", yaml, "-q", "short", "-n", "3", "train.py")) == (
        "-n/--nodes 3: queue 'short' on myslurm takes 1 to 2 nodes")
    # scontrol there, its configuration missing: it retries for a minute; hvdrun waits ASK_TIMEOUT_S
    monkeypatch.setenv("SLURM_CONF", str(workdir / "no-such-slurm.conf"))
    monkeypatch.setattr(queue_limits, "ASK_TIMEOUT_S", 1.0)
    spec = build_spec(JobRequest(command=("train.py",), config_file=yaml, queue="short", nodes=2))
    assert spec.notices == ("could not ask the scheduler for queue limits ('scontrol --all --oneliner show partition' "
                            f"did not answer within 1 s); checked against the YAML ({yaml}) only",)
    with pytest.raises(UsageError, match=r"^-n/--nodes 3: queue 'short' on myslurm takes 1 to 2 nodes$"):
        build_spec(JobRequest(command=("train.py",), config_file=yaml, queue="short", nodes=3))
