"""The launcher's and the runtime's contract on rendezvous groups (hvdrun/protocol/groups.py)."""

import pytest

from hvdrun.errors import UsageError
from hvdrun.protocol.groups import (
    DEFAULT_GROUP_HOSTS,
    GroupPlace,
    group_hosts,
    group_place,
    groups_value,
    leading_hosts,
)


def test_groups_begin_past_one_group_of_hosts_and_each_later_group_is_led_by_its_first_host():
    assert leading_hosts(list(range(32)), 32) == []
    assert leading_hosts(list(range(33)), 32) == [32]
    assert leading_hosts(list("abcde"), 2) == ["c", "e"]
    assert group_hosts({}) == DEFAULT_GROUP_HOSTS == 32
    assert group_hosts({"HVDRUN_RENDEZVOUS_GROUP_HOSTS": " 4 "}) == 4


@pytest.mark.parametrize("value", ["0", "-3", "many", "2.5"])
def test_a_number_of_hosts_per_group_that_is_not_a_whole_positive_number_is_a_usage_error(value):
    with pytest.raises(UsageError, match=f"HVDRUN_RENDEZVOUS_GROUP_HOSTS='{value}'"):
        group_hosts({"HVDRUN_RENDEZVOUS_GROUP_HOSTS": value})


def test_each_rank_finds_its_group_from_the_endpoints_and_its_host_index():
    value = groups_value(2, [("10.0.0.3", 4001), ("fe80::1", 4002)])
    assert value == "2;10.0.0.3:4001,fe80::1:4002"
    place = {host: group_place({"HVDRUN_RENDEZVOUS_GROUPS": value, "GROUP_RANK": str(host)}) for host in range(6)}
    assert place[0] is None and place[1] is None  # group 0 joins rank 0
    assert place[2] == GroupPlace("10.0.0.3", 4001, leads=True) and place[3] == GroupPlace("10.0.0.3", 4001, False)
    assert place[4] == GroupPlace("fe80::1", 4002, leads=True) and place[5] == GroupPlace("fe80::1", 4002, False)


@pytest.mark.parametrize("environ", [{}, {"HVDRUN_RENDEZVOUS_GROUPS": "", "GROUP_RANK": "3"},
                                     {"HVDRUN_RENDEZVOUS_GROUPS": "2;h:1"},  # no host index
                                     {"HVDRUN_RENDEZVOUS_GROUPS": "2;h:1", "GROUP_RANK": "9"},  # no such group
                                     {"HVDRUN_RENDEZVOUS_GROUPS": "0;h:1", "GROUP_RANK": "2"},
                                     {"HVDRUN_RENDEZVOUS_GROUPS": "2;h:port", "GROUP_RANK": "2"}])
def test_a_rank_without_a_readable_group_joins_rank_0(environ):
    assert group_place(environ) is None
