"""The launcher -> worker environment contract."""

from __future__ import annotations

import pytest

from hvdrun import envvars
from hvdrun.errors import UsageError
from hvdrun.hosts import Host
from hvdrun.ranks import GpuLayout, assign_slots

RDV = envvars.Rendezvous(addr="10.0.0.1", port=1234, master_port=1235, secret="s3cr3t", job_id="ab12")


def test_every_rank_gets_hvdrun_horovod_and_torchrun_names():
    slots = assign_slots([Host("a", 2), Host("b", 2)], 4, GpuLayout(2, ("1", "0")))
    env = envvars.worker_env(slots[3], RDV)
    assert env["HVDRUN_RANK"] == env["HOROVOD_RANK"] == env["RANK"] == "3"
    assert env["HVDRUN_SIZE"] == env["HOROVOD_SIZE"] == env["WORLD_SIZE"] == "4"
    assert env["HVDRUN_LOCAL_RANK"] == env["HOROVOD_LOCAL_RANK"] == env["LOCAL_RANK"] == "1"
    assert env["HVDRUN_LOCAL_SIZE"] == env["HOROVOD_LOCAL_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
    assert env["HVDRUN_CROSS_RANK"] == env["HOROVOD_CROSS_RANK"] == "1"
    assert env["HVDRUN_CROSS_SIZE"] == env["HOROVOD_CROSS_SIZE"] == "2"
    assert env["GROUP_RANK"] == "1"
    assert env["HVDRUN_HOSTNAME"] == env["HOROVOD_HOSTNAME"] == "b"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "1235")
    assert (env["HVDRUN_RENDEZVOUS_ADDR"], env["HVDRUN_RENDEZVOUS_PORT"]) == ("10.0.0.1", "1234")
    assert env["HVDRUN_SECRET"] == "s3cr3t" and env["HVDRUN_JOB_ID"] == "ab12"
    assert env["CUDA_VISIBLE_DEVICES"] == "1,0" and env["HVDRUN_DEVICE_ORDINAL"] == "1"  # device 1 of 1,0: GPU 0


def test_no_gpus_leaves_cuda_visible_devices_alone():
    slot = assign_slots([Host("a", 1)], 1)[0]
    assert "CUDA_VISIBLE_DEVICES" not in envvars.worker_env(slot, RDV)


def test_aurora_tiles_are_flat_devices_every_rank_sees_with_its_own_at_its_local_rank():
    layout = GpuLayout(12, vendor="intel", tiles_per_gpu=2)
    envs = [envvars.worker_env(slot, RDV) for slot in assign_slots([Host("x1", 12)], 12, layout)]
    assert {env["ZE_AFFINITY_MASK"] for env in envs} == {",".join(map(str, range(12)))}
    assert {env["ZE_FLAT_DEVICE_HIERARCHY"] for env in envs} == {"FLAT"}
    assert [env["HVDRUN_DEVICE_ORDINAL"] for env in envs] == [str(local) for local in range(12)]
    assert not any("CUDA_VISIBLE_DEVICES" in env or "ROCR_VISIBLE_DEVICES" in env for env in envs)


def test_strict_visibility_shows_each_aurora_rank_only_its_tile():
    layout = GpuLayout(12, vendor="intel", tiles_per_gpu=2, visibility="rank")
    envs = [envvars.worker_env(slot, RDV) for slot in assign_slots([Host("x1", 12)], 12, layout)]
    assert [env["ZE_AFFINITY_MASK"] for env in envs] == [str(local) for local in range(12)]
    assert {env["HVDRUN_DEVICE_ORDINAL"] for env in envs} == {"0"}


def test_intel_gpus_without_tiles_are_whole_devices():
    env = envvars.worker_env(assign_slots([Host("a", 2)], 2, GpuLayout(4, vendor="intel", gpus_per_rank=2))[1], RDV)
    assert env["ZE_AFFINITY_MASK"] == "0,1,2,3" and "ZE_FLAT_DEVICE_HIERARCHY" not in env
    assert env["HVDRUN_DEVICE_ORDINAL"] == "2"  # its GPUs 2,3 are devices 2 and 3


def test_amd_gpus_are_pinned_with_rocr_and_hip_indexes_within_what_rocr_left():
    slots = assign_slots([Host("f1", 4)], 4, GpuLayout(8, vendor="amd", gpus_per_rank=2))
    env = envvars.worker_env(slots[3], RDV)
    assert env["ROCR_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and env["HVDRUN_DEVICE_ORDINAL"] == "6"
    assert env["HIP_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"  # overrides an inherited


def test_forwarded_env():
    assert envvars.forwarded_env(["A", "B=2", "C="], {"A": "1"}) == {"A": "1", "B": "2", "C": ""}


@pytest.mark.parametrize("spec, fragment", [
    ("MISSING", "MISSING is not set in hvdrun's environment"),
    ("1X=2", "'1X' is not a valid environment variable name"),
    ("A B=1", "'A B' is not a valid"),
])
def test_forwarded_env_errors(spec, fragment):
    with pytest.raises(UsageError, match=fragment):
        envvars.forwarded_env([spec], {})


def test_omp_threads_split_between_local_ranks_unless_set():
    slots = assign_slots([Host("a", 4)], 4)
    assert envvars.thread_env(slots[0], 8, {}) == {"OMP_NUM_THREADS": "2"}
    assert envvars.thread_env(slots[0], 2, {}) == {"OMP_NUM_THREADS": "1"}
    assert envvars.thread_env(slots[0], 8, {"OMP_NUM_THREADS": "3"}) == {}


def test_the_frontier_like_config_gives_each_rank_the_gcd_next_to_its_cores():
    from hvdrun.config import load_cluster
    from hvdrun.launch.remote.cpubind import parse_cpu_bind

    config = load_cluster("slurm-amd")
    layout = GpuLayout(config.gpus_per_node, config.gpu_order, config.gpus_per_rank, config.gpu_vendor)
    envs = [envvars.worker_env(slot, RDV) for slot in assign_slots([Host("f1", 8)], 8, layout)]
    assert {env["ROCR_VISIBLE_DEVICES"] for env in envs} == {"0,1,2,3,4,5,6,7"}  # which GCDs, in index order
    assert {env["HIP_VISIBLE_DEVICES"] for env in envs} == {"4,5,2,3,6,7,0,1"}  # their order: GCD 4 is device 0
    assert parse_cpu_bind(config.cpu_bind or "").lists[0] == set(range(1, 8))  # next to GCD 4 (OLCF's map)


@pytest.mark.parametrize(("policy", "host_ranks", "cores", "spins"),
                         [("auto", 2, 2, True), ("auto", 3, 2, False), ("active", 8, 2, True),
                          ("passive", 1, 64, False)])
def test_the_wait_policy_decides_whether_waits_spin(policy, host_ranks, cores, spins):
    from hvdrun.runtime.transport.channels import DEFAULT_SPIN_S, spin_seconds

    envvars.check_tuning({"HVDRUN_WAIT_POLICY": policy})
    assert spin_seconds(policy, host_ranks, cores) == (DEFAULT_SPIN_S if spins else 0.0)


def test_a_wait_policy_that_is_not_one_is_a_usage_error_and_any_case_is_one():
    with pytest.raises(UsageError, match="HVDRUN_WAIT_POLICY='spin'; expected one of auto, active, passive"):
        envvars.check_tuning({"HVDRUN_WAIT_POLICY": "spin"})
    envvars.check_tuning({"HVDRUN_WAIT_POLICY": "PASSIVE"})  # as OMP_WAIT_POLICY
    assert envvars.wait_policy({"HVDRUN_WAIT_POLICY": "Active"}) == "active" and envvars.wait_policy({}) == "auto"
