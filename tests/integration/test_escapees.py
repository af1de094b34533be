"""A rank's grandchild that leaves its process group (setsid), clears its environment (env -i) and holds
the rank's stdout open is stopped with the rank, named, and does not keep hvdrun waiting."""

from __future__ import annotations

import io
import os
import subprocess

import psutil
import pytest

from hvdrun.launch.output import OutputRouter
from hvdrun.launch.remote.escapees import Containment, command_of
from tests.conftest import wait_until
from tests.integration.test_local_launch import script

pytestmark = pytest.mark.integration

ESCAPE = """
import subprocess, sys, time
child = subprocess.Popen(["setsid", "sh", "-c", "exec env -i sleep {marker}"])  # inherits stdout and stderr
while open(f"/proc/{{child.pid}}/cmdline", "rb").read().split(b"\\0")[0] != b"sleep":
    time.sleep(0.01)  # past setsid and its exec: before that it is still in the rank's group (a loaded machine)
print("spawned", flush=True)
"""


def sleepers(marker: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", marker]]


def test_an_escaped_grandchild_is_stopped_named_and_not_waited_for(run_hvdrun, tmp_path):
    marker = "300.25"  # a sleep no other test starts
    done = run_hvdrun("-np", "1", script(tmp_path, "escape.py", ESCAPE.format(marker=marker)), timeout=15)
    try:
        assert done.returncode == 0, done.stderr
        assert "spawned" in done.stdout
        assert wait_until(lambda: not sleepers(marker), 5.0), "the escaped sleep survived the job"
        assert "left the rank's process group (setsid); stopped: pid " in done.stderr, done.stderr
        assert f"(sleep {marker})" in done.stderr
    finally:
        for process in sleepers(marker):
            process.kill()


def test_without_a_cgroup_the_guard_reaps_escapees_as_subreaper(tmp_path, monkeypatch):
    monkeypatch.setattr("hvdrun.launch.remote.escapees._make_cgroup", lambda label: None)
    hold = Containment("t")
    assert hold.cgroup is None and hold.subreaper
    child = subprocess.Popen(["sh", "-c", "setsid sh -c 'exec env -i sleep 300.5' & exit 0"])
    child.wait()
    # reparented to this process, and past its exec (before it, its command line is still setsid's); another
    # test's process that ends meanwhile may be reparented here too (this pytest worker is now a subreaper)
    assert wait_until(lambda: [command_of(pid) for pid in hold.escapees(child.pid)].count("sleep 300.5") == 1, 15.0)
    named = hold.stop(group=-1)
    assert sum(name.endswith("(sleep 300.5)") for name in named) == 1, named
    hold.close()
    assert wait_until(lambda: not sleepers("300.5"), 5.0)


def test_output_held_open_is_waited_for_a_bounded_time_with_a_warning():
    err = io.BytesIO()
    console = {"stdout": io.TextIOWrapper(io.BytesIO()), "stderr": io.TextIOWrapper(err, write_through=True)}
    router = OutputRouter(1, console=console)
    read_end, write_end = os.pipe()
    router.attach(0, "stdout", read_end)
    try:
        router.drain(0.2)  # write_end stays open, as a process that outlived the rank would hold it
        assert b"not waiting for output still held open 0.2 s after the ranks ended" in err.getvalue()
        assert b"0-stdout" in err.getvalue()
    finally:
        os.close(write_end)
