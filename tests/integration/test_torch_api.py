"""hvdrun.torch's training API with real processes: DistributedOptimizer, broadcasts, examples."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
WORKERS = Path(__file__).parent / "workers"


@pytest.mark.parametrize("size", [1, 2, 3])
def test_distributed_optimizer_equals_full_batch_training(run_hvdrun, tmp_path, size):
    result = run_hvdrun("-np", str(size), str(WORKERS / "optimizer.py"), str(tmp_path), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(map(int, re.findall(r"rank (\d+): optimizer ok", result.stdout))) == set(range(size))
    for label in ("sgd plain", "adam accumulate x3", "sgd groups=2", "adam predivide 2"):
        differences = [float(d) for d in re.findall(rf"{label}: max \|diff\| (\S+)", result.stdout)]
        assert len(differences) == size and max(differences) < 1e-9, (label, differences)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_linear_regression_example_matches_single_process_descent(run_hvdrun):
    result = run_hvdrun("-np", "2", str(EXAMPLES / "linear_regression.py"), "--check", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    coefficients = re.findall(r"coefficients=\[([^\]]+)\]", result.stdout)
    assert len(coefficients) == 2 and coefficients[0] == coefficients[1]
    assert [round(float(c)) for c in coefficients[0].split(",")] == [5, 3, 2, 1]
    differences = [float(d) for d in re.findall(r"single process\| = (\S+)", result.stdout)]
    assert len(differences) == 2 and max(differences) < 1e-12


@pytest.mark.parametrize("size", [2, 3])
def test_gradients_through_every_collective(run_hvdrun, size):
    result = run_hvdrun("-np", str(size), str(WORKERS / "autograd.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(map(int, re.findall(r"rank (\d+): autograd ok", result.stdout))) == set(range(size))
