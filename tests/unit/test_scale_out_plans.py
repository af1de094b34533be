"""The plans behind the collectives across hosts: partners, grids, the algorithm by size, the response cache."""

from __future__ import annotations

import math

import pytest

from hvdrun.runtime.collectives.hierarchical import AlgorithmChoice, grid_of, link_partners
from hvdrun.runtime.collectives.pairwise import core_index, core_member, partners
from hvdrun.runtime.negotiation import Entry, Request, ResponseCache


@pytest.mark.parametrize("size", [1, 2, 3, 5, 6, 7, 8, 12, 16, 33, 1000])
def test_partners_are_mutual_and_logarithmic(size):
    for member in range(size):
        mine = partners(member, size)
        assert member not in mine and len(mine) <= int(math.log2(size)) + 1
        assert all(member in partners(other, size) for other in mine)
        core = core_index(member, size)
        assert core is None or core_member(core, size) == member
    cores = [core_index(m, size) for m in range(size)]
    assert sorted(c for c in cores if c is not None) == list(range(1 << (size.bit_length() - 1)))


def test_grid_needs_several_hosts_with_equal_ranks():
    assert grid_of(["a", "a", "b", "b", "c", "c"]) == [[0, 1], [2, 3], [4, 5]]
    assert grid_of(["a", "b", "a", "b"]) == [[0, 2], [1, 3]]
    assert grid_of(["a", "a", "b"]) is None and grid_of(["a", "a"]) is None
    grid = grid_of([f"h{r // 4}" for r in range(64)])
    assert grid is not None
    links = [link_partners(grid, rank) for rank in range(64)]
    assert all(rank not in mine and len(mine) <= 2 + 2 + 4 for rank, mine in enumerate(links))
    assert all(rank in links[other] for rank, mine in enumerate(links) for other in mine)


def test_auto_picks_doubling_then_halving_then_ring():
    choice = AlgorithmChoice("auto", doubling_max_bytes=100, halving_max_bytes=1000)
    assert [choice.across_hosts(n, 8) for n in (1, 100, 101, 1000, 1001)] == [
        "doubling", "doubling", "halving", "halving", "ring"]
    assert AlgorithmChoice("ring").across_hosts(1) == "ring"
    # the ring's crossover grows with the hosts: halving_max_bytes x hosts / 8
    assert [choice.across_hosts(400, hosts) for hosts in (2, 4, 8)] == ["ring", "halving", "halving"]
    assert [choice.across_hosts(1500, hosts) for hosts in (8, 16, 64)] == ["ring", "halving", "halving"]


def test_eager_data_shrinks_as_the_job_grows():
    from hvdrun.runtime.submissions import EAGER_JOB_BYTES, Submissions

    assert [Submissions(None, n, 32 << 10).eager_bytes for n in (2, 4, 8, 64, 4096)] == [
        32 << 10, 32 << 10, 16 << 10, EAGER_JOB_BYTES // 64, EAGER_JOB_BYTES // 4096]


def test_the_response_cache_numbers_agreed_requests_and_forgets_the_oldest():
    cache = ResponseCache(capacity=2)
    first, second, third = (Request(f"grad.{i}", "allreduce", "float32", (10,)) for i in range(3))
    assert cache.encode(first.wire()) == first.wire()
    failed = Entry("grad.1", {0: second}, error="mismatch")
    cache.remember([Entry("grad.0", {0: first, 1: first}), failed])
    assert cache.encode(first.wire()) == 0 and cache.encode(second.wire()) == second.wire()
    assert cache.decode(0) == first.wire() and cache.decode(second.wire()) == second.wire()
    cache.remember_wire(second.wire())
    cache.remember_wire(third.wire())  # over capacity: the oldest (first) goes
    assert cache.encode(first.wire()) == first.wire()
    assert [cache.encode(r.wire()) for r in (second, third)] == [1, 2]
    off = ResponseCache(capacity=0)
    off.remember_wire(first.wire())
    assert off.encode(first.wire()) == first.wire()


def test_a_joined_rank_catches_up_on_grouped_and_plain_automatic_numbers():
    from hvdrun.runtime.submissions import Submissions

    ledger = Submissions(None, 2, 0)
    ledger.catch_up_auto_name("grouped_allreduce.noname.3.1")  # a grouped op's second tensor
    ledger.catch_up_auto_name("allreduce.noname.2")
    ledger.catch_up_auto_name("grad.7")  # a user's name: nothing to count
    assert ledger.auto_name("grouped_allreduce") == "grouped_allreduce.noname.4"
    assert ledger.auto_name("allreduce") == "allreduce.noname.3"


def test_the_cache_keeps_no_automatic_names():
    cache = ResponseCache(capacity=4)
    unnamed = Request("allreduce.noname.1", "allreduce", "float32", (1,))
    cache.remember([Entry(unnamed.name, {0: unnamed, 1: unnamed})])
    assert cache.encode(unnamed.wire()) == unnamed.wire()
    from hvdrun.errors import CollectiveError

    with pytest.raises(CollectiveError, match="HVDRUN_CACHE_CAPACITY"):
        cache.decode(7)
