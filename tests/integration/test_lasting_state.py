"""``--state-dir``: hvd.elastic state that outlives the job. The warning's moment comes from the variables hvdrun
gives the ranks inside an allocation (HVDRUN_DEADLINE, HVDRUN_WARN_BEFORE), set here directly: the allocations
themselves are real in test_pbs.py and test_scheduler_jobs.py."""

from __future__ import annotations

import re
import time

import pytest

from hvdrun.envvars import DEADLINE, STATE_INTERVAL_S, WARN_BEFORE
from tests.conftest import REPO

WORKER = REPO / "tests" / "integration" / "workers" / "elastic_regression.py"
EPOCHS = "60"


@pytest.fixture
def regression_env(hvdrun_env):
    hvdrun_env["PYTHONPATH"] = f"{REPO / 'examples'}:{REPO}"
    return hvdrun_env


def exact(output: str) -> set[str]:
    return set(re.findall(r"exact=(\S+)", output))


def test_an_elastic_script_keeps_its_state_at_the_warning_and_the_next_job_resumes_it(run_hvdrun, regression_env,
                                                                                      tmp_path):
    whole = run_hvdrun("-np", "2", str(WORKER), EPOCHS, "0")
    assert whole.returncode == 0, whole.stderr
    # the warning is due 1.5 s into the first job: it keeps the state and ends with exit code 0
    regression_env.update({DEADLINE: f"{time.time() + 1001.5:.3f}", WARN_BEFORE: "1000"})
    first = run_hvdrun("-np", "2", "--state-dir", "kept", str(WORKER), EPOCHS, "0.05")
    assert first.returncode == 0, first.stderr
    assert "hvdrun: elastic: the allocation ends soon: the state is kept in " in first.stderr, first.stderr
    assert not exact(first.stdout) and (tmp_path / "kept" / "elastic-state.pt").is_file()
    stopped_at = int(re.search(r"\[0\]<stdout>:starts at epoch (\d+)", first.stdout).group(1))
    assert stopped_at == 0
    regression_env.pop(DEADLINE)
    second = run_hvdrun("-np", "2", "--state-dir", "kept", str(WORKER), EPOCHS, "0")
    assert second.returncode == 0, second.stderr
    resumed = int(re.search(r"starts at epoch (\d+)", second.stdout).group(1))
    assert 0 < resumed < int(EPOCHS), second.stdout
    assert "hvdrun: elastic: resumed from " in second.stderr
    assert exact(second.stdout) == exact(whole.stdout) and len(exact(whole.stdout)) == 1  # bit for bit


def test_a_state_dir_that_cannot_be_written_is_said_on_every_rank_and_the_job_goes_on(run_hvdrun, regression_env,
                                                                                       tmp_path):
    (tmp_path / "file").write_text("not a directory")
    regression_env[STATE_INTERVAL_S] = "0"  # a save at every commit
    done = run_hvdrun("-np", "2", "--state-dir", "file/kept", str(WORKER), "5", "0")
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert re.search(rf"\[{rank}\]<stderr>:hvdrun: warning: rank {rank}: the elastic state could not be kept in "
                         rf"\S+/file/kept \(Not a directory\); the job goes on", done.stderr), done.stderr
    assert done.stderr.count("could not be kept") == 2  # said once per rank, not at every commit
    assert len(exact(done.stdout)) == 1
