"""Seeing a running job (issue #35): ``hvdrun top``, the metrics (Prometheus' format and JSON lines) and the job
report, on a 4-rank training loop whose rank 3 sleeps 30 ms before each step.

``hvdrun top`` on the other launchers (SSH hosts, mpiexec) is checked on the job of ``test_stacks.py``; the report
of a job stopped by ``--idle-timeout`` (with its stacks report) there too.
"""

from __future__ import annotations

import contextlib
import html
import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, unavailable, wait_until

WORKER = str(REPO / "tests" / "integration" / "workers" / "steady.py")


def chromium_check(page: Path, tmp_path: Path) -> tuple[dict[str, str], list[str]]:
    """Open ``page`` in headless Chromium: the attributes of its ``<body>`` after its script ran, and the console
    messages (a script error among them)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        unavailable("no chromium on this machine (apt install chromium; make system-deps installs it)")
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'c'}",
                           "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    body = re.search(r"<body([^>]*)>", done.stdout)
    assert body, done.stdout[:2000]
    return dict(re.findall(r'([\w-]+)="([^"]*)"', body.group(1))), re.findall(r"CONSOLE.*", done.stderr)


def test_the_chromium_check_sees_a_script_error(tmp_path):
    """The check below can fail: a page whose script throws is caught, and its plots are not counted as drawn."""
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body><svg class="plot"></svg><script>'
                    "document.body.setAttribute('data-plots', 1); no_such_function();</script></body></html>")
    attributes, console = chromium_check(page, tmp_path)
    assert attributes.get("data-plots") == "1" and "data-drawn" not in attributes
    assert any("no_such_function" in line for line in console), console


class Job:
    """hvdrun running the steady loop in the background, its output in files."""

    def __init__(self, tmp_path: Path, env: dict[str, str], args: list[str]) -> None:
        self.tmp_path, self.env = tmp_path, env
        self.release = tmp_path / "release"
        self._out, self._err = (tmp_path / "out.txt").open("wb"), (tmp_path / "err.txt").open("wb")
        self.process = subprocess.Popen([sys.executable, "-m", "hvdrun", *args], env=env, cwd=tmp_path,
                                        stdout=self._out, stderr=self._err)

    def stdout(self) -> str:
        return (self.tmp_path / "out.txt").read_text()

    def stderr(self) -> str:
        return (self.tmp_path / "err.txt").read_text()

    def hvdrun(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hvdrun", *args], env=self.env, capture_output=True, text=True,
                              timeout=60)

    def finish(self) -> int:
        self.release.touch()
        try:
            return self.process.wait(60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(10)
            self._out.close()
            self._err.close()


@pytest.fixture
def steady_job(hvdrun_env, tmp_path):
    env = {**hvdrun_env, "HVDRUN_JOBS_DIR": str(tmp_path / "jobs")}
    started: list[Job] = []

    def start(*args: str) -> Job:
        job = Job(tmp_path, env, list(args))
        started.append(job)
        return job

    yield start
    for job in started:
        if job.process.poll() is None:
            job.finish()


def scrape(url: str) -> dict[str, dict[str, float]]:
    """The metrics page, parsed by prometheus_client's own parser: sample name -> rank -> value."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values.setdefault(sample.name, {})[sample.labels.get("rank", "")] = sample.value
    return values


def test_top_metrics_and_report_of_a_job_with_a_straggler(steady_job, tmp_path):
    report, lines = tmp_path / "job.html", tmp_path / "metrics.jsonl"
    job = steady_job("-np", "4", "--metrics-port", "127.0.0.1:0", "--metrics-file", str(lines),
                     "--metrics-interval", "0.5", "--report", str(report), WORKER, "3", str(tmp_path / "release"),
                     "none")
    assert wait_until(lambda: job.stdout().count("ready") == 4, 90), job.stderr()
    url = re.search(r"hvdrun: metrics of job \w+ at (http://127\.0\.0\.1:\d+/metrics)", job.stderr()).group(1)
    # the metrics page: every rank, and rank 3 flagged once the straggler window is full
    metrics: dict[str, dict[str, float]] = {}

    def rank_3_flagged() -> bool:
        metrics.clear()
        metrics.update(scrape(url))
        return metrics.get("hvdrun_rank_straggler") == {"0": 0.0, "1": 0.0, "2": 0.0, "3": 1.0}

    assert wait_until(rank_3_flagged, 30), metrics
    assert metrics["hvdrun_job_ranks"][""] == 4 and metrics["hvdrun_job_ranks_reporting"][""] == 4
    assert sorted(metrics["hvdrun_rank_collectives_total"]) == ["0", "1", "2", "3"]
    # a step: one optimizer step, its gradients' allreduce(s) and the vote to stop (a sample may fall between them)
    steps, collectives = metrics["hvdrun_rank_optimizer_steps_total"], metrics["hvdrun_rank_collectives_total"]
    assert all(steps[rank] >= 20 and 2 * steps[rank] - 1 <= collectives[rank] <= 3 * steps[rank] + 2
               for rank in steps), metrics
    assert metrics["hvdrun_rank_wait_share"]["0"] > metrics["hvdrun_rank_wait_share"]["3"], metrics
    # hvdrun top, as JSON and as text
    views: list[dict] = []

    def top_flags_rank_3() -> bool:
        shown = job.hvdrun("top", "--once", "--json", "--interval", "0.5")
        assert shown.returncode == 0, shown.stderr
        views.append(json.loads(shown.stdout))
        return [row["rank"] for row in views[-1]["ranks"] if row["straggler"]] == [3]

    assert wait_until(top_flags_rank_3, 30), views[-1]
    view = views[-1]
    assert view["schema"] == "hvdrun-top/1" and view["size"] == 4 and not view["folded"]
    ranks = {row["rank"]: row for row in view["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3] and [r for r, row in ranks.items() if row["straggler"]] == [3]
    assert all(row["steps_per_s"] > 1 and row["collectives_per_s"] > 2 and row["rss"] > 0 for row in ranks.values())
    assert ranks[0]["wait_share"] > ranks[3]["wait_share"] and ranks[3]["last_share"] > 0.75, ranks
    [host] = view["hosts"]
    assert host["host"] == "localhost" and host["ranks"] == [0, 1, 2, 3] and host["stragglers"] == [3]
    assert view["stragglers"]["said"] and "straggler: rank 3 on localhost" in view["stragglers"]["said"][-1][1]
    text = job.hvdrun("top", "--once", "--interval", "0.3").stdout
    assert re.search(r"^\s+3 localhost .*<< straggler$", text, re.M), text
    assert job.finish() == 0, job.stderr()
    # the metrics file: one line per sample, every rank in each
    samples = [json.loads(line) for line in lines.read_text().splitlines()]
    assert len(samples) >= 2 and all(len(sample["ranks"]) == 4 for sample in samples)
    # the report: drawn without a script error, the straggler in its table
    assert f"hvdrun: report of job {view['job_id']}: {report}" in job.stderr()
    attributes, console = chromium_check(report, tmp_path)
    console = [line for line in console if report.name in line]  # the page's own messages, not the browser's
    assert console == [] and int(attributes["data-plots"]) == 3 == int(attributes["data-drawn"]), (attributes, console)
    page = report.read_text()
    assert f"hvdrun job {view['job_id']}: succeeded" in page
    assert re.search(r"<tr><td>3</td><td>localhost</td><td>\d+%</td><td>[\d.]+</td><td>yes</td></tr>", page)
    assert "straggler: rank 3 on localhost arrived last" in page


def test_the_report_of_a_failed_job_names_the_failure(steady_job, tmp_path):
    report = tmp_path / "failed.html"
    job = steady_job("-np", "2", "--metrics-interval", "0.2", "--report", str(report), WORKER, "none",
                     str(tmp_path / "release"), "1:30")
    assert job.process.wait(60) == 3, job.stderr()
    page = report.read_text()
    assert ": failed</title>" in page and "exit code 3" in page
    failure = page.split("<h2>Failure</h2><pre>", 1)[1]
    assert failure.startswith("rank 1 on host localhost exited with code 3") and "failing on purpose" in failure
    assert "<h2>Start-up per host</h2>" in page and "<td>localhost</td>" in page


def test_a_metrics_port_in_use_is_a_usage_error_before_any_rank_starts(run_hvdrun, tmp_path):
    with __import__("socket").socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_hvdrun("-np", "2", "--metrics-port", f"127.0.0.1:{port}", "python", "-c", "print('ran')")
    assert done.returncode == 2 and "ran" not in done.stdout, done.stdout
    assert done.stderr.strip().startswith(f"hvdrun: error: --metrics-port: cannot serve metrics on 127.0.0.1:{port}:")
    bad = run_hvdrun("-np", "2", "--metrics-port", "localhost:http", "true")
    assert bad.returncode == 2 and "expected PORT or ADDR:PORT" in bad.stderr, bad.stderr
    elastic = run_hvdrun("-np", "2", "--min-np", "1", "--max-np", "2", "--report", "r.html", "true")
    assert elastic.returncode == 2 and "an elastic job" in elastic.stderr, elastic.stderr


def test_a_metrics_page_open_to_the_network_is_said_in_a_warning(run_hvdrun):
    """The page has no authentication (as prometheus_client serves it): 0.0.0.0 served it without a word."""
    opened = run_hvdrun("-np", "1", "--metrics-port", "0.0.0.0:0", "python", "-c", "print('ran')")
    assert opened.returncode == 0, opened.stderr
    assert "hvdrun: warning: --metrics-port 0.0.0.0:0 serves the page to the network without authentication" in \
        opened.stderr
    local = run_hvdrun("-np", "1", "--metrics-port", "127.0.0.1:0", "python", "-c", "print('ran')")
    assert local.returncode == 0 and "warning" not in local.stderr, local.stderr


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs filled to the last block (root only: the suite's machines run it as root)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        with open(mount / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
            while True:
                filler.write(b"\0" * 4096)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("option", ["--report", "--metrics-file", "--timeline-filename"])
def test_a_file_written_at_the_end_is_checked_before_anything_starts(run_hvdrun, full_disk, option):
    """An unwritable place (``/proc``, which even root cannot write) or a full disk: found at the job's end before
    (after hours of training), and the timeline's ended in a 15-line atexit traceback on rank 0."""
    for place, why in ((Path("/proc/job.out"), "cannot write in /proc"), (full_disk / "job.out", "")):
        done = run_hvdrun("-np", "2", option, str(place), "python", "-c", "print('ran')")
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(f"hvdrun: error: {option} {place}: {why}") and "ran" not in done.stdout
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_timeline_the_rank_cannot_write_is_one_warning_line(run_hvdrun, hvdrun_env):
    """Set for the ranks directly (no launcher check): rank 0 said so in a 15-line atexit traceback."""
    hvdrun_env["HOROVOD_TIMELINE"] = "/proc/timeline.json"
    done = run_hvdrun("-np", "2", sys.executable, "-c", "import hvdrun.torch as hvd; hvd.init(); hvd.barrier()")
    assert done.returncode == 0, done.stderr
    assert "[0]<stderr>:hvdrun: warning: the timeline could not be written to /proc/timeline.json: No such file " \
           "or directory" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_job_that_cannot_reach_a_host_still_gets_its_report(run_hvdrun, tmp_path):
    done = run_hvdrun("-np", "2", "-H", "localhost:1,nosuchhost.invalid:1", "--report", "unreached.html", "true")
    assert done.returncode == 1 and "cannot resolve host name 'nosuchhost.invalid'" in done.stderr, done.stderr
    page = html.unescape((tmp_path / "unreached.html").read_text())
    assert ": failed</title>" in page and "<td>1</td><td>nosuchhost.invalid</td><td>0</td>" in page
    assert "cannot resolve host name 'nosuchhost.invalid'" in page.split("<h2>Failure</h2>")[1]
