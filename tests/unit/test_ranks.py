"""Rank assignment and GPU pinning (pure)."""

from __future__ import annotations

import pytest

from hvdrun.errors import UsageError
from hvdrun.hosts import Host
from hvdrun.ranks import GpuLayout, assign_slots


def table(slots):
    return [(s.rank, s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots]


def test_horovod_example_a2_b4():
    slots = assign_slots([Host("a", 2), Host("b", 4)], 6)
    assert table(slots) == [
        (0, "a", 0, 2, 0, 2), (1, "a", 1, 2, 0, 2),
        (2, "b", 0, 4, 1, 2), (3, "b", 1, 4, 1, 2), (4, "b", 2, 4, 0, 1), (5, "b", 3, 4, 0, 1),
    ]
    assert all(s.size == 6 for s in slots)


def test_np_smaller_than_slots_never_starts_more():
    slots = assign_slots([Host("a", 4), Host("b", 4)], 5)
    assert table(slots) == [
        (0, "a", 0, 4, 0, 2), (1, "a", 1, 4, 0, 1), (2, "a", 2, 4, 0, 1), (3, "a", 3, 4, 0, 1),
        (4, "b", 0, 1, 1, 2),
    ]
    assert [s.host_index for s in slots] == [0, 0, 0, 0, 1]


def test_unused_hosts_are_left_out():
    slots = assign_slots([Host("a", 2), Host("b", 2), Host("c", 2)], 2)
    assert {s.hostname for s in slots} == {"a"}
    assert all(s.cross_size == 1 for s in slots)


def test_uneven_hosts():
    slots = assign_slots([Host("a", 1), Host("b", 3), Host("c", 2)], 6)
    assert [(s.hostname, s.local_rank, s.cross_rank, s.cross_size) for s in slots] == [
        ("a", 0, 0, 3), ("b", 0, 1, 3), ("b", 1, 0, 2), ("b", 2, 0, 1), ("c", 0, 2, 3), ("c", 1, 1, 2),
    ]


@pytest.mark.parametrize("num_proc, fragment", [(7, "-np 7 is more than the 6 slots"), (0, "at least 1")])
def test_bad_np(num_proc, fragment):
    with pytest.raises(UsageError, match=fragment):
        assign_slots([Host("a", 2), Host("b", 4)], num_proc)


@pytest.mark.parametrize("hosts, fix", [
    ([Host("a", 2), Host("b", 4)], "e.g. -H a:4,b:4 or --ranks-per-node 4"),  # every host kept, not -H a:7
    ([Host("a", 2)], "e.g. -H a:7 or --ranks-per-node 7"),
    ([Host(f"n{i}", 1) for i in range(5)], "e.g. --ranks-per-node 2"),
])
def test_np_over_the_slots_suggests_slots_on_every_host(hosts, fix):
    with pytest.raises(UsageError) as info:
        assign_slots(hosts, 7)
    assert str(info.value).endswith(f"lower -np or add slots, {fix}")


def test_gpu_pinning_default_order():
    slots = assign_slots([Host("a", 4)], 4, GpuLayout(gpus_per_node=4))
    assert [s.devices for s in slots] == [("0",), ("1",), ("2",), ("3",)]


def test_gpu_pinning_machine_order_reversed_like_polaris():
    slots = assign_slots([Host("a", 4), Host("b", 4)], 8, GpuLayout(4, ("3", "2", "1", "0")))
    assert [s.devices[0] for s in slots] == ["3", "2", "1", "0"] * 2


def test_several_gpus_per_rank_and_mig_uuids():
    order = ("MIG-a", "MIG-b", "MIG-c", "MIG-d")
    slots = assign_slots([Host("a", 2)], 2, GpuLayout(4, order, gpus_per_rank=2))
    assert [s.devices for s in slots] == [("MIG-a", "MIG-b"), ("MIG-c", "MIG-d")]


def test_not_enough_gpus_is_a_usage_error():
    with pytest.raises(UsageError, match="host 'a' has 4 GPUs but local rank 2 needs GPUs 4..5"):
        assign_slots([Host("a", 3)], 3, GpuLayout(4, gpus_per_rank=2))


def test_no_gpus_no_devices():
    assert all(s.devices == () for s in assign_slots([Host("a", 2)], 2))


def test_topologies_match_the_definition_on_random_layouts():
    """The linear computation agrees with Horovod's rule spelled out directly (quadratic)."""
    import random

    from hvdrun.ranks import topologies

    def by_definition(host_of_rank):
        hosts = list(dict.fromkeys(host_of_rank))
        ranks_on = {h: [r for r, x in enumerate(host_of_rank) if x == h] for h in hosts}
        result = []
        for rank, host in enumerate(host_of_rank):
            local = ranks_on[host].index(rank)
            peers = [h for h in hosts if len(ranks_on[h]) > local]
            result.append((local, len(ranks_on[host]), peers.index(host), len(peers)))
        return result

    rng = random.Random(3)
    for _ in range(200):
        layout = [rng.choice("abcde") for _ in range(rng.randint(1, 40))]
        got = [(t.local_rank, t.local_size, t.cross_rank, t.cross_size) for t in topologies(layout)]
        assert got == by_definition(layout), layout
