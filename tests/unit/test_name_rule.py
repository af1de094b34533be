"""A name is taken on a rank from submission until its op finished and the rank saw an end past it (its own, or a
later op's): Horovod's duplicate-name test never races the background thread."""

from __future__ import annotations

import pytest

from hvdrun.runtime.handles import Handle
from hvdrun.runtime.negotiation import Request
from hvdrun.runtime.submissions import Submissions


class _Engine:
    """What a handle needs of the engine: the ledger's two calls."""

    def __init__(self) -> None:
        self.ledger = Submissions(self, world_size=2, eager_bytes=0)

    def drive_until(self, handle: Handle, timeout_s: float | None) -> None:
        pass

    def release_name(self, name: str) -> None:
        self.ledger.release_name(name)

    def name_seen(self, name: str, number: int) -> None:
        self.ledger.seen(name, number)


def submit(engine: _Engine, name: str) -> Handle:
    ops, _ = engine.ledger.add([(Request(name, "barrier"), None)], wake=False)
    return ops[0].handle


def test_an_op_that_finished_before_the_second_submission_still_refuses_it():
    engine = _Engine()
    first = submit(engine, "duplicate_name")
    first.finish(None)  # the background thread won the race
    with pytest.raises(ValueError, match="'duplicate_name' is already in progress .*not yet synchronized"):
        submit(engine, "duplicate_name")
    with pytest.raises(ValueError):  # a refused submission is not going on
        submit(engine, "duplicate_name")


@pytest.mark.parametrize("went_on", ["waited", "polled", "another op"])
def test_the_name_is_free_once_the_rank_went_on(went_on):
    engine = _Engine()
    first = submit(engine, "metric")
    first.finish(None)
    if went_on == "waited":
        first.wait()
    elif went_on == "polled":
        first.seen()
    else:
        submit(engine, "loss").finish(None)
    submit(engine, "metric")


def test_a_later_op_still_in_flight_does_not_free_the_name():
    engine = _Engine()
    first = submit(engine, "metric")
    submit(engine, "barrier.noname.1")  # submitted, not finished
    first.finish(None)
    with pytest.raises(ValueError, match="not yet synchronized"):
        submit(engine, "metric")


@pytest.mark.parametrize("order", ["op first", "barrier first"])
def test_an_op_that_finished_while_the_rank_waited_in_a_later_one_is_free_after_it(order):
    """Rank 0 of Horovod's test: its op finishes while it waits in the barrier it submitted after it."""
    engine = _Engine()
    first = submit(engine, "duplicate_name")
    barrier = submit(engine, "barrier.noname.1")
    for handle in ((first, barrier) if order == "op first" else (barrier, first)):
        handle.finish(None)
    barrier.wait()
    submit(engine, "duplicate_name")


def test_an_op_in_flight_is_refused_whatever_was_seen():
    engine = _Engine()
    submit(engine, "x")
    submit(engine, "y")
    with pytest.raises(ValueError, match="'x' is already in progress on this rank;"):
        submit(engine, "x")
    assert not engine.ledger.claim("x")  # the express cycle too


def test_the_express_cycle_refuses_a_finished_unseen_name():
    engine = _Engine()
    submit(engine, "x").finish(None)
    assert not engine.ledger.claim("x")
    assert engine.ledger.claim("y")  # a later op that finishes frees it
    engine.ledger.release_name("y", seen=True)
    assert engine.ledger.claim("x")


def test_an_old_handle_polled_late_does_not_free_a_newer_op_of_its_name():
    engine = _Engine()
    old = submit(engine, "metric")
    old.finish(None)
    submit(engine, "loss").finish(None)  # frees "metric"
    newer = submit(engine, "metric")
    newer.finish(None)
    old.seen()  # the user polls the first handle only now
    with pytest.raises(ValueError, match="not yet synchronized"):
        submit(engine, "metric")
