"""The GPU idioms of unchanged scripts, run under hvdrun on every shipped GPU layout (no GPU needed).

Each rank runs a one-line script that reports what its runtime would be shown (the vendor's variables)
and what each idiom reads; each vendor's visibility rule (tests/gpu_visibility.py) then says which device
the idiom makes current, and it must be the rank's own, the one the cluster's affinity order gives its local
rank (Polaris: local rank 0 on GPU 3). PALS clusters go through the FAKE PALS mpiexec (tests/fakes), which
sets ``PALS_LOCAL_RANKID`` as PALS does; the others through hvdrun's local launcher.
"""

from __future__ import annotations

import json
import sys

import pytest

from hvdrun.config import load_cluster
from tests.conftest import REPO
from tests.gpu_visibility import IDIOMS, node_devices, own_device, reached

FAKE_PALS = REPO / "tests" / "fakes" / "fake_pals_mpiexec.py"
NAMES = ("HOROVOD_LOCAL_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PALS_LOCAL_RANKID", "CUDA_VISIBLE_DEVICES",
         "ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
         "HVDRUN_DEVICE_ORDINAL")
SHOW = f"import json, os; print('ENV ' + json.dumps({{n: os.environ[n] for n in {NAMES!r} if n in os.environ}}))"
DEVICE_NAMES = ("CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY", "ROCR_VISIBLE_DEVICES",
                "HIP_VISIBLE_DEVICES", "PALS_LOCAL_RANKID")


def rank_envs(stdout: str) -> list[dict[str, str]]:
    envs = [json.loads(line.split("ENV ", 1)[1]) for line in stdout.splitlines() if "ENV " in line]
    return sorted(envs, key=lambda env: int(env["LOCAL_RANK"]))


@pytest.mark.parametrize("cluster", ["polaris", "sophia", "slurm-amd", "aurora", "thetagpu-cobalt"])
def test_every_idiom_reaches_the_ranks_own_gpu(cluster, run_hvdrun, hvdrun_env, tmp_path):
    config = load_cluster(cluster)
    for name in DEVICE_NAMES:  # a node as the job finds it: nothing chosen yet
        hvdrun_env.pop(name, None)
    pals = config.mpi_flavour == "pals"
    if pals:
        hvdrun_env["HVDRUN_MPIEXEC"] = str(FAKE_PALS)
    gpus = config.gpus_per_node
    launch = [] if pals else ["--launcher", "local", "--cpu-bind", "none"]
    done = run_hvdrun("--cluster", cluster, "-H", f"localhost:{gpus}", "-np", str(gpus), *launch, "--",
                      sys.executable, "-c", SHOW)
    assert done.returncode == 0, done.stderr
    envs = rank_envs(done.stdout)
    assert len(envs) == gpus, done.stdout
    order = config.gpu_order or tuple(str(i) for i in range(gpus))
    node = node_devices(config.gpu_vendor, gpus)
    idioms = [idiom for idiom in IDIOMS if pals or "PALS" not in idiom]
    for local, env in enumerate(envs):
        want = own_device(config.gpu_vendor, order[local], config.tiles_per_gpu)
        got = {idiom: reached(idiom, config.gpu_vendor, env, node, config.tiles_per_gpu) for idiom in idioms}
        assert got == dict.fromkeys(idioms, want), (local, env)


def test_strict_visibility_shows_each_rank_only_its_own_gpu(run_hvdrun, hvdrun_env):
    for name in DEVICE_NAMES:
        hvdrun_env.pop(name, None)
    done = run_hvdrun("--cluster", "sophia", "-H", "localhost:4", "-np", "4", "--launcher", "local",
                      "--gpu-visibility", "rank", "--", sys.executable, "-c", SHOW)
    assert done.returncode == 0, done.stderr
    assert [(e["CUDA_VISIBLE_DEVICES"], e["HVDRUN_DEVICE_ORDINAL"]) for e in rank_envs(done.stdout)] == [
        ("0", "0"), ("1", "0"), ("2", "0"), ("3", "0")]


def test_the_jobs_own_gpus_are_shared_in_the_clusters_order(run_hvdrun, hvdrun_env):
    """Sophia's by-gpu queue (or Slurm --gpus) gave the job GPUs 5 and 2: its two ranks see them in the node's
    order (2,5), and take one each; a third rank has none."""
    for name in DEVICE_NAMES:
        hvdrun_env.pop(name, None)
    hvdrun_env["CUDA_VISIBLE_DEVICES"] = "5,2"
    done = run_hvdrun("--cluster", "sophia", "-H", "localhost:2", "-np", "2", "--launcher", "local", "--",
                      sys.executable, "-c", SHOW)
    assert done.returncode == 0, done.stderr
    envs = rank_envs(done.stdout)
    assert [(e["CUDA_VISIBLE_DEVICES"], e["HVDRUN_DEVICE_ORDINAL"]) for e in envs] == [("2,5", "0"), ("2,5", "1")]
    three = run_hvdrun("--cluster", "sophia", "-H", "localhost:3", "-np", "3", "--launcher", "local", "--",
                       sys.executable, "-c", SHOW)
    assert three.returncode == 2
    assert three.stderr.strip().splitlines() == [
        "hvdrun: error: host 'localhost' has 2 GPUs (the job was given CUDA_VISIBLE_DEVICES=5,2) but local rank 2 "
        "needs GPUs 2..2 (1 per rank); lower -np or the slots of that host, or --gpus-per-rank"]
