"""Ranks forked from a fork server that preloaded torch (``hvdrun --preload``) see what a new interpreter shows
them, and end the way it ends."""

from __future__ import annotations

import json
import shutil
import sys
import zipapp

import pytest

from hvdrun.envvars import FORK_SERVER_FROM
from tests.conftest import REPO

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def spawned_fork_server(hvdrun_env):
    """These are tests of the fork server hvdrun spawns itself: a new interpreter that imports torch."""
    hvdrun_env.pop(FORK_SERVER_FROM)

WORKER = REPO / "tests" / "integration" / "workers" / "rank_facts.py"


def rank_facts(stdout: str) -> list[dict]:
    found = [json.loads(line.split("FACTS ", 1)[1]) for line in stdout.splitlines() if "FACTS " in line]
    return sorted(found, key=lambda facts: facts["rank"])


@pytest.fixture
def worker(tmp_path):
    shutil.copy(WORKER, tmp_path / "rank_facts.py")
    return "rank_facts.py"


def test_a_forked_rank_starts_and_ends_as_a_new_interpreter_would(run_hvdrun, hvdrun_env, worker, zygote):
    runs = {choice: run_hvdrun("-np", "2", "--preload", choice, worker, "ok") for choice in ("auto", "none")}
    hvdrun_env[FORK_SERVER_FROM] = str(zygote.path)  # the fork server forked by a process that imported torch
    runs["zygote"] = run_hvdrun("-np", "2", worker, "ok")
    for choice, done in runs.items():
        assert done.returncode == 0, done.stderr
        for rank in (0, 1):
            lines = [line for line in done.stdout.splitlines() if line.startswith(f"[{rank}]<stdout>:")]
            assert lines[-3:] == [f"[{rank}]<stdout>:{text}" for text in (
                "written without a flush", "the non-daemon thread ended", "atexit ran")], (choice, done.stdout)
    forked, fresh, adopted = (rank_facts(runs[choice].stdout) for choice in ("auto", "none", "zygote"))
    assert [f.pop("preloaded") for f in forked + adopted] == [True] * 4
    assert [f.pop("preloaded") for f in fresh] == [False] * 2
    assert forked[0].pop("random") != forked[1].pop("random")  # each rank its own random state
    assert adopted[0].pop("random") != adopted[1].pop("random")
    for f in fresh:
        f.pop("random")
    assert forked == fresh
    assert adopted == fresh
    assert forked[0]["argv"] == ["rank_facts.py", "ok"] and forked[0]["stdin"] == ""
    assert forked[0]["ps"] == ["-u", "rank_facts.py", "ok"] and forked[0]["environ_is_own"]


def test_ranks_on_ssh_hosts_fork_from_their_hosts_preload(run_hvdrun, hvdrun_env, ssh_hosts, worker):
    """A host's agent starts under the variables the ranks' interpreters read at their start (the launcher's, not
    the SSH login's): its fork server's preload serves them, as a local job's does."""
    hvdrun_env["LC_HVDRUN_TEST"] = "the launcher's"  # read at an interpreter's start (locale); no login sets it
    done = run_hvdrun("-H", ssh_hosts.hosts(2, 2), *ssh_hosts.args(), worker, "ok", timeout=120)
    assert done.returncode == 0, done.stderr
    facts = rank_facts(done.stdout)
    assert [(f["rank"], f["preloaded"]) for f in facts] == [(str(rank), True) for rank in range(4)], done.stdout


MODULES_SEEN = """import sys
SEEN = sorted(m for m in ("torch", "torch._dynamo", "hvdrun.torch") if m in sys.modules)
import torch
{body}
print("SEEN", SEEN)
"""
OPTIMIZER = "torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)"


def test_a_zygote_forks_each_job_with_the_modules_its_ranks_want_and_no_other(run_hvdrun, hvdrun_env, zygote,
                                                                               tmp_path):
    """A job whose script builds an optimizer preloads torch._dynamo too: its fork server comes from the zygote's
    template, which imported it; a job that does not want it gets a server without it."""
    hvdrun_env[FORK_SERVER_FROM] = str(zygote.path)
    for name, body, seen in (("plain.py", "import hvdrun.torch", "['hvdrun.torch', 'torch']"),
                             ("trains.py", f"import hvdrun.torch\n{OPTIMIZER}",
                              "['hvdrun.torch', 'torch', 'torch._dynamo']"),
                             ("torch_only.py", OPTIMIZER, "['torch', 'torch._dynamo']")):
        (tmp_path / name).write_text(MODULES_SEEN.format(body=body))
        done = run_hvdrun("-np", "2", name)
        assert done.returncode == 0, done.stderr
        assert sorted(line.split(":", 1)[1] for line in done.stdout.splitlines() if "SEEN" in line) == \
            [f"SEEN {seen}"] * 2, (name, done.stdout)


def test_a_zygote_that_cannot_be_reached_leaves_hvdrun_to_spawn_its_fork_server(run_hvdrun, hvdrun_env, worker,
                                                                                 tmp_path):
    hvdrun_env[FORK_SERVER_FROM] = str(tmp_path / "no-zygote.sock")
    done = run_hvdrun("-np", "2", worker, "ok")
    assert done.returncode == 0, done.stderr
    assert [facts["preloaded"] for facts in rank_facts(done.stdout)] == [True, True]


@pytest.mark.parametrize(("end", "code", "says"), [
    ("exit3", "exited with code 3", None),
    ("raise", "exited with code 1", "ValueError: the rank failed"),
    ("message", "exited with code 1", "the rank gave up"),
    ("interrupt", "was killed by signal 2 (SIGINT)", "KeyboardInterrupt"),
])
def test_a_forked_rank_that_fails_reports_as_its_interpreter_would(run_hvdrun, worker, end, code, says):
    done = run_hvdrun("-np", "1", worker, end)
    assert done.returncode != 0 and f"rank 0 on host localhost {code}" in done.stderr, done.stderr
    assert says is None or f"[0]<stderr>:{says}" in done.stdout + done.stderr
    assert "preload.py" not in done.stderr  # the traceback starts at the rank's script, as python's would
    assert "atexit ran" in done.stdout


@pytest.fixture
def exit_paths(tmp_path):
    shutil.copy(REPO / "tests" / "integration" / "workers" / "exit_paths.py", tmp_path / "exit_paths.py")
    return tmp_path


def test_a_forked_rank_flushes_what_the_interpreters_end_would(run_hvdrun, hvdrun_env, exit_paths):
    hvdrun_env.pop("PYTHONUNBUFFERED", None)  # the fork server's C stdout is then fully buffered, as on a cluster
    done = run_hvdrun("-np", "1", "exit_paths.py", "last")
    assert done.returncode == 0, done.stderr
    assert "[0]<stdout>:preloaded=True faulthandler=False orig_argv=['exit_paths.py', 'last']" in done.stdout
    assert "[0]<stdout>:a C printf line" in done.stdout
    assert (exit_paths / "unclosed.txt").read_text() == "every byte arrives\n"


def test_a_start_up_variable_or_a_zipapp_starts_a_new_interpreter(run_hvdrun, exit_paths):
    done = run_hvdrun("-np", "1", "-x", "PYTHONFAULTHANDLER=1", "exit_paths.py")
    assert done.returncode == 0, done.stderr
    assert "[0]<stdout>:preloaded=False faulthandler=True" in done.stdout
    app = exit_paths / "app"
    app.mkdir()
    shutil.copy(exit_paths / "exit_paths.py", app / "__main__.py")
    zipapp.create_archive(app, exit_paths / "app.pyz")
    done = run_hvdrun("-np", "1", "--preload", "torch", sys.executable, "app.pyz")
    assert done.returncode == 0, done.stderr
    assert "[0]<stdout>:preloaded=False" in done.stdout and "[0]<stdout>:a C printf line" in done.stdout
