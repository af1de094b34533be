"""A job that goes wrong, seen from the launcher (#22): console filter, idle timeout, signals passed to the
ranks, the closing summary of a failed job, a full output disk, an endless line, a rank that never joins."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import wait_until, where_it_hangs
from tests.integration.test_local_launch import script

pytestmark = pytest.mark.integration

# Every rank waits for SIGUSR1 after saying "ready", reports it and exits 0.
WAITS_FOR_USR1 = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(time.time()))
print("ready", flush=True)
deadline = time.time() + 60
while not got and time.time() < deadline:
    time.sleep(0.02)
print(f"rank {os.environ['HVDRUN_RANK']} got SIGUSR1" if got else "no signal", flush=True)
sys.exit(0 if got else 5)
"""


def start_hvdrun(env: dict[str, str], cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hvdrun", *args], env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def signal_when_ready(process: subprocess.Popen[str], ranks: int, signum: int) -> tuple[str, str]:
    """Send ``signum`` to hvdrun once every rank printed "ready"; the job's stdout and stderr."""
    lines: queue.Queue[str | None] = queue.Queue()
    errors: list[str] = []
    assert process.stdout is not None and process.stderr is not None
    out, err = process.stdout, process.stderr
    threading.Thread(target=lambda: ([lines.put(line) for line in out], lines.put(None)), daemon=True).start()
    threading.Thread(target=lambda: errors.append(err.read()), daemon=True).start()
    seen: list[str] = []
    while sum(line.endswith(":ready\n") for line in seen) < ranks:
        line = lines.get(timeout=60)
        assert line is not None, f"hvdrun ended before every rank was ready: {''.join(seen)}"
        seen.append(line)
    process.send_signal(signum)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hvdrun did not end within 60 s of {signal.Signals(signum).name}; the ranks' output: "
                    f"{''.join(seen)}\n{where_it_hangs(process)}")
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    assert wait_until(lambda: bool(errors), 10)
    return "".join(seen), errors[0]


def test_ranks_output_shows_only_those_ranks_and_the_files_keep_all(run_hvdrun, tmp_path):
    path = script(tmp_path, "hello.py", "import os; print('hello from', os.environ['HVDRUN_RANK'])")
    result = run_hvdrun("-np", "4", "--ranks-output", "0,2-3", "--output-dir", "out", path)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[{r}]<stdout>:hello from {r}" for r in (0, 2, 3)]
    for rank in range(4):
        assert (tmp_path / "out" / f"rank.{rank}" / "stdout").read_text() == f"hello from {rank}\n"


def test_ranks_output_still_names_a_hidden_failing_rank(run_hvdrun, tmp_path):
    path = script(tmp_path, "fail.py", """
        import os, sys
        if os.environ["HVDRUN_RANK"] == "1":
            print("rank 1 broke", file=sys.stderr)
            sys.exit(4)
    """)
    result = run_hvdrun("-np", "2", "--ranks-output", "0", path)
    assert result.returncode == 4
    assert "[1]<stderr>" not in result.stderr
    assert "rank 1 on host localhost exited with code 4" in result.stderr
    assert "last lines of rank 1 stderr:\n    rank 1 broke" in result.stderr


def test_a_rank_outside_the_job_in_ranks_output_is_a_usage_error(run_hvdrun, tmp_path):
    path = script(tmp_path, "hello.py", "print('hi')")
    result = run_hvdrun("-np", "2", "--ranks-output", "0,5", path)
    assert result.returncode == 2
    assert result.stderr.strip() == ("hvdrun: error: --ranks-output 0,5: the job has 2 ranks (0-1); "
                                     "e.g. --ranks-output 0")


def test_idle_timeout_stops_a_silent_job_with_124(run_hvdrun, tmp_path):
    path = script(tmp_path, "quiet.py", """
        import time
        print("started", flush=True)
        time.sleep(300)
    """)
    result = run_hvdrun("-np", "2", "--idle-timeout", "1.5", path)
    assert result.returncode == 124, result.stderr
    assert result.stdout.count("started") == 2
    assert result.stderr.strip().splitlines()[-1] == ("hvdrun: error: no rank printed for 1.5 s (--idle-timeout); "
                                                      "stopped all 2 workers")


def test_idle_timeout_leaves_a_chatty_job_alone(run_hvdrun, tmp_path):
    path = script(tmp_path, "chatty.py", """
        import time
        for i in range(12):
            print(i, flush=True)
            time.sleep(0.25)
    """)
    result = run_hvdrun("-np", "2", "--idle-timeout", "1.5", path)
    assert result.returncode == 0, result.stderr


def test_sigusr1_to_hvdrun_reaches_every_rank_and_the_job_goes_on(hvdrun_env, tmp_path):
    path = script(tmp_path, "usr1.py", WAITS_FOR_USR1)
    process = start_hvdrun(hvdrun_env, tmp_path, "-np", "3", path)
    out, err = signal_when_ready(process, 3, signal.SIGUSR1)
    assert process.returncode == 0, err
    assert sorted(line for line in out.splitlines() if "got" in line) == [
        f"[{r}]<stdout>:rank {r} got SIGUSR1" for r in range(3)]
    assert "hvdrun: passed SIGUSR1 to 3 running workers; the job goes on" in err


def test_forward_signals_chooses_the_set(hvdrun_env, tmp_path):
    path = script(tmp_path, "usr1.py", WAITS_FOR_USR1.replace("SIGUSR1", "SIGUSR2"))
    process = start_hvdrun(hvdrun_env, tmp_path, "-np", "2", "--forward-signals", "USR2", path)
    out, err = signal_when_ready(process, 2, signal.SIGUSR2)
    assert process.returncode == 0, err
    assert out.count("got SIGUSR2") == 2


def test_forward_signals_refuses_a_stop_signal(run_hvdrun, tmp_path):
    path = script(tmp_path, "hello.py", "print('hi')")
    result = run_hvdrun("-np", "1", "--forward-signals", "USR1,TERM", path)
    assert result.returncode == 2
    assert "SIGTERM stops the job" in result.stderr


def test_sigusr1_reaches_ranks_over_ssh(ssh_hosts, hvdrun_env, tmp_path):
    path = script(tmp_path, "usr1.py", WAITS_FOR_USR1)
    process = start_hvdrun(hvdrun_env, tmp_path, "-H", ssh_hosts.hosts(1), *ssh_hosts.args(), path)
    out, err = signal_when_ready(process, 2, signal.SIGUSR1)
    assert process.returncode == 0, err
    assert out.count("got SIGUSR1") == 2


def test_sigusr1_reaches_ranks_under_mpiexec(hvdrun_env, tmp_path):
    """MPICH's hydra would die of SIGUSR1: hvdrun passes it through the job's control connections."""
    in_runtime = WAITS_FOR_USR1.replace('print("ready"', 'from hvdrun import runtime\nruntime.init()\nprint("ready"')
    path = script(tmp_path, "usr1.py", in_runtime.replace("sys.exit(0 if got else 5)",
                                                          "runtime.shutdown()\nsys.exit(0 if got else 5)"))
    process = start_hvdrun(hvdrun_env, tmp_path, "-np", "2", "-H", "localhost:2", "--launcher", "mpiexec", path)
    out, err = signal_when_ready(process, 2, signal.SIGUSR1)
    assert process.returncode == 0, err
    assert out.count("got SIGUSR1") == 2
    assert "hvdrun: passed SIGUSR1 to 2 ranks through the job's control connections; the job goes on" in err



def test_a_signal_before_init_under_mpiexec_is_ignored_with_the_reason(hvdrun_env, tmp_path):
    """Before init() no control connection exists, and hydra cannot pass SIGUSR1: one line says why, in words."""
    path = script(tmp_path, "usr1.py", WAITS_FOR_USR1.replace("time.time() + 60", "time.time() + 3").replace(
        "sys.exit(0 if got else 5)", "sys.exit(0)"))
    process = start_hvdrun(hvdrun_env, tmp_path, "-np", "2", "-H", "localhost:2", "--launcher", "mpiexec", path)
    out, err = signal_when_ready(process, 2, signal.SIGUSR1)
    assert process.returncode == 0, err
    assert out.count("no signal") == 2
    assert ("hvdrun: warning: cannot pass SIGUSR1 to the ranks yet: their launcher does not pass signals, and rank "
            "0's control connections (which do) are up only once the ranks have called init()") in err
    assert "Launcher" not in err


def test_the_summary_of_a_failed_job_says_what_the_other_ranks_did(run_hvdrun, tmp_path):
    path = script(tmp_path, "fail4.py", """
        import os, sys, time
        rank = int(os.environ["HVDRUN_RANK"])
        if rank == 3:
            sys.exit(0)
        if rank == 1:
            time.sleep(1.5)
            print("rank 1 is about to fail", file=sys.stderr, flush=True)
            sys.exit(3)
        time.sleep(300)
    """)
    result = run_hvdrun("-np", "4", path)
    assert result.returncode == 3
    message = result.stderr.split("hvdrun: error: ", 1)[1].splitlines()
    assert message[0].startswith("rank 1 on host localhost exited with code 3")
    assert message[1:4] == ["other ranks:",
                            "    ranks 0,2 on localhost: stopped by hvdrun after the failure (were running)",
                            "    rank 3 on localhost: exited 0 before the failure"]
    assert message[4:] == ["last lines of rank 1 stderr:", "    rank 1 is about to fail"]


def test_the_summary_names_the_error_hvdrun_reported_on_the_failed_rank(run_hvdrun, tmp_path):
    path = script(tmp_path, "squat.py", """
        import os, socket
        from hvdrun import runtime
        if os.environ["HVDRUN_RANK"] == "0":  # another program takes the rendezvous port before rank 0 listens
            squatter = socket.create_server(("", int(os.environ["HVDRUN_RENDEZVOUS_PORT"])))
        runtime.init()
    """)
    result = run_hvdrun("-np", "2", path)
    assert result.returncode == 1
    message = result.stderr.split("hvdrun: error: ", 1)[1].splitlines()
    assert message[0].startswith("rank 0 on host localhost exited with code 1")
    assert message[1].startswith("rank 0's error: cannot listen on 127.0.0.1:"), message
    assert message[1].endswith("Address already in use; the port hvdrun chose was taken by another program "
                               "meanwhile: start the job again")
    assert message[2] == "other ranks:"


def test_a_failing_output_disk_keeps_the_console_whole(run_hvdrun, tmp_path):
    out = tmp_path / "out"
    for rank in range(2):  # every write to these files fails with ENOSPC, as on a full disk
        (out / f"rank.{rank}").mkdir(parents=True)
        (out / f"rank.{rank}" / "stdout").symlink_to("/dev/full")
    path = script(tmp_path, "burst.py", """
        for i in range(20000):
            print(f"line {i}")
    """)
    result = run_hvdrun("-np", "2", "--no-prefix", "--output-dir", str(out), path)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 40000 and result.stdout.count("line 19999\n") == 2
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "Traceback" not in result.stderr
    assert warnings[0].endswith(f"output to {out}: No space left on device; the console still gets it")


def test_an_endless_line_passes_in_pieces_with_bounded_memory(hvdrun_env, tmp_path):
    path = script(tmp_path, "endless.py", """
        import sys
        chunk = b"x" * (1 << 20)
        for _ in range(64):
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
    """)
    quiet = script(tmp_path, "quiet.py", "print('x')")

    def peak_rss_kib(program: str) -> int:  # hvdrun's peak (its ranks are small), read in a wrapper process
        wrapper = ("import resource, subprocess, sys; "
                   f"done = subprocess.run([sys.executable, '-m', 'hvdrun', '-np', '1', '--output-dir', 'out', "
                   f"{program!r}], stdout=subprocess.DEVNULL, timeout=120); "
                   "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        done = subprocess.run([sys.executable, "-c", wrapper], env=hvdrun_env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=150)
        code, peak = done.stdout.split()
        assert code == "0", done.stderr
        return int(peak)

    peak_kib = peak_rss_kib(path)
    assert (tmp_path / "out" / "rank.0" / "stdout").stat().st_size == 64 << 20  # every byte arrived
    growth_kib = peak_kib - peak_rss_kib(quiet)
    assert growth_kib < 64 << 10, f"hvdrun grew by {growth_kib} KiB for a 64 MiB line"


def test_a_rank_that_ends_without_init_ends_the_job_at_once(run_hvdrun, tmp_path):
    path = script(tmp_path, "skip_init.py", """
        import os, sys
        if os.environ["HVDRUN_RANK"] == "1":
            sys.exit(0)
        import hvdrun.torch as hvd
        hvd.init()
    """)
    result = run_hvdrun("-np", "2", "--start-timeout", "600", path, timeout=60)
    assert result.returncode == 1
    first = result.stderr.split("hvdrun: error: ", 1)[1].splitlines()[0]
    assert first.startswith("rank 1 on host localhost ended (exit code 0) without joining the job "
                            "(it never called init(); rank(s) 0 wait for it there)")


def test_a_rank_that_finishes_early_after_init_is_fine(run_hvdrun, tmp_path):
    path = script(tmp_path, "early.py", """
        import os, time
        import hvdrun.torch as hvd
        hvd.init()
        if hvd.rank() == 0:
            time.sleep(1.0)
        print("done", hvd.rank(), flush=True)
    """)
    result = run_hvdrun("-np", "2", path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("done") == 2


def test_ranks_without_hvdrun_runtime_finish_normally(run_hvdrun, tmp_path):
    path = script(tmp_path, "plain.py", """
        import os, time
        time.sleep(0.5 * int(os.environ["HVDRUN_RANK"]))
    """)
    assert run_hvdrun("-np", "3", path).returncode == 0
