"""The device path's benchmarks run as a user runs them (tiny sizes; no timing asserted): the training table
against DDP with both overlap settings and the collectives a step, and gpu.py's three libraries in one job."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_training_on_the_device_path_counts_one_collective_a_bucket():
    out = run("training.py", "--device-path", "--model", "many-small", "--steps", "4", "--warmup", "1", "--rounds",
              "2", "--batch-size", "4")
    rows = re.findall(r"\| many-small \| device \(gloo stand-in\) \| (on|off) \| 2 \| 4 \| [\d.]+ ms \| [\d.]+ ms "
                      r"\| [\d.]+x \| ([\d.]+) \|", out)
    counted = {overlap: float(count) for overlap, count in rows}
    # 1.6 MB of float32: a 1 MiB bucket and the rest, 2 collectives a step (1 in a step whose two buckets were ready
    # in the same cycle: fused, as a loaded machine sees now and then); one without overlap; 202 without buckets
    assert set(counted) == {"on", "off"} and 1.0 <= counted["on"] <= 2.0 and counted["off"] == 1.0, out


def test_gpu_benchmark_without_a_gpu_times_the_three_libraries_in_one_job():
    out = run("gpu.py", "--cpu", "--ranks", "2", "--sizes", "4K", "--rounds", "1")
    assert re.search(r"\| 2 \| 4 KB \| [\d,.]+ µs \| [\d,.]+ µs \| [\d,.]+ µs \| [\d.]+x \| [\d.]+x \|", out), out
