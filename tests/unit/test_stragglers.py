"""Rank 0's straggler verdicts from arrival times (pure logic; the job-level tests are in test_stragglers.py of
the integration tests)."""

from __future__ import annotations

import random

from hvdrun.runtime.stragglers import MIN_COLLECTIVES, REPEAT_S, StragglerWatch, arrival

HOSTS = ["a", "a", "b", "b"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watch(hosts=HOSTS) -> tuple[StragglerWatch, list[str], Clock]:
    said: list[str] = []
    clock = Clock()
    return StragglerWatch(hosts, said.append, clock), said, clock


def step(w: StragglerWatch, clock: Clock, late: dict[int, float], period: float = 0.040,
         jitter: float = 0.0, rng: random.Random | None = None) -> None:
    """One collective: every rank arrives at the step's start (plus jitter), ranks in ``late`` that much later."""
    start = clock.now
    times = {rank: start + late.get(rank, 0.0) + (rng.uniform(0, jitter) if rng else 0.0) for rank in range(len(HOSTS))}
    clock.now = max(times.values()) + period
    w.observe([times])


def test_arrival_of_a_collective():
    assert arrival({0: 1.0, 1: 1.0, 2: 1.0}, 5.0).last == ()  # one cycle for all: no one is last
    late = arrival({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.03}, 5.0)
    assert late.last == (3,) and abs(late.lag_s - 0.03) < 1e-9 and abs(late.waited_s - 0.09) < 1e-9


def test_a_rank_that_always_comes_late_is_named_once_with_its_host():
    w, said, clock = watch()
    for _ in range(MIN_COLLECTIVES + 20):
        step(w, clock, {3: 0.030}, period=0.010)
    assert len(said) == 1, said
    assert said[0].startswith("hvdrun: straggler: rank 3 on b arrived last at 100% of the last 32 collectives, "
                              "30 ms after the median; the other 3 ranks spent "), said
    named = clock.now
    while clock.now < named + REPEAT_S - 1:  # still late: not named again within the minute
        step(w, clock, {3: 0.030}, period=0.010)
    assert len(said) == 1
    while clock.now < named + REPEAT_S + 1:  # ... but after it
        step(w, clock, {3: 0.030}, period=0.010)
    assert len(said) == 2


def test_the_late_ranks_of_one_host_name_the_host():
    w, said, clock = watch()
    for i in range(MIN_COLLECTIVES + 5):
        step(w, clock, {2 + i % 2: 0.030, 3 - i % 2: 0.020}, period=0.010)  # rank 2 or 3 last, by turns
    assert len(said) == 1 and said[0].startswith("hvdrun: straggler: host b (its ranks) arrived last at 100%"), said
    scores = w.scores()  # the live view marks every rank of the host named, as the line names it
    assert w.flagged == (2, 3) and [rank for rank, (_, _, flag) in scores["ranks"].items() if flag] == [2, 3]
    assert scores["said"][0][1] == said[0]


def test_an_even_job_with_jitter_a_warm_up_and_a_checkpoint_names_no_one():
    w, said, clock = watch()
    rng = random.Random(7)
    step(w, clock, {0: 2.0})  # rank 0's first step compiles something: once
    for i in range(400):
        step(w, clock, {}, jitter=0.020, rng=rng)  # up to 20 ms of noise on every rank
        if i % 100 == 99:
            step(w, clock, {rank: 0.5 for rank in range(4)})  # a checkpoint every rank takes
    assert said == []


def test_a_little_late_is_not_a_straggler():
    """Last every time, but 1 ms after the median and the others hardly wait: no verdict."""
    w, said, clock = watch()
    for _ in range(200):
        step(w, clock, {1: 0.001}, period=0.050)
    assert said == []


def test_collectives_without_every_rank_do_not_count():
    w, said, clock = watch()
    for _ in range(200):
        w.observe([{0: clock.now, 1: clock.now + 0.05}])  # a process set of ranks 0 and 1
        clock.now += 0.1
    assert said == []


def test_a_late_rank_is_named_even_when_a_host_mate_sometimes_comes_last_with_it():
    """On a busy host another rank, descheduled a moment, lands in the straggler's cycle now and then: the rank that
    is late every time is still the one named, not its host."""
    w, said, clock = watch()
    for i in range(MIN_COLLECTIVES + 8):
        step(w, clock, {3: 0.030, **({2: 0.030} if i % 10 < 3 else {})}, period=0.010)  # tied 30 % of the time
    assert len(said) == 1 and said[0].startswith("hvdrun: straggler: rank 3 on b arrived last at 100%"), said
