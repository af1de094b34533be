"""The GPU contract: on a pinned node the idioms of unchanged scripts land each rank on its own GPU.

Each vendor's visibility rule (tests/gpu_visibility.py) is applied to the environment hvdrun gives the ranks.
"""

from __future__ import annotations

import types

import pytest

from hvdrun import envvars
from hvdrun.config import parse_config
from hvdrun.errors import ConfigError, UsageError
from hvdrun.hosts import Host
from hvdrun.launch.plan import RunOptions, plan_job
from hvdrun.ranks import GpuLayout, assign_slots
from hvdrun.runtime.device import own_device_ordinal, select_current_device
from tests.gpu_visibility import IDIOMS, SHIPPED_LAYOUTS, idiom_table, reached

RDV = envvars.Rendezvous("10.0.0.1", 1234, 1235, "s3cr3t", "ab12")


@pytest.mark.parametrize("cluster", SHIPPED_LAYOUTS)
def test_every_idiom_lands_every_rank_of_a_shipped_layout_on_its_own_gpu(cluster):
    row = idiom_table()[cluster]
    assert all(cell.startswith("all ") or cell.startswith("n/a") for cell in row.values()), row


def test_strict_visibility_leaves_the_idioms_on_the_wrong_device_so_the_rule_can_fail():
    """The rule sees a broken contract: with each rank shown only its own GPU, set_device(local_rank) is invalid."""
    slots = assign_slots([Host("x1", 4)], 4, GpuLayout(4, ("3", "2", "1", "0"), visibility="rank"))
    env = envvars.worker_env(slots[1], RDV)
    assert env["CUDA_VISIBLE_DEVICES"] == "2" and env["HVDRUN_DEVICE_ORDINAL"] == "0"
    for idiom in list(IDIOMS)[:3]:
        assert isinstance(reached(idiom, "nvidia", env, ["0", "1", "2", "3"]), str)


def test_polaris_local_rank_0_sees_gpu_3_first():
    slots = assign_slots([Host("x1", 4)], 4, GpuLayout(4, ("3", "2", "1", "0")))
    assert [(s.devices, s.visible_devices, s.device_ordinal) for s in slots[:2]] == [
        (("3",), ("3", "2", "1", "0"), 0), (("2",), ("3", "2", "1", "0"), 1)]


def test_two_gpus_a_rank_start_at_local_rank_times_two():
    slots = assign_slots([Host("x1", 2)], 2, GpuLayout(4, gpus_per_rank=2))
    assert [(s.devices, s.device_ordinal) for s in slots] == [(("0", "1"), 0), (("2", "3"), 2)]
    env = envvars.worker_env(slots[1], RDV)
    assert reached("device_count() // local_world_size", "nvidia", env, ["0", "1", "2", "3"]) == {"2"}


def ranks_env(environ, **options):
    plan = plan_job(RunOptions(command=("true",), **options), {"PATH": "/usr/bin:/bin", **environ})
    return [envvars.worker_env(slot, RDV) for slot in plan.slots]


def test_devices_the_scheduler_gave_the_job_are_what_the_ranks_share():
    """PBS by-gpu on Sophia, or Slurm --gpus: CUDA_VISIBLE_DEVICES=2,5 in the job; two ranks see 2,5."""
    envs = ranks_env({"CUDA_VISIBLE_DEVICES": "2,5"}, cluster="sophia", launcher="local", num_proc=2)
    assert [(e["CUDA_VISIBLE_DEVICES"], e["HVDRUN_DEVICE_ORDINAL"]) for e in envs] == [("2,5", "0"), ("2,5", "1")]
    one = ranks_env({"CUDA_VISIBLE_DEVICES": "2,5"}, gpus_per_node=1, hosts="localhost:1")
    assert [e["CUDA_VISIBLE_DEVICES"] for e in one] == ["2"]  # --gpus-per-node 1: the first the job was given
    with pytest.raises(UsageError, match=r"^--gpus-per-node 8, but the job was given 2 GPUs \(CUDA_VISIBLE_DEVICES"):
        ranks_env({"CUDA_VISIBLE_DEVICES": "2,5"}, gpus_per_node=8, num_proc=2)


def test_the_launchers_own_gpus_say_nothing_of_other_hosts():
    """-H other hosts: this machine's CUDA_VISIBLE_DEVICES (a login node's, a laptop's) is not theirs."""
    envs = ranks_env({"CUDA_VISIBLE_DEVICES": "0"}, gpus_per_node=4, hosts="node1:4", launcher="ssh")
    assert [(e["CUDA_VISIBLE_DEVICES"], e["HVDRUN_DEVICE_ORDINAL"]) for e in envs][:2] == [
        ("0,1,2,3", "0"), ("0,1,2,3", "1")]


def test_an_inherited_ordinal_does_not_reach_ranks_given_no_gpu():
    plan = plan_job(RunOptions(command=("true",), num_proc=1), {"PATH": "/usr/bin:/bin", "HVDRUN_DEVICE_ORDINAL": "3"})
    assert "HVDRUN_DEVICE_ORDINAL" not in plan.base_env


def test_the_cluster_order_is_kept_within_the_given_devices():
    layout = GpuLayout(4, ("3", "2", "1", "0")).within(("CUDA_VISIBLE_DEVICES", ("1", "3")))
    assert (layout.order(), layout.gpus_per_node) == (("3", "1"), 2)


def test_more_ranks_than_the_given_devices_name_where_the_devices_came_from():
    layout = GpuLayout(8).within(("CUDA_VISIBLE_DEVICES", ("2", "5")))
    with pytest.raises(UsageError, match=r"host 'x1' has 2 GPUs \(the job was given CUDA_VISIBLE_DEVICES=2,5\)"):
        assign_slots([Host("x1", 3)], 3, layout)


def test_slurm_without_gpus_is_no_restriction():
    assert envvars.job_devices("nvidia", {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}) is None
    assert envvars.job_devices("nvidia", {"CUDA_VISIBLE_DEVICES": ""}) is None
    assert envvars.job_devices("amd", {"ROCR_VISIBLE_DEVICES": "0,1"}) == ("ROCR_VISIBLE_DEVICES", ("0", "1"))


def test_gpu_bind_launcher_means_rank_visibility_and_refuses_node():
    assert parse_config({"gpus_per_node": 4, "gpu_bind": "launcher"}, "x.yaml").gpu_visibility == "rank"
    assert parse_config({"gpus_per_node": 4}, "x.yaml").gpu_visibility == "node"
    with pytest.raises(ConfigError, match="x.yaml: gpu_bind: launcher .* gpu_visibility: rank"):
        parse_config({"gpus_per_node": 4, "gpu_bind": "launcher", "gpu_visibility": "node"}, "x.yaml")
    with pytest.raises(ConfigError, match="gpu_visibility"):
        parse_config({"gpus_per_node": 4, "gpu_visibility": "host"}, "x.yaml")


@pytest.mark.parametrize("environ, local_rank, count, expected", [
    ({"HVDRUN_DEVICE_ORDINAL": "2"}, 2, 4, 2),  # hvdrun's launcher chose it
    ({"HVDRUN_DEVICE_ORDINAL": "0"}, 3, 1, 0),  # strict visibility: its one device
    ({"HVDRUN_DEVICE_ORDINAL": "5"}, 1, 2, None),  # the script changed what it sees: leave it alone
    ({}, 3, 4, 3),  # mpiexec / srun without hvdrun: local rank among the node's devices
    ({}, 3, 1, 0),  # ... where the site pinned one device a rank
    ({}, 0, 0, None),  # no device
    ({"HVDRUN_RANK": "3"}, 3, 4, None),  # hvdrun gave out no GPUs: CUDA is left alone (no context on any GPU)
])
def test_own_device_ordinal(environ, local_rank, count, expected):
    assert own_device_ordinal(environ, local_rank, count) == expected


class _Runtime:
    """A stand-in for ``torch.cuda``/``torch.xpu`` at the boundary this CPU machine cannot reach (no GPU)."""

    def __init__(self, count: int, initialized: bool = False) -> None:
        self.count, self.initialized, self.chosen = count, initialized, None

    def is_available(self) -> bool:
        return self.count > 0

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return self.count

    def set_device(self, ordinal: int) -> None:
        self.chosen, self.initialized = ordinal, True


def test_init_makes_the_ranks_own_gpu_current_unless_the_script_chose_one(monkeypatch):
    cuda, xpu = _Runtime(4), _Runtime(0)
    monkeypatch.setitem(__import__("sys").modules, "torch", types.SimpleNamespace(cuda=cuda, xpu=xpu))
    assert select_current_device({"HVDRUN_DEVICE_ORDINAL": "1"}, 1) == "cuda:1" and cuda.chosen == 1
    chosen_by_script = _Runtime(4, initialized=True)
    monkeypatch.setitem(__import__("sys").modules, "torch", types.SimpleNamespace(cuda=chosen_by_script, xpu=xpu))
    assert select_current_device({"HVDRUN_DEVICE_ORDINAL": "1"}, 1) is None and chosen_by_script.chosen is None
    tiles = _Runtime(12)
    monkeypatch.setitem(__import__("sys").modules, "torch", types.SimpleNamespace(cuda=_Runtime(0), xpu=tiles))
    assert select_current_device({}, 7) == "xpu:7" and tiles.chosen == 7


def test_gpu_tile_ids_are_shown_as_flat_devices_under_node_visibility():
    """An Aurora YAML of the composite era (gpu_order 0.0, 0.1, ...): every rank still lands on its own tile."""
    order = tuple(f"{gpu}.{tile}" for gpu in range(6) for tile in range(2))
    layout = GpuLayout(12, order, vendor="intel", tiles_per_gpu=2)
    envs = [envvars.worker_env(slot, RDV) for slot in assign_slots([Host("x1", 12)], 12, layout)]
    assert {(e["ZE_AFFINITY_MASK"], e["ZE_FLAT_DEVICE_HIERARCHY"]) for e in envs} == {
        (",".join(map(str, range(12))), "FLAT")}
    node = [str(i) for i in range(12)]
    assert [reached("set_device(LOCAL_RANK)", "intel", e, node, 2) for e in envs] == [{str(i)} for i in range(12)]
    strict = assign_slots([Host("x1", 12)], 12, GpuLayout(12, order, vendor="intel", tiles_per_gpu=2,
                                                            visibility="rank"))
    assert envvars.worker_env(strict[3], RDV)["ZE_AFFINITY_MASK"] == "1.1"  # its tile alone, COMPOSITE


def test_an_intel_order_level_zero_cannot_show_needs_rank_visibility():
    with pytest.raises(UsageError, match="Level Zero shows the devices of a mask in index order"):
        assign_slots([Host("x1", 2)], 2, GpuLayout(2, ("1", "0"), vendor="intel"))
    assert assign_slots([Host("x1", 2)], 2, GpuLayout(2, ("1", "0"), vendor="intel", visibility="rank"))[0].devices \
        == ("1",)


def test_amd_rocr_lists_which_gpus_and_hip_their_order():
    slots = assign_slots([Host("f1", 4)], 4, GpuLayout(4, ("3", "1", "2", "0"), vendor="amd"))
    env = envvars.worker_env(slots[0], RDV)
    assert (env["ROCR_VISIBLE_DEVICES"], env["HIP_VISIBLE_DEVICES"]) == ("0,1,2,3", "3,1,2,0")
    assert reached("set_device(LOCAL_RANK)", "amd", env, ["0", "1", "2", "3"]) == {"3"}
