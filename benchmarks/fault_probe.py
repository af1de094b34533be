"""The faults of issue #57, one at a time, as a user meets them: for each, how long hvdrun took to end, the line it
ended with, and what of the job was left running after it.

    python benchmarks/fault_probe.py                 # the hvdrun this interpreter imports
    PYTHONPATH=/path/to/other/checkout python benchmarks/fault_probe.py --cap 40   # another version, same machine

Real processes throughout (hvdrun, its fork server, guards and ranks); a fault that never ends is stopped at
``--cap`` seconds and reported as such. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

MARK = "HVDRUN_FAULT_PROBE"


@dataclass
class Outcome:
    """One fault's row."""

    fault: str
    seconds: float | None  # None: still running at the cap
    code: int | None
    line: str
    left: int  # processes of the job alive 1 s after hvdrun ended


def leftovers(token: str) -> int:
    count = 0
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARK) == token:
                count += 1
        except psutil.Error:
            continue
    return count


def kill_leftovers(token: str) -> None:
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARK) == token:
                proc.kill()
        except psutil.Error:
            continue


class Probe:
    """Runs one hvdrun command per fault in a scratch folder."""

    def __init__(self, folder: Path, cap_s: float) -> None:
        self.folder, self.cap_s = folder, cap_s

    def script(self, name: str, body: str) -> str:
        path = self.folder / name
        path.write_text(textwrap.dedent(body))
        return str(path)

    def run(self, fault: str, args: list[str], act: Callable[[subprocess.Popen[bytes]], None] = lambda p: None,
            env: dict[str, str] | None = None, read_output: bool = True, pre: list[str] | None = None) -> Outcome:
        token = uuid.uuid4().hex
        environ = {**os.environ, MARK: token, **(env or {})}
        started = time.monotonic()
        proc = subprocess.Popen([*(pre or []), sys.executable, "-m", "hvdrun", *args], env=environ, cwd=self.folder,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        act(proc)
        out = b""
        try:
            if read_output:
                out, err = proc.communicate(timeout=self.cap_s)
            else:  # stdout is a pipe nobody reads
                proc.wait(timeout=self.cap_s)
                err = proc.stderr.read() if proc.stderr else b""
            seconds: float | None = time.monotonic() - started
        except subprocess.TimeoutExpired:
            proc.kill()
            seconds = None
        time.sleep(1.0)
        left = leftovers(token)
        kill_leftovers(token)  # before reading the rest: a leftover may hold hvdrun's pipes open
        if seconds is None:
            out, err = proc.communicate()
        lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
        said = [line for line in out.decode(errors="replace").splitlines() if "did not raise" in line]
        return Outcome(fault, seconds, proc.returncode if seconds is not None else None,
                       "; ".join(said) or _headline(lines), left)


def _headline(lines: list[str]) -> str:
    """The line a user reads first: hvdrun's error, else its warning, else the first; with the tracebacks counted."""
    said = [line for line in lines if line.lstrip("[]0123456789<>stder:").startswith("hvdrun: error:")]
    said = said or [line for line in lines if "hvdrun: warning:" in line]
    traceback = sum("Traceback" in line for line in lines)
    text = (said or lines or [""])[0][:160]
    return f"{text} (+{traceback} traceback(s))" if traceback else text


def signal_after(seconds: float, signum: int) -> Callable[[subprocess.Popen[bytes]], None]:
    def act(proc: subprocess.Popen[bytes]) -> None:
        time.sleep(seconds)
        proc.send_signal(signum)
    return act


def sigquit_until_the_end(proc: subprocess.Popen[bytes]) -> None:
    time.sleep(0.3)
    while proc.poll() is None:
        try:
            proc.send_signal(signal.SIGQUIT)
        except ProcessLookupError:
            break
        time.sleep(0.05)


def duplicate_names(probe: Probe) -> Outcome:
    worker = probe.script("duplicate.py", """
        import torch
        import hvdrun.torch as hvd
        hvd.init()
        rank, missed = hvd.rank(), 0
        for _ in range(50):
            for turn in (0, 1):
                if (rank == 0) == (turn == 0):
                    hvd.allreduce_async(torch.zeros(17, 17, 17), name="duplicate_name")
                    try:
                        hvd.allreduce_async(torch.zeros(17, 17, 17), name="duplicate_name")
                        missed += 1
                    except ValueError:
                        pass
                hvd.barrier()
        print(f"rank {rank}: {missed} of 50 second submissions did not raise", flush=True)
    """)
    return probe.run("duplicate name, Horovod's shape x50", ["-np", "2", sys.executable, worker])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=40.0, help="stop a fault that has not ended after this long")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        probe = Probe(Path(scratch), options.cap)
        probe.script("stuckmod.py", "import time\ntime.sleep(600)\n")
        hello = probe.script("hello.py", "print('ran')\n")
        torch_job = probe.script("torch_job.py", "import torch\nimport time\ntime.sleep(30)\n")
        short = probe.script("short.py", "import time\ntime.sleep(1.5)\n")
        flood = probe.script("flood.py", """
            import os, sys
            if os.environ["RANK"] == "1":
                for i in range(200000):
                    print(f"line {i} of rank 1")
                sys.exit(7)
            while True:
                print("rank 0 floods " * 5)
        """)
        no_init = probe.script("no_init.py", """
            import os, time
            import hvdrun.torch as hvd
            if os.environ["RANK"] == "0":
                time.sleep(60)
            hvd.init()
        """)
        barrier = probe.script("barrier.py", "import hvdrun.torch as hvd\nhvd.init()\nhvd.barrier()\n")
        preload_env = {"PYTHONPATH": os.pathsep.join([scratch, os.environ.get("PYTHONPATH", "")])}
        jobs = Path(scratch) / "jobs"
        (jobs / "running").mkdir(parents=True)
        jobs.chmod(0)
        no_dac = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
                  "--inh-caps=-dac_override,-dac_read_search"]
        rows = [duplicate_names(probe),
                probe.run("preload import hangs, --start-timeout 5",
                          ["-np", "2", "--preload", "stuckmod", "--start-timeout", "5", hello], env=preload_env),
                probe.run("SIGINT 1.5 s into a hanging preload", ["-np", "2", "--preload", "stuckmod", hello],
                          signal_after(1.5, signal.SIGINT), env=preload_env),
                probe.run("200,000 lines then exit 7, console unread",
                          ["-np", "2", "--output-dir", str(Path(scratch) / "logs"), flood], read_output=False)]
        for delay in (0.1, 0.3, 0.5, 0.8):
            rows.append(probe.run(f"SIGTERM at +{delay} s, default preload", ["-np", "2", torch_job],
                                  signal_after(delay, signal.SIGTERM)))
        rows += [probe.run("SIGQUIT every 50 ms until the end", ["-np", "2", short], sigquit_until_the_end),
                 probe.run("--report /proc/r.html", ["-np", "2", "--report", "/proc/r.html", hello]),
                 probe.run("--timeline-filename /proc/t.json", ["-np", "2", "--timeline-filename", "/proc/t.json",
                                                                barrier]),
                 probe.run("rank 0 never calls init()", ["-np", "2", "--start-timeout", "3", no_init]),
                 probe.run("unreadable jobs folder: hvdrun stacks", ["stacks"], env={"HVDRUN_JOBS_DIR": str(jobs)},
                           pre=no_dac),
                 probe.run("--metrics-port 0.0.0.0:0", ["-np", "1", "--metrics-port", "0.0.0.0:0", hello])]
        jobs.chmod(0o700)
    print("| fault | ended after | exit code | line | left 1 s after |")
    print("|---|---|---|---|---|")
    for row in rows:
        ended = f"{row.seconds:.2f} s" if row.seconds is not None else f"not by {options.cap:g} s (killed)"
        print(f"| {row.fault} | {ended} | {row.code} | {row.line.replace('|', '/')} | {row.left} |")


if __name__ == "__main__":
    main()
