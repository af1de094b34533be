"""A console that stops reading, and signals at hvdrun's start: the job's end never waits on the console, and a
stop signal at any moment ends hvdrun with one line, exit code 128 + N, and nothing left running."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import job_processes, wait_until
from tests.integration.test_local_launch import script
from tests.integration.test_stage_env import config, small_env  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration

FLOOD = """
import os, sys, time
if os.environ["RANK"] == "1" and sys.argv[1] == "fail":
    time.sleep(1)
    sys.exit(3)
while True:
    sys.stdout.write("x" * 1000 + "\\n")
"""


def start_unread(hvdrun_env, tmp_path, *args: str, stderr=subprocess.PIPE) -> subprocess.Popen[bytes]:
    """hvdrun with its stdout on a pipe that nobody reads (a console that stopped reading)."""
    return subprocess.Popen([sys.executable, "-m", "hvdrun", *args], env=hvdrun_env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=stderr)


def stderr_of(proc: subprocess.Popen[bytes]) -> str:
    assert proc.stderr is not None
    return proc.stderr.read().decode(errors="replace")


@pytest.mark.parametrize("merged", [False, True], ids=["stdout", "stdout-and-stderr"])
def test_a_failure_ends_the_job_while_the_console_does_not_read(hvdrun_env, tmp_path, token, merged):
    """It took until the reader went away (for ever here); now a few seconds, and the logs have everything."""
    path = script(tmp_path, "flood.py", FLOOD)
    proc = start_unread(hvdrun_env, tmp_path, "-np", "2", "--output-dir", "logs", path, "fail",
                        stderr=subprocess.STDOUT if merged else subprocess.PIPE)
    try:
        assert proc.wait(timeout=30) == 3
    finally:
        proc.kill()
    assert wait_until(lambda: not job_processes(token)), job_processes(token)
    if not merged:
        err = stderr_of(proc)
        assert "hvdrun: error: rank 1 on host localhost exited with code 3" in err, err[-2000:]
        assert "hvdrun: warning: the console's stdout stopped reading; " in err
        assert "of the ranks' output not shown (every rank's output is in logs)" in err
    assert (tmp_path / "logs" / "rank.0" / "stdout").stat().st_size > 1 << 20


def test_sigint_ends_a_job_whose_console_does_not_read(hvdrun_env, tmp_path, token):
    path = script(tmp_path, "flood.py", FLOOD)
    proc = start_unread(hvdrun_env, tmp_path, "-np", "2", path, "flood")
    try:
        assert wait_until(lambda: len(job_processes(token)) >= 5, 30)  # hvdrun + (guard, rank) x 2
        time.sleep(1)  # the pipe is full by now
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
    err = stderr_of(proc)
    assert "hvdrun: error: received SIGINT; stopped all 2 workers" in err, err[-2000:]
    assert wait_until(lambda: not job_processes(token)), job_processes(token)


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (``SigCgt`` of /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signum - 1) & 1)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_as_hvdrun_starts_is_one_line(hvdrun_env, tmp_path, token, signum):
    """At hvdrun's first instruction (the moment it catches SIGTERM, with SIGINT: before that the interpreter is still
    starting, with only its own handling), and 0.3 s later (importing, planning)."""
    for delay in (0.0, 0.3):
        proc = subprocess.Popen([sys.executable, "-m", "hvdrun", "-np", "2", "python", "-c",
                                 "import time; time.sleep(30)"], env=hvdrun_env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not catches(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:  # Python catches SIGINT itself
            time.sleep(0.001)
        time.sleep(delay)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signum, err
        assert f"received {signal.Signals(signum).name}" in err.decode(), err
        assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err
        assert wait_until(lambda: not job_processes(token)), job_processes(token)


def test_sigusr1_not_forwarded_is_noted_and_the_job_goes_on(hvdrun_env, tmp_path, token):
    path = script(tmp_path, "ready.py", "import time\nprint('ready', flush=True)\ntime.sleep(2)\n")
    proc = subprocess.Popen([sys.executable, "-m", "hvdrun", "-np", "2", "--forward-signals", "none", path],
                            env=hvdrun_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    while b"ready" not in proc.stdout.readline():
        pass
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert b"hvdrun: received SIGUSR1; not passed to the ranks" in err


def _is_named(proc: psutil.Process, name: str) -> bool:
    """``proc`` is ``name`` (False once it has ended: a child may exit while the test looks at it)."""
    try:
        return proc.name() == name
    except psutil.Error:
        return False


def test_sigterm_during_stage_env_leaves_no_copy_running(hvdrun_env, small_env, tmp_path, token):  # noqa: F811
    (small_env / "big").mkdir(exist_ok=True)
    for index in range(4):  # enough for tar | tar to run for a while
        (small_env / "big" / f"blob{index}").write_bytes(b"\0" * (64 << 20))
    try:
        conf = config(tmp_path, small_env, f"launcher: local\nlocal_dir: {tmp_path / 'node-local'}\n")
        proc = subprocess.Popen([sys.executable, "-m", "hvdrun", "--config", conf, "--stage-env", "-np", "1",
                                 "true"], env=hvdrun_env, cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        try:
            assert wait_until(lambda: any(_is_named(p, "tar") for p in _children(proc.pid)), 60)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    finally:
        for index in range(4):
            (small_env / "big" / f"blob{index}").unlink()
    assert proc.returncode == 143, err
    assert b"received SIGTERM" in err and b"Traceback" not in err, err
    assert wait_until(lambda: not job_processes(token), 15), job_processes(token)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
