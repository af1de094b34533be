"""--cpu-bind: which cores each local rank gets (hvdrun/launch/remote/cpubind.py)."""

from __future__ import annotations

import pytest

from hvdrun.launch.remote.cpubind import (
    CpuBind,
    CpuBindError,
    cores_for,
    format_cpulist,
    numa_nodes,
    numa_of,
    parse_cpu_bind,
    parse_cpulist,
)

TWO_SOCKETS = {0: frozenset(range(0, 8)), 1: frozenset(range(8, 16))}


def test_core_lists_read_and_write_like_taskset():
    assert parse_cpulist("0-3,8") == {0, 1, 2, 3, 8}
    assert format_cpulist({8, 0, 1, 2, 3, 10, 11}) == "0-3,8,10-11"
    for bad in ("", "a", "3-1", "1,,2"):
        with pytest.raises(CpuBindError):
            parse_cpulist(bad)


@pytest.mark.parametrize("text, fragment", [
    ("sockets", "expected none, cores, numa, depth:D or list:A-B:C-D"),
    ("list:", "expected none, cores, numa, depth:D or list:"),
    ("depth:0", "depth:D takes a positive number of CPUs per rank"),
    ("depth:eight", "depth:D takes a positive number"),
    ("list:0-3:x", "'x' is not a core list"),
])
def test_bad_policies_say_what_is_expected(text, fragment):
    with pytest.raises(CpuBindError, match=fragment):
        parse_cpu_bind(text)


def test_cores_gives_each_local_rank_an_equal_disjoint_share_within_numa_nodes():
    shares = [cores_for(CpuBind("cores"), rank, 4, set(range(16)), TWO_SOCKETS) for rank in range(4)]
    assert shares == [frozenset(range(i * 4, i * 4 + 4)) for i in range(4)]
    assert [numa_of(share, TWO_SOCKETS) for share in shares] == ["0", "0", "1", "1"]


def test_cores_uses_only_the_cores_allowed_to_the_job():
    allowed = {2, 3, 5, 9, 12, 13}
    shares = [cores_for(CpuBind("cores"), rank, 3, allowed, TWO_SOCKETS) for rank in range(3)]
    assert shares == [{2, 3}, {5, 9}, {12, 13}]
    with pytest.raises(CpuBindError, match="7 ranks on this host but only 6 cores are allowed"):
        cores_for(CpuBind("cores"), 0, 7, allowed, TWO_SOCKETS)


def test_cores_keeps_hardware_threads_together_polaris_style():
    siblings = {cpu: frozenset({cpu % 32, cpu % 32 + 32}) for cpu in range(64)}  # 32 cores x 2 threads, 1 node
    shares = [cores_for(CpuBind("cores"), rank, 4, set(range(64)), {0: frozenset(range(64))}, siblings)
              for rank in range(4)]
    assert [format_cpulist(share) for share in shares] == ["0-7,32-39", "8-15,40-47", "16-23,48-55", "24-31,56-63"]


def test_depth_gives_each_local_rank_its_block_of_cpus_as_pals_does():
    bind = parse_cpu_bind("depth:8")
    assert [cores_for(bind, rank, 4, set(range(64)), {}) for rank in range(4)] == [
        frozenset(range(8 * rank, 8 * rank + 8)) for rank in range(4)]
    with pytest.raises(CpuBindError, match="depth:8: local rank 1 gets cores 8-15, but 8-15 are not allowed here"):
        cores_for(bind, 1, 2, set(range(8)), {})


def test_numa_spreads_ranks_over_the_nodes_and_none_keeps_everything():
    assert [cores_for(CpuBind("numa"), rank, 4, set(range(16)), TWO_SOCKETS) for rank in range(4)] == [
        TWO_SOCKETS[0], TWO_SOCKETS[0], TWO_SOCKETS[1], TWO_SOCKETS[1]]
    assert cores_for(CpuBind("none"), 1, 4, {1, 2}, TWO_SOCKETS) == {1, 2}
    assert cores_for(CpuBind("cores"), 1, 2, {0, 1}, {}) == {1}  # no NUMA facts: one node


def test_list_gives_the_local_ranks_list_and_refuses_what_does_not_fit():
    bind = parse_cpu_bind("list:1-8:9-16:17-24")
    assert cores_for(bind, 1, 3, set(range(32)), {}) == set(range(9, 17))
    with pytest.raises(CpuBindError, match="gives 3 core lists for 4 ranks"):
        cores_for(bind, 0, 4, set(range(32)), {})
    with pytest.raises(CpuBindError, match="local rank 2 gets cores 17-24, but 17-24 are not allowed here"):
        cores_for(bind, 2, 3, set(range(16)), {})


def test_numa_nodes_are_read_from_sys(tmp_path):
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    (tmp_path / "node2").mkdir()  # a memory-only node: no cpulist
    assert numa_nodes(tmp_path) == {0: frozenset(range(4)), 1: frozenset(range(4, 8))}


def test_cores_follow_each_ranks_gpu_to_its_numa_node_where_sys_tells():
    gpu_nodes = [1, 1, 0, 0]  # local ranks 0 and 1 have GPUs on node 1, ranks 2 and 3 on node 0
    shares = [cores_for(CpuBind("cores"), rank, 4, set(range(16)), TWO_SOCKETS, None, gpu_nodes) for rank in range(4)]
    assert [format_cpulist(share) for share in shares] == ["8-11", "12-15", "0-3", "4-7"]
    three_on_one_node = [0, 0, 0, 1]
    shares = [cores_for(CpuBind("cores"), r, 4, set(range(16)), TWO_SOCKETS, None, three_on_one_node) for r in range(4)]
    assert [format_cpulist(share) for share in shares] == ["0-1", "2-3", "4-5", "8-15"]
    unknown = [0, -1, 1, 1]  # one GPU's node unknown: the plain split in NUMA order
    assert cores_for(CpuBind("cores"), 1, 4, set(range(16)), TWO_SOCKETS, None, unknown) == set(range(4, 8))
