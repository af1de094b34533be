"""The rendezvous tree (hvdrun/protocol/tree.py, runtime/rendezvous/children.py): past HVDRUN_RENDEZVOUS_FANOUT + 1
hosts, each host's leader joins its parent host's leader, which admits it as rank 0 would and joins for its whole
subtree, relaying failures, reports, barriers and goodbyes; rank 0 admits at most the fan-out. Ranks given host names
of their own are separate hosts to the runtime. Fan-out 2 here: five hosts of two ranks, a (ranks 0, 1), b (2, 3),
c (4, 5), d (6, 7), e (8, 9), make a -> b c, b -> d e; nine hosts of one rank make three levels (n0 -> n1 n2,
n1 -> n3 n4, n3 -> n7 n8), whose inner hosts are led by their only rank."""

import socket
import subprocess
import threading
import time

import pytest

from hvdrun.launch.remote.hostfacts import free_ports
from hvdrun.protocol.tree import tree_value
from tests.conftest import threads_of, wait_until
from tests.integration.test_host_leaders import WORKER, _leads, assert_the_others_raised_naming

HOSTS = [(name, 2) for name in "abcde"]
NINE = [(f"n{h}", 1) for h in range(9)]


@pytest.fixture
def tree_env() -> dict[str, str]:
    """Fan-out 2, the endpoints of inner hosts 1, 2, 3 on this machine (a job uses those its hosts need)."""
    return {"HVDRUN_RENDEZVOUS_TREE": tree_value(2, [("127.0.0.1", port) for port in free_ports(3)])}


def _finish(procs: dict, timeout_s: float = 90) -> dict[int, tuple[str, str]]:
    """Every rank's (stdout, stderr); a job still running after ``timeout_s`` fails with every rank's threads."""
    outputs, deadline = {}, time.monotonic() + timeout_s
    for rank, proc in procs.items():
        try:
            outputs[rank] = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            left = {r: p for r, p in procs.items() if p.poll() is None}
            dumps = [f"rank {r}: {threads_of(p.pid)}" for r, p in left.items()]
            done = [f"rank {r} ended {procs[r].returncode}: {out[-600:]!r} {err[-1500:]!r}" for r, (out, err) in
                    outputs.items()]
            pytest.fail(f"ranks {list(left)} still running after {timeout_s:g} s\n" + "\n".join(dumps + done))
    return outputs


@pytest.mark.parametrize("hosts, size, admitted", [(HOSTS, 10, "3 connections for 9 ranks"),
                                                   (NINE, 9, "2 connections for 8 ranks")],
                         ids=["2-levels", "3-levels"])
def test_hosts_join_through_their_parents_and_reports_come_back_up_the_tree(spawn_ranks, tree_env, hosts, size,
                                                                             admitted):
    procs = spawn_ranks(WORKER, size, args=("stacks",), hosts=hosts, env=tree_env)
    outputs = _finish(procs)
    for rank, (stdout, stderr) in outputs.items():
        assert procs[rank].returncode == 0 and f"rank {rank}: ok" in stdout, stderr[-2000:]
    assert f"reports from ranks {list(range(size))}, absent []" in outputs[0][0]
    assert f"rank 0 admitted {admitted}" in outputs[0][0], outputs[0][0]  # not one per host


@pytest.mark.parametrize("hosts, victim, named", [
    (HOSTS, 7, "rank 7 (host d,"), (HOSTS, 2, "rank 2 (host b,"), (HOSTS, 9, "rank 9 (host e,"),
    (HOSTS, 4, "rank 4 (host c,"), (HOSTS, 0, "rank 0"), (NINE, 3, "rank 3 (host n3,"), (NINE, 8, "rank 8 (host n8,"),
    (NINE, 1, "rank 1 (host n1,")],
    ids=["a-leaf-hosts-rank", "an-inner-hosts-rank", "a-leaf-hosts-other-rank", "rank-0s-child", "rank-0",
         "a-lone-middle-leader", "a-deepest-leaf", "a-lone-leader-under-rank-0"])
def test_a_death_anywhere_in_the_tree_reaches_every_rank_named(spawn_ranks, tree_env, hosts, victim, named):
    size = sum(slots for _, slots in hosts)
    procs = spawn_ranks(WORKER, size, args=("die", str(victim)), hosts=hosts, env=tree_env)
    # named by rank 0, or by the leader the victim's death cut them off from
    assert_the_others_raised_naming(procs, _finish(procs), victim, named)


def test_a_rank_that_never_comes_under_a_parent_is_named_exactly_and_its_subtree_hears_it(spawn_ranks, tree_env):
    procs = spawn_ranks(WORKER, 10, ranks=[0, 1, 2, 3, 4, 5, 6, 8, 9], args=("ok",), hosts=HOSTS,
                        env={**tree_env, "HVDRUN_START_TIMEOUT": "3"})
    outputs = _finish(procs)
    assert all(proc.returncode != 0 for proc in procs.values())
    for rank in (0, 2, 4, 6, 9):  # rank 0, the missing rank's parent host, another child of rank 0, its host, a sibling
        assert "ranks 7 never joined rank 0" in outputs[rank][1], (rank, outputs[rank][1][-2000:])


def test_hvdrun_over_ssh_builds_the_tree_on_four_real_hosts(run_hvdrun, hvdrun_env, ssh_hosts):
    """The launcher's side: past HVDRUN_RENDEZVOUS_FANOUT + 1 hosts it finds a free port on every inner host (its
    probe) and gives every rank the endpoints; with fan-out 2, rank 0's h1 admits h2 and h3, and h2 admits h4."""
    hvdrun_env["HVDRUN_RENDEZVOUS_FANOUT"] = "2"
    done = run_hvdrun("-H", ssh_hosts.hosts(1, count=4), *ssh_hosts.args(), WORKER, "stacks", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reports from ranks [0, 1, 2, 3], absent []" in done.stdout, done.stdout[-2000:]
    assert "rank 0 admitted 2 connections for 3 ranks" in done.stdout, done.stdout[-2000:]


def test_a_bad_fanout_is_a_usage_error(run_hvdrun, hvdrun_env, ssh_hosts):
    hvdrun_env["HVDRUN_RENDEZVOUS_FANOUT"] = "1"
    done = run_hvdrun("-H", ssh_hosts.hosts(1, count=2), *ssh_hosts.args(), WORKER, "ok", timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "HVDRUN_RENDEZVOUS_FANOUT='1': expected a whole number of hosts, at least 2" in done.stderr


def test_a_child_that_dies_during_the_gather_is_named_once_the_table_is_out_not_at_the_timeout(spawn_ranks, tree_env):
    """Host d's leader joins b's and dies while the job waits for rank 9: its records went up, so the gather
    completes once rank 9 comes; then b's leader names it on every rank, within seconds instead of at the start
    timeout (its own host's other rank fails at once, having lost its leader)."""
    env = {**tree_env, "HVDRUN_START_TIMEOUT": "60"}
    procs = spawn_ranks(WORKER, 10, ranks=list(range(9)), args=("ok",), hosts=HOSTS, env=env)
    assert wait_until(lambda: any(_leads(procs[rank].pid) for rank in (6, 7)), 60), "no rank of host d leads it"
    time.sleep(3)  # its records reached b's leader (10 processes share 2 cores in CI)
    leader = next(rank for rank in (6, 7) if _leads(procs[rank].pid))
    procs[leader].kill()
    procs[leader].wait(10)
    started = time.monotonic()
    procs.update(spawn_ranks(WORKER, 10, ranks=[9], args=("ok",), hosts=HOSTS, env=env,
                             rendezvous=spawn_ranks.rendezvous))
    outputs = _finish({rank: proc for rank, proc in procs.items() if rank != leader})
    assert time.monotonic() - started < 45, {rank: err[-600:] for rank, (_, err) in outputs.items()}  # no timeout
    for rank, (_, stderr) in outputs.items():
        assert procs[rank].returncode != 0
        if rank != 13 - leader:  # the leader's own host's other rank
            assert f"rank {leader} (host d," in stderr, (rank, stderr[-2000:])


def test_connections_that_never_authenticate_do_not_hold_up_a_parents_gather(spawn_ranks, tree_env):
    """Twenty silent connections to host b's tree port while its subtree joins: each handshake runs on its own
    thread and is dropped after its deadline, so the job starts as if they were not there."""
    port = int(tree_env["HVDRUN_RENDEZVOUS_TREE"].split(";")[1].split(",")[0].rpartition(":")[2])
    silent: list[socket.socket] = []

    def flood() -> None:
        deadline = time.monotonic() + 30
        while len(silent) < 20 and time.monotonic() < deadline:
            try:
                silent.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:
                time.sleep(0.02)

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    procs = spawn_ranks(WORKER, 10, args=("ok",), hosts=HOSTS, env=tree_env)
    outputs = _finish(procs)
    thread.join(5)
    for sock in silent:
        sock.close()
    assert len(silent) == 20, len(silent)
    for rank, (stdout, stderr) in outputs.items():
        assert procs[rank].returncode == 0 and f"rank {rank}: ok" in stdout, stderr[-2000:]
