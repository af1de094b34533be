"""A rank's held requests (hvdrun.runtime.held), without processes: which run, which are flushed, when a cycle is
due. The cycles' merged tallies are written by hand: ({cycle: ranks that began then}, last cycle, last ranks)."""

from __future__ import annotations

import pytest

from hvdrun.runtime import held as held_module
from hvdrun.runtime.held import FLUSH_AGE_S, HeldRequests


def _tally(counts: dict[int, int]) -> tuple:
    return counts, max(counts), (0, 0)


def test_numbers_every_rank_holds_run_in_number_order_and_the_rest_stay_held():
    held = HeldRequests()
    cycle, flushed = held.begin_cycle()
    assert (cycle, flushed) == (1, [])
    for key in (9, 4, 6):
        held.hold(key)
    assert held.announced() == ({9: 1, 4: 1, 6: 1}, False)
    ready = held.settle({9: _tally({1: 4}), 4: _tally({1: 4}), 6: _tally({1: 3})}, 4, flush=False, now=10.0)
    assert ready == [4, 9] and held and held.announced()[0] == {6: 1}
    assert not held.flushing and not held.flush_due() and held.times == {1: 10.0}


def test_a_cycle_that_asks_for_it_has_the_partial_numbers_flushed_in_the_next():
    held = HeldRequests()
    held.begin_cycle()
    held.hold(6)
    held.hold(7)
    held.end_exchange()
    assert held.settle({6: _tally({1: 3}), 7: _tally({1: 1}), 8: _tally({1: 2})}, 4, flush=True, now=1.0) == []
    assert held.flushing == {6, 7, 8} and held.flush_due()  # 8: another rank's; this one flushes what it holds
    cycle, flushed = held.begin_cycle()
    assert (cycle, flushed) == (2, [6, 7]) and not held
    held.end_exchange()
    assert not held.flushing and not held.flush_due()


def test_a_number_held_too_long_makes_a_cycle_due_and_says_so(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(held_module.time, "monotonic", lambda: clock[0])
    held = HeldRequests()
    held.begin_cycle()
    held.hold(3)
    assert not held.flush_due() and held.announced() == ({3: 1}, False)
    clock[0] += FLUSH_AGE_S
    assert held.flush_due() and held.announced() == ({3: 1}, True)


@pytest.mark.parametrize(("tallies", "general", "alone"), [
    ({5: ({2: 4}, 2, (0, 3))}, False, True),  # every rank began to hold it in this cycle, nothing else
    ({5: ({1: 1, 2: 3}, 2, (1, 3))}, False, False),  # rank 0 held it since the last cycle
    ({5: ({2: 4}, 2, (0, 3)), 6: ({2: 1}, 2, (2, 2))}, False, False),  # another number is held
    ({5: ({2: 4}, 2, (0, 3))}, True, False),  # a rank said something in the general form
    ({5: ({2: 3}, 2, (0, 2))}, False, False),  # not every rank
])
def test_a_number_runs_by_itself_only_when_every_rank_began_to_hold_it_alone_now(tallies, general, alone):
    held = HeldRequests()
    held.begin_cycle()
    held.begin_cycle()
    assert held.began_alone_now(5, tallies, general, 4) is alone
    assert not held.began_alone_now(("an", "uncached", "request"), tallies, general, 4)
