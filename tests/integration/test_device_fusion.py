"""The device path's fusion with real ranks (CPU tensors through it, gloo in NCCL's place): fused results equal
ones worked out without communication, one collective a fused buffer (counted by a counting process group), a
rank killed during fused ops, and bad input on the device path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
WORKERS = Path(__file__).parent / "workers"
DEVICE_PATH_ON_CPU = {"HVDRUN_DEVICE_BACKEND": "gloo", "HVDRUN_CPU_VIA_DEVICE_BACKEND": "1"}
THRESHOLD = 64 << 10  # small enough that the optimizer's float64 gradients take three buckets


@pytest.mark.parametrize("size", [2, 4])
def test_fused_device_ops_equal_their_unfused_results_with_one_collective_a_buffer(run_hvdrun, hvdrun_env, size):
    hvdrun_env.update({**DEVICE_PATH_ON_CPU, "HOROVOD_FUSION_THRESHOLD": str(THRESHOLD)})
    result = run_hvdrun("-np", str(size), str(WORKERS / "device_fusion.py"), str(THRESHOLD), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    checks = re.findall(r"CHECK (\S+) rank (\d+): (.*)", result.stdout)
    failed = [check for check in checks if check[2] != "ok"]
    assert not failed, failed
    names = {name for name, _, _ in checks}
    assert len(checks) == len(names) * size - size // 2, sorted(names)  # the process set check: even ranks only
    counts = {(name, int(rank)): int(n) for name, rank, n in re.findall(r"COUNT (\S+) rank (\d+): (\d+)",
                                                                        result.stdout)}
    # the optimizer's 40 gradients (2 dtypes): 4 buckets during backward, 1 (fp16) ; 2 flattened at step(), 1 (fp16)
    assert counts[("optimizer.overlap1.NoneCompressor.passes1", 0)] == 4
    assert counts[("optimizer.overlap1.FP16Compressor.passes2", 0)] == 1
    assert counts[("optimizer.overlap0.NoneCompressor.passes1", 0)] == 2
    assert counts[("broadcast-parameters", 0)] == 1


def test_a_rank_killed_during_fused_device_ops_ends_with_the_error_on_every_rank(spawn_ranks):
    procs = spawn_ranks(str(WORKERS / "killed_peer.py"), 3, args=("1", "1000", "20", "grouped"), env=DEVICE_PATH_ON_CPU)
    outputs = {rank: proc.communicate(timeout=90) for rank, proc in procs.items()}
    assert procs[1].returncode == -9
    for rank in (0, 2):
        stdout, stderr = outputs[rank]
        assert procs[rank].returncode == 0, stderr[-2000:]
        raised = re.search(r"raised after ([\d.]+) s", stdout)
        assert raised and float(raised.group(1)) < 60, stdout  # a bound against hanging, not a timing claim
        assert "rank 1" in stdout, stdout


def test_mixed_devices_end_in_one_error_on_every_rank_and_the_next_op_works(run_hvdrun):
    result = run_hvdrun("-np", "2", str(WORKERS / "device_mismatch.py"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    checks = re.findall(r"CHECK (\S+) rank (\d+): (.*)", result.stdout)
    assert len(checks) == 12 and all(verdict == "ok" for _, _, verdict in checks), checks


def test_a_process_sets_device_op_first_in_the_job_then_a_global_one(run_hvdrun, hvdrun_env):
    hvdrun_env.update(DEVICE_PATH_ON_CPU)
    result = run_hvdrun("-np", "3", str(WORKERS / "device_set_first.py"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("set bf16 [3.0, 3.0, 3.0, 3.0, 3.0]") == 2, result.stdout
    assert result.stdout.count("global [3.0, 3.0]") == 3, result.stdout
