"""What a Horovod user types: horovodrun's options, its config file, scripts with no change, horovod.run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.integration.test_local_launch import script

pytestmark = pytest.mark.integration
WORKERS = Path(__file__).parent / "workers"

SETTINGS = """
import json, os
import hvdrun.torch as hvd
hvd.init()
names = ["HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY", "HOROVOD_STALL_CHECK_DISABLE",
         "HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_LOG_LEVEL",
         "HOROVOD_TIMELINE_MARK_CYCLES", "HVDRUN_BACKEND"]
print("SETTINGS " + json.dumps({"env": {n: os.environ.get(n) for n in names}, "size": hvd.size(),
      "mpi": hvd.mpi_enabled(), "gloo": hvd.gloo_enabled()}), flush=True)
hvd.shutdown()
"""


def settings(stdout: str) -> list[dict]:
    return [json.loads(line.split("SETTINGS ", 1)[1]) for line in stdout.splitlines() if "SETTINGS " in line]


def test_tuning_options_reach_the_workers_and_win_over_the_config_file(run_hvdrun, tmp_path):
    program = script(tmp_path, "settings.py", SETTINGS)
    (tmp_path / "horovod.yaml").write_text(
        "params: {fusion_threshold_mb: 8, cycle_time_ms: 7, cache_capacity: 0, hierarchical_allreduce: false}\n"
        "stall_check: {enabled: false, warning_time_seconds: 9}\nlogging: {level: debug}\n"
        "timeline: {mark_cycles: true}\nautotune: {enabled: false}\n")
    done = run_hvdrun("-np", "2", "--config-file", "horovod.yaml", "--cycle-time-ms", "2.5",
                      "--stall-check-shutdown-time-seconds", "30", "--log-level", "error", program)
    assert done.returncode == 0, done.stderr
    (first, second) = settings(done.stdout)
    assert first == second and first["size"] == 2 and first["gloo"] and not first["mpi"]
    assert first["env"] == {"HOROVOD_FUSION_THRESHOLD": str(8 << 20), "HOROVOD_CYCLE_TIME": "2.5",
                            "HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_STALL_CHECK_DISABLE": "1",
                            "HOROVOD_STALL_CHECK_TIME_SECONDS": "9", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30",
                            "HOROVOD_LOG_LEVEL": "ERROR", "HOROVOD_TIMELINE_MARK_CYCLES": "1",
                            "HVDRUN_BACKEND": None}


def test_mpi_and_gloo_choose_the_controller(run_hvdrun, tmp_path):
    program = script(tmp_path, "settings.py", SETTINGS)
    mpi = run_hvdrun("-np", "2", "--mpi", program)
    assert mpi.returncode == 0, mpi.stderr
    assert [(s["size"], s["mpi"], s["gloo"], s["env"]["HVDRUN_BACKEND"]) for s in settings(mpi.stdout)] == \
        [(2, True, False, "mpi")] * 2
    gloo = run_hvdrun("-np", "2", "--gloo", program)
    assert gloo.returncode == 0, gloo.stderr
    assert [(s["mpi"], s["gloo"]) for s in settings(gloo.stdout)] == [(False, True)] * 2


def test_no_stall_check_silences_the_warning_and_the_shutdown(run_hvdrun, tmp_path):
    program = script(tmp_path, "slow.py", """
        import time, torch
        import hvdrun.torch as hvd
        hvd.init()
        if hvd.rank() == 1:
            time.sleep(2.5)
        print("sum", hvd.allreduce(torch.ones(1), op=hvd.Sum, name="slow").item(), flush=True)
    """)
    args = ("-np", "2", "--stall-check-warning-time-seconds", "0.5", "--stall-check-shutdown-time-seconds", "1.5")
    checked = run_hvdrun(*args, program)
    assert checked.returncode == 1 and "stalled" in checked.stdout + checked.stderr
    silent = run_hvdrun(*args, "--no-stall-check", program)
    assert silent.returncode == 0, silent.stderr
    assert "warning" not in silent.stderr and silent.stdout.count("sum 2.0") == 2


def test_prefix_timestamp(run_hvdrun, tmp_path):
    program = script(tmp_path, "hi.py", "print('hi', flush=True)\n")
    done = run_hvdrun("-np", "2", "--prefix-timestamp", program)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(re.match(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} \[\d\]<stdout>:hi$", line)
                                   for line in lines), lines


def test_an_unchanged_horovod_script_runs_with_horovod_compat(run_hvdrun, tmp_path):
    source = (WORKERS / "horovod_script.py").read_text()
    assert "import horovod.torch as hvd" in source
    untouched = tmp_path / "train.py"
    untouched.write_text(source)
    done = run_hvdrun("-np", "2", "--horovod-compat", str(untouched), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[0]<stdout>:rank 0 done" in done.stdout and "[1]<stdout>:rank 1 done" in done.stdout
    without = run_hvdrun("-np", "2", str(untouched))
    assert without.returncode == 1 and "No module named 'horovod'" in without.stderr


def test_hvdrun_run_returns_every_rank_result(tmp_path):
    program = script(tmp_path, "driver.py", """
        import sys
        import hvdrun
        from hvdrun.errors import WorkerFailed

        def work(scale, offset=0):
            import torch
            import hvdrun.torch as hvd
            hvd.init()
            print("working", hvd.rank(), flush=True)
            return hvd.rank() * scale + offset + hvd.allreduce(torch.ones(1), op=hvd.Sum).item()

        print("RESULTS", hvdrun.run(work, args=(10,), kwargs={"offset": 1}, np=2))
        print("LAMBDAS", hvdrun.run(lambda: {"rank": __import__("os").environ["RANK"]}, num_proc=3))
        try:
            hvdrun.run(lambda: sys.exit(3), np=2)
        except WorkerFailed as e:
            print("FAILED", e.exit_code)
    """)
    done = subprocess.run([sys.executable, program], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULTS [3.0, 13.0]" in done.stdout
    assert "LAMBDAS [{'rank': '0'}, {'rank': '1'}, {'rank': '2'}]" in done.stdout
    assert "[0]<stdout>:working 0" in done.stdout and "[1]<stdout>:working 1" in done.stdout
    assert "FAILED 3" in done.stdout and "\x1ehvdrun:result:" not in done.stdout
