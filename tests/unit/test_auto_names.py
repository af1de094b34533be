"""Automatic names of unnamed ops (``allgather.noname.N``) and the numbers failed ops give back."""

from __future__ import annotations

import pytest

from hvdrun.runtime.submissions import Submissions


def ledger() -> Submissions:
    return Submissions(None, world_size=2, eager_bytes=0)  # type: ignore[arg-type]  # no op is submitted


@pytest.mark.parametrize("order", [(1, 2), (2, 1)])
def test_two_failed_ops_in_flight_give_both_numbers_back_in_either_order(order):
    names = ledger()
    taken = [names.auto_name("allgather") for _ in range(2)]
    for number in order:
        names.give_back_auto_name(taken[number - 1])
    assert names.auto_name("allgather") == "allgather.noname.1"


def test_a_number_below_one_still_in_use_is_not_reused():
    names = ledger()
    first, _ = names.auto_name("allgather"), names.auto_name("allgather")
    names.give_back_auto_name(first)  # the second one went through on every rank
    assert names.auto_name("allgather") == "allgather.noname.3"


def test_kinds_and_named_ops_are_apart():
    names = ledger()
    gather = names.auto_name("allgather")
    assert names.auto_name("allreduce") == "allreduce.noname.1"
    names.give_back_auto_name("my.op")
    names.give_back_auto_name(gather)
    assert (names.auto_name("allgather"), names.auto_name("allreduce")) == ("allgather.noname.1", "allreduce.noname.2")
