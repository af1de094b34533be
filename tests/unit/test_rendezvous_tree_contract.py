"""The launcher's and the runtime's contract on the rendezvous tree (hvdrun/protocol/tree.py)."""

import pytest

from hvdrun.errors import UsageError
from hvdrun.protocol.tree import DEFAULT_FANOUT, TreePlace, fanout, inner_hosts, parent_of, tree_place, tree_value


def test_rank_0_admits_up_to_the_fanout_and_past_it_hosts_form_a_heap_whose_depth_grows_as_a_logarithm():
    assert inner_hosts(list(range(33)), 32) == []  # rank 0's host and 32 more: rank 0 admits them all
    assert inner_hosts(list(range(34)), 32) == [1]
    assert inner_hosts(list("abcdefghi"), 2) == ["b", "c", "d"]  # 0 -> 1 2; 1 -> 3 4; 2 -> 5 6; 3 -> 7 8

    def depth(host: int, per_leader: int) -> int:
        return 0 if host == 0 else 1 + depth(parent_of(host, per_leader), per_leader)

    assert [max(depth(h, 32) for h in range(hosts)) for hosts in (33, 1_057, 4_096, 33_825)] == [1, 2, 3, 3]
    admitted = {p: sum(parent_of(h, 32) == p for h in range(1, 4_096)) for p in range(4_096)}
    assert max(admitted.values()) == 32  # no leader, rank 0 included, admits more than the fan-out
    assert fanout({}) == DEFAULT_FANOUT == 32 and fanout({"HVDRUN_RENDEZVOUS_FANOUT": " 4 "}) == 4


@pytest.mark.parametrize("value", ["1", "0", "-3", "many", "2.5"])
def test_a_fanout_that_is_not_a_whole_number_of_at_least_2_is_a_usage_error(value):
    with pytest.raises(UsageError, match=f"HVDRUN_RENDEZVOUS_FANOUT='{value}'"):
        fanout({"HVDRUN_RENDEZVOUS_FANOUT": value})


def test_each_rank_finds_its_parent_and_its_port_from_the_endpoints_and_its_host_index():
    value = tree_value(2, [("10.0.0.2", 4001), ("fe80::3", 4002), ("10.0.0.4", 4003)])
    assert value == "2;10.0.0.2:4001,fe80::3:4002,10.0.0.4:4003"
    place = {host: tree_place({"HVDRUN_RENDEZVOUS_TREE": value, "GROUP_RANK": str(host)}) for host in range(9)}
    assert place[0] is None  # rank 0's host
    assert place[1] == TreePlace(None, ("10.0.0.2", 4001)) and place[2] == TreePlace(None, ("fe80::3", 4002))
    assert place[3] == TreePlace(("10.0.0.2", 4001), ("10.0.0.4", 4003))
    assert place[4] == TreePlace(("10.0.0.2", 4001), None)
    assert place[5] == place[6] == TreePlace(("fe80::3", 4002), None)
    assert place[7] == place[8] == TreePlace(("10.0.0.4", 4003), None)


@pytest.mark.parametrize("environ", [{}, {"HVDRUN_RENDEZVOUS_TREE": "", "GROUP_RANK": "3"},
                                     {"HVDRUN_RENDEZVOUS_TREE": "2;h:1"},  # no host index
                                     {"HVDRUN_RENDEZVOUS_TREE": "2;h:1", "GROUP_RANK": "9"},  # no such parent
                                     {"HVDRUN_RENDEZVOUS_TREE": "0;h:1", "GROUP_RANK": "2"},
                                     {"HVDRUN_RENDEZVOUS_TREE": "2;h:port", "GROUP_RANK": "2"},
                                     {"HVDRUN_RENDEZVOUS_TREE": "2;:7", "GROUP_RANK": "3"}])
def test_a_rank_without_a_readable_place_joins_rank_0(environ):
    assert tree_place(environ) is None
