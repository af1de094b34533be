"""Cluster YAML validation and the shipped cluster files."""

from __future__ import annotations

import pytest

from hvdrun.config import available_clusters, load_cluster, load_cluster_config, load_config
from hvdrun.errors import ConfigError, UsageError
from hvdrun.hosts import Host


def write(tmp_path, text):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def test_full_config(tmp_path):
    config = load_config(write(tmp_path, """
name: mini
launcher: local
gpus_per_node: 4
gpu_order: [3, 2, 1, 0]
gpus_per_rank: 2
hosts: ["n1:2", {name: n2, slots: 2, user: bob}]
env: {NCCL_DEBUG: INFO, OMP_NUM_THREADS: 4}
scheduler: {kind: slurm, queue: debug, walltime: 90, filesystems: [home]}
"""))
    assert config.name == "mini" and config.launcher == "local"
    assert config.gpu_order == ("3", "2", "1", "0") and config.gpus_per_rank == 2
    assert config.hosts == (Host("n1", 2), Host("n2", 2, "bob"))
    assert config.env == {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4"}
    assert config.scheduler.kind == "slurm" and config.scheduler.walltime == "90"
    assert config.scheduler.filesystems == ("home",)


@pytest.mark.parametrize("text, fragment", [
    ("gpus_per_nodes: 4\n", "unknown key 'gpus_per_nodes'; allowed keys: name, "),
    ("gpus_per_node: four\n", "'gpus_per_node' must be int, got a string 'four'"),
    ("gpus_per_node: true\n", "'gpus_per_node' must be int, got a boolean"),
    ("launcher: slurmrun\n", "'launcher' is 'slurmrun'; expected one of local, ssh, mpiexec"),
    ("scheduler: {kind: lsf}\n", "'scheduler.kind' is 'lsf'; expected one of pbs, cobalt, slurm"),
    ("scheduler: {nosuch: 1}\n", "unknown key 'scheduler.nosuch'"),
    ("scheduler: {queues: debug}\n", "'scheduler.queues' must be dict, got a string 'debug'"),
    ("scheduler: {queues: {debug: {max_nodes: 2, colour: red}}}\n", "unknown key 'scheduler.queues.debug.colour'"),
    ("scheduler: {queues: {debug: {max_walltime: soon}}}\n", "walltime 'soon' is not minutes"),
    ("scheduler: {walltime: '0'}\n", "walltime '0' must be longer than zero"),
    ("scheduler: {max_walltime: later}\n", "scheduler.max_walltime: walltime 'later' is not minutes"),
    ("scheduler: {queues: {prod: {routes: {tiny: {max_nodes: 2, colour: red}}}}}\n",
     "unknown key 'scheduler.queues.prod.routes.tiny.colour'"),
    ("scheduler: {queues: {prod: {routes: {tiny: {max_walltime: soon}}}}}\n",
     "scheduler.queues.prod.routes.tiny.max_walltime: walltime 'soon'"),
    ("scheduler: {required: [colour]}\n", "scheduler.required lists 'colour'; allowed: account, walltime"),
    ("gpus_per_node: 4\ngpu_order: [0, 1]\n", "gpu_order lists 2 GPUs but gpus_per_node is 4"),
    ("hosts: ['n1']\n", "hosts\\[0\\]: 'n1' is not host:slots"),
    ("hosts: [{name: n1, slots: 0}]\n", "'hosts\\[0\\].slots' must be a positive integer"),
    ("env: {1BAD: x}\n", "env key '1BAD' is not a valid variable name"),
    ("- a\n- b\n", "'top level' must be a mapping, got a list"),
    ("gpu_vendor: matrox\n", "'gpu_vendor' is 'matrox'; expected one of nvidia, intel, amd"),
    ("gpus_per_node: 4\ntiles_per_gpu: 2\n", "tiles_per_gpu is 2 but gpu_vendor is 'nvidia'"),
    ("gpu_vendor: intel\ngpus_per_node: 3\ntiles_per_gpu: 2\n", "gpus_per_node 3 counts tiles and must be a "
                                                                  "multiple of tiles_per_gpu 2"),
    ("name: [unclosed\n", "not valid YAML"),
])
def test_errors_name_file_and_key(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=fragment) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_invalid_yaml_is_one_line_naming_where_it_broke(tmp_path):
    path = write(tmp_path, "hosts:\n  - name: n1\nname: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}:4:1: not valid YAML: expected ',' or ']', but got '<stream end>' "
                               "(while parsing a flow sequence that starts at 3:7)")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read cluster config"):
        load_config(tmp_path / "none.yaml")


def test_every_shipped_cluster_loads():
    names = available_clusters()
    assert {"localhost", "polaris", "aurora", "sophia", "thetagpu-cobalt", "slurm"} <= set(names)
    for name in names:
        assert load_cluster(name).name == name


def test_polaris_lists_gpus_reversed():
    config = load_cluster("polaris")
    assert config.gpu_order == ("3", "2", "1", "0") and config.scheduler.kind == "pbs"


def test_unknown_cluster_lists_the_available_ones():
    with pytest.raises(ConfigError, match="unknown cluster 'frontier'; available: aurora, localhost"):
        load_cluster("frontier")


def test_cluster_or_config_file_but_not_both(tmp_path):
    assert load_cluster_config(None, None) is None
    assert load_cluster_config("localhost", None) == load_cluster("localhost")
    path = write(tmp_path, "name: mine\n")
    assert load_cluster_config(None, str(path)).name == "mine"
    with pytest.raises(UsageError, match="give either --cluster NAME or --config FILE, not both"):
        load_cluster_config("localhost", str(path))
