"""Rendezvous groups (runtime/rendezvous/children.py): past HVDRUN_RENDEZVOUS_GROUP_HOSTS hosts, each group of hosts
joins its first host's leader, which joins rank 0 for the group and relays failures, reports, barriers and goodbyes,
so rank 0 admits one connection per group instead of one per host. Ranks given host names of their own are
separate hosts to the runtime. Five hosts in groups of two: a (ranks 0, 1) and b (2) join rank 0; c (3, 4) leads
d (5, 6); e (7) leads a group of itself."""

import re

import pytest

from hvdrun.launch.remote.hostfacts import free_ports
from hvdrun.protocol.groups import groups_value
from tests.integration.test_host_leaders import WORKER

HOSTS = [("a", 2), ("b", 1), ("c", 2), ("d", 2), ("e", 1)]


@pytest.fixture
def groups_env() -> dict[str, str]:
    return {"HVDRUN_RENDEZVOUS_GROUPS": groups_value(2, [("127.0.0.1", port) for port in free_ports(2)])}


def _finish(procs: dict) -> dict[int, tuple[str, str]]:
    return {rank: proc.communicate(timeout=90) for rank, proc in procs.items()}


def test_groups_join_rank_0_through_their_leaders_and_reports_come_back_through_two_levels(spawn_ranks, groups_env):
    procs = spawn_ranks(WORKER, 8, args=("stacks",), hosts=HOSTS, env=groups_env)
    outputs = _finish(procs)
    for rank, (stdout, stderr) in outputs.items():
        assert procs[rank].returncode == 0 and f"rank {rank}: ok" in stdout, stderr[-2000:]
    assert "reports from ranks [0, 1, 2, 3, 4, 5, 6, 7], absent []" in outputs[0][0]
    # rank 1 (its own host's), rank 2 (host b, group 0), and the leaders of groups 1 and 2: not one per host
    assert "rank 0 admitted 4 connections for 7 ranks" in outputs[0][0], outputs[0][0]


@pytest.mark.parametrize("victim, named", [(5, "rank 5 (host d,"), (3, "rank 3 (host c,"), (7, "rank 7 (host e,"),
                                           (0, "rank 0")],
                         ids=["a-members-rank-dies", "a-rank-of-the-leading-host-dies", "a-lone-leader-dies",
                              "rank-0-dies"])
def test_a_death_anywhere_reaches_every_rank_through_the_groups(spawn_ranks, groups_env, victim, named):
    procs = spawn_ranks(WORKER, 8, args=("die", str(victim)), hosts=HOSTS, env=groups_env)
    outputs = _finish(procs)
    assert procs[victim].returncode == -9
    for rank, (stdout, stderr) in outputs.items():
        if rank == victim:
            continue
        assert procs[rank].returncode == 0, stderr[-2000:]
        seconds = float(re.search(r"raised after ([\d.]+) s", stdout).group(1))
        assert seconds < 30, stdout  # a bound against hanging, not a timing claim
        assert named in stdout, stdout  # by rank 0, or by the leader the victim's death cut them off from


def test_a_rank_that_never_comes_in_a_group_is_named_exactly_and_its_group_hears_it(spawn_ranks, groups_env):
    procs = spawn_ranks(WORKER, 8, ranks=[0, 1, 2, 3, 4, 5, 7], args=("ok",), hosts=HOSTS,
                        env={**groups_env, "HVDRUN_START_TIMEOUT": "3"})
    outputs = _finish(procs)
    assert all(proc.returncode != 0 for proc in procs.values())
    for rank in (0, 3, 5, 7):  # rank 0, the group's leading host, its member host, another group
        assert "ranks 6 never joined rank 0" in outputs[rank][1], (rank, outputs[rank][1][-2000:])


def test_hvdrun_over_ssh_groups_four_real_hosts_in_twos(run_hvdrun, hvdrun_env, ssh_hosts):
    """The launcher's side: past HVDRUN_RENDEZVOUS_GROUP_HOSTS hosts it finds a free port on each group's first host
    (its probe) and gives every rank the groups' endpoints; h3 leads h4, so rank 0 admits h2 and h3 only."""
    hvdrun_env["HVDRUN_RENDEZVOUS_GROUP_HOSTS"] = "2"
    done = run_hvdrun("-H", ssh_hosts.hosts(1, count=4), *ssh_hosts.args(), WORKER, "stacks", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reports from ranks [0, 1, 2, 3], absent []" in done.stdout, done.stdout[-2000:]
    assert "rank 0 admitted 2 connections for 3 ranks" in done.stdout, done.stdout[-2000:]


def test_a_bad_number_of_hosts_per_group_is_a_usage_error(run_hvdrun, hvdrun_env, ssh_hosts):
    hvdrun_env["HVDRUN_RENDEZVOUS_GROUP_HOSTS"] = "0"
    done = run_hvdrun("-H", ssh_hosts.hosts(1, count=2), *ssh_hosts.args(), WORKER, "ok", timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "HVDRUN_RENDEZVOUS_GROUP_HOSTS='0': expected a whole number of hosts, at least 1" in done.stderr
