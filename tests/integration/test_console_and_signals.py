"""A console that stops reading, and signals at hvdrun's start: the job's end never waits on the console, and a
stop signal at any moment ends hvdrun with one line, exit code 128 + N, and nothing left running."""

from __future__ import annotations

import contextlib
import functools
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


def test_a_rank_that_prints_and_exits_while_the_console_does_not_read_ends_the_job(hvdrun_env, tmp_path, token):
    """Rank 1 prints 200,000 lines and exits 7 while rank 0 floods an unread console: the job never ended (rank 1's
    output waited for the console that rank 0's held, so rank 1 never exited); its files keep every line."""
    path = script(tmp_path, "lines.py", """
        import os, sys
        if os.environ["RANK"] == "1":
            for i in range(200000):
                print(f"line {i} of rank 1")
            sys.exit(7)
        while True:
            print("rank 0 floods " * 5)
    """)
    proc = start_unread(hvdrun_env, tmp_path, "-np", "2", "--output-dir", "logs", path)
    try:
        assert proc.wait(timeout=60) == 7
    finally:
        proc.kill()
    err = stderr_of(proc)
    assert "hvdrun: error: rank 1 on host localhost exited with code 7" in err, err[-2000:]
    assert "hvdrun: warning: the console's stdout took nothing for 5 s: the ranks' output no longer waits" in err
    assert "hvdrun: warning: the console's stdout stopped reading; " in err
    assert (tmp_path / "logs" / "rank.1" / "stdout").read_text().count("\n") == 200000
    assert wait_until(lambda: not job_processes(token)), job_processes(token)


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


def test_a_stop_signal_while_the_fork_server_imports_torch_starts_nothing(hvdrun_env, tmp_path, token):
    """SIGTERM and SIGINT in turn at +0.1 to +0.8 s under the default preload (the fork server, hvdrun's own child,
    imports torch): it took up to 3.6 s, and a guard and a rank started after hvdrun had decided nothing runs,
    outliving it by 2.8 s."""
    hvdrun_env.pop("HVDRUN_FORK_SERVER_FROM")
    path = script(tmp_path, "train.py", "import torch\nimport time\ntime.sleep(30)\n")
    for step, delay in enumerate((0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)):
        signum = (signal.SIGTERM, signal.SIGINT)[step % 2]
        proc = subprocess.Popen([sys.executable, "-m", "hvdrun", "-np", "2", path], env=hvdrun_env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        started = time.monotonic()
        assert wait_until(functools.partial(catches, proc.pid, signal.SIGTERM), 30)  # the interpreter may start late
        time.sleep(max(delay - (time.monotonic() - started), 0.0))
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signum, (delay, err)
        lines = err.decode().strip().splitlines()
        assert len(lines) == 1 and f"received {signal.Signals(signum).name}" in lines[0], (delay, err)
        assert wait_until(lambda: not job_processes(token), 1.5), (delay, job_processes(token))
        time.sleep(0.5)  # nothing starts late either
        assert not job_processes(token), (delay, job_processes(token))


def test_a_stop_signal_just_after_a_restart_line_starts_nothing(hvdrun_env, tmp_path, token):
    """0.3 s after ``hvdrun: restart 1 of 1``, while the new attempt's fork server imports torch."""
    hvdrun_env.pop("HVDRUN_FORK_SERVER_FROM")
    path = script(tmp_path, "fails_once.py", """
        import os, sys, time
        import torch
        if os.environ["HVDRUN_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(30)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "hvdrun", "-np", "2", "--max-restarts", "1", path],
                            env=hvdrun_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    while "hvdrun: restart 1 of 1" not in (line := proc.stderr.readline()):
        assert line, "no restart line"
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == ["hvdrun: error: received SIGTERM; no rank was started"], err
    assert wait_until(lambda: not job_processes(token), 1.0), job_processes(token)
    time.sleep(0.5)
    assert not job_processes(token), job_processes(token)


def test_sigquit_until_the_job_ends_keeps_its_exit_code(hvdrun_env, tmp_path, token):
    """Ctrl-\\ every 50 ms: stacks while the ranks run, a note after; hvdrun died of it (-3) as the job ended."""
    path = script(tmp_path, "short.py", "import time\ntime.sleep(1.5)\nprint('done', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-m", "hvdrun", "-np", "2", path], env=hvdrun_env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert wait_until(lambda: catches(proc.pid, signal.SIGQUIT), 30)
    sent = 0
    while proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGQUIT)
            sent += 1
        time.sleep(0.05)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, (sent, err[-2000:])
    assert out.count(b"done") == 2 and sent > 10
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
