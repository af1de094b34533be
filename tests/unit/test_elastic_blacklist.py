"""What a failed elastic worker takes out for its cool-down (``--blacklist-scope``), decided without processes."""

from __future__ import annotations

import pytest

from hvdrun.hosts import Host
from hvdrun.launch.elastic.discovery import FixedHosts
from hvdrun.launch.elastic.worker_pool import HOST, SLOT, ElasticSettings, Member, WorkerPool
from hvdrun.launch.plan import RunOptions, plan_job
from hvdrun.ranks import GpuLayout

A, B = Host("localhost", 3), Host("127.0.0.1", 2)


@pytest.mark.parametrize("given", [None, SLOT, HOST])
def test_the_scope_option_reaches_the_settings_as_given(tmp_path, monkeypatch, given):
    monkeypatch.chdir(tmp_path)
    options = RunOptions(command=("true",), num_proc=4, hosts="localhost:2,127.0.0.1:2", min_np=2,
                         blacklist_scope=given)
    plan = plan_job(options, {})
    assert plan.elastic is not None and plan.elastic.settings.blacklist_scope == given


@pytest.mark.parametrize("given, hosts, expected", [
    (None, (A, B), HOST),  # more than one host: Horovod's blacklist
    (None, (A,), SLOT),  # one machine: a death must not end the job
    (SLOT, (A, B), SLOT),
    (HOST, (A,), HOST),
])
def test_without_the_option_the_scope_follows_the_hosts_discovery_offers_now(given, hosts, expected):
    """Decided at each failure: a job that started on one host and grew onto two blacklists hosts from then on."""
    pool, _ = pool_with_workers(given)
    pool.hosts = hosts
    assert pool.scope() == expected


def test_a_job_that_grows_onto_a_second_host_turns_to_host_scope():
    pool, _ = pool_with_workers(None)
    pool.hosts = (A,)
    pool.members[1].status = 1
    assert pool.blacklist(pool.members[1]).endswith("(--blacklist-scope slot)")
    pool.hosts = (A, B)
    pool.members[2].status = 1
    assert pool.blacklist(pool.members[2]).endswith("worker(s) 0 leave at the next round (--blacklist-scope host)")


def pool_with_workers(scope: str | None) -> tuple[WorkerPool, list[str]]:
    """A pool whose members are three workers on A and two on B (no process behind them)."""
    log: list[str] = []
    settings = ElasticSettings(min_np=1, cooldown_s=(60.0, 3600.0), blacklist_scope=scope)
    pool = WorkerPool(None, None, FixedHosts([A, B]), settings, None, GpuLayout(), log.append)  # type: ignore[arg-type]
    pool.hosts = (A, B)
    places = [(A, 0), (A, 1), (A, 2), (B, 0), (B, 1)]
    pool.members = {n: Member(n, host, index, None, 0.0) for n, (host, index) in enumerate(places)}  # type: ignore[arg-type]
    return pool, log


def test_slot_scope_cools_down_the_failed_slot_only():
    pool, _ = pool_with_workers(SLOT)
    pool.members[1].status = 1  # reaped: it failed
    line = pool.blacklist(pool.members[1])
    assert pool.open_slots(A) == [0, 2] and pool.open_slots(B) == [0, 1]
    assert [m.number for m in pool.serving()] == [0, 2, 3, 4]
    assert line.startswith("hvdrun: elastic: slot 1 of host localhost cools down for 6")
    assert line.endswith("after worker 1 failed there; the host's other slots stay open (--blacklist-scope slot)")


def test_host_scope_blacklists_the_host_and_its_other_workers_leave():
    pool, _ = pool_with_workers(HOST)
    pool.members[1].status = 1  # reaped: it failed
    line = pool.blacklist(pool.members[1])
    assert pool.open_slots(A) == [] and pool.open_slots(B) == [0, 1]
    assert [m.number for m in pool.serving()] == [3, 4]
    assert pool.members[0].removed.startswith("host localhost is blacklisted for 6")
    assert pool.members[2].removed.endswith("s after worker 1 failed on it")
    assert line.endswith("after worker 1 failed on it: no worker starts there until then; worker(s) 0, 2 leave at "
                         "the next round (--blacklist-scope host)")


def test_each_strike_doubles_the_cool_down_up_to_the_maximum():
    pool, _ = pool_with_workers(SLOT)
    seconds = [pool.cool_down("localhost", 0) for _ in range(8)]
    assert [round(s // 60) for s in seconds] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert pool.cooling("localhost", 0) and not pool.cooling("localhost") and not pool.cooling("localhost", 1)
