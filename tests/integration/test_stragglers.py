"""Stragglers named from the negotiation, with no change to the script: a rank that sleeps 30 ms before each step
(and the ranks of one slow host) named within 50 steps; an even job under CPU burners names no one."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.integration.test_scheduler_jobs import WORKERS

STRAGGLER = str(WORKERS / "straggler.py")


def verdicts(stderr: str) -> list[str]:
    return re.findall(r"^\[0\]<stderr>:(hvdrun: straggler: .*)$", stderr, re.M)


def test_a_rank_that_sleeps_before_each_step_is_named_within_50_steps(run_hvdrun):
    done = run_hvdrun("-np", "4", STRAGGLER, "3", "50")
    assert done.returncode == 0, done.stderr
    said = verdicts(done.stderr)
    assert len(said) == 1, done.stderr
    assert re.fullmatch(r"hvdrun: straggler: rank 3 on localhost arrived last at \d+% of the last \d+ collectives, "
                        r"\d+ ms after the median; the other 3 ranks spent \d+% of their time waiting for it",
                        said[0]), said


def test_the_slow_ranks_of_one_host_name_the_host(run_hvdrun, ssh_hosts):
    done = run_hvdrun("-np", "4", "-H", ssh_hosts.hosts(2), *ssh_hosts.args(), STRAGGLER, "2,3", "60", timeout=120)
    assert done.returncode == 0, done.stderr
    said = verdicts(done.stderr)
    slow_host = ssh_hosts.addrs[1]
    assert len(said) == 1 and re.match(rf"hvdrun: straggler: (host {re.escape(slow_host)} \(its ranks\)|rank [23] "
                                       rf"on {re.escape(slow_host)}) arrived last", said[0]), done.stderr


def test_an_even_job_under_two_cpu_burners_names_no_one(run_hvdrun, tmp_path: Path):
    """The burners run at the lowest priority: they take every idle moment of the job's ranks without starving the
    suite's other workers, whose timing-sensitive tests (a 2 s SSH handshake) they made fail at full priority."""
    burners = [subprocess.Popen(["nice", "-n", "19", "sh", "-c", "while :; do :; done"]) for _ in range(2)]
    try:
        for _ in range(2):
            done = run_hvdrun("-np", "4", STRAGGLER, "none", "120")
            assert done.returncode == 0, done.stderr
            assert verdicts(done.stderr) == [], done.stderr
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
