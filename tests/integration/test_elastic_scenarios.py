"""Horovod's elastic integration scenarios for torch, run with hvdrun and checked epoch by epoch.

Horovod's own suite (test/integration/elastic_common.py with data/elastic_torch_main.py) trains a
few epochs while a discovery script, driven by the number of epochs logged so far, adds and removes
hosts, and ranks fail by exception or by SIGKILL; rank 0 logs each epoch's host, start rank, size
and round. The same scenarios run here on this machine with two host names, ``localhost`` and
``127.0.0.1`` (both local, so the local launcher starts every worker), and the same expected epochs.

Where hvdrun differs on purpose, the tests say so: with a fixed ``-H`` list ``-np`` caps the workers
(Horovod starts every slot), and ``--blacklist-scope slot`` keeps a failed worker's host-mates
(Horovod's blacklist, hvdrun's default for jobs on several hosts, removes them).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

WORKER = str(Path(__file__).parent / "workers" / "elastic_epochs.py")
A, B = "localhost", "127.0.0.1"  # two hosts in name, one machine

Schedule = list[tuple[int | None, list[str]]]


def discovery_by_epoch(tmp_path: Path, schedule: Schedule, log: Path) -> Path:
    """A discovery script that prints the hosts the schedule gives the epoch now running: the number of
    lines rank 0 has logged (the epochs done); an entry with epoch None answers every other epoch."""
    cases = [f"  {'*' if epoch is None else epoch}) printf '%s\\n' {' '.join(map(shlex.quote, hosts))} ;;"
             for epoch, hosts in sorted(schedule, key=lambda entry: entry[0] is None)]
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\n"
                      f"epoch=$(cat {shlex.quote(str(log))} 2>/dev/null | wc -l | tr -d ' ')\n"
                      'case "$epoch" in\n' + "\n".join(cases) + "\nesac\n")
    script.chmod(0o755)
    return script


def run_scenario(run_hvdrun, hvdrun_env, tmp_path: Path, options: list[str], schedule: Schedule,
                 fail: dict[tuple[int, int], list[int]] | None = None, fail_mode: str = "exception",
                 fixed_hosts: bool = False):
    """Run the epoch worker under ``hvdrun OPTIONS`` with hosts from ``schedule`` (a discovery script, or
    ``-H`` with its only entry when ``fixed_hosts``); returns the finished process and the logged epochs."""
    log = tmp_path / "epochs.jsonl"
    if fixed_hosts:
        (_, hosts), = schedule
        where = ["-H", ",".join(hosts)]
    else:
        where = ["--host-discovery-script", str(discovery_by_epoch(tmp_path, schedule, log))]
    hvdrun_env["OMP_NUM_THREADS"] = "1"
    failures = {f"{epoch},{batch}": ranks for (epoch, batch), ranks in (fail or {}).items()}
    done = run_hvdrun(*options, *where, WORKER, "--log", str(log), "--hosts-by-epoch", json.dumps(schedule),
                      "--fail", json.dumps(failures), "--fail-mode", fail_mode, timeout=120)
    epochs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return done, epochs


def summary(epochs: list[dict]) -> list[tuple[str, int, int, int]]:
    """(host, start rank, size, round) of rank 0 in each epoch: what Horovod's tests compare."""
    return [(e["hostname"], e["start_rank"], e["size"], e["rounds"]) for e in epochs]


# -- hosts added and removed ---------------------------------------------------------------------------------

def add_then_remove(slots: int) -> Schedule:
    """Epoch 0 on A, epoch 1 on A and B, every later epoch on B alone."""
    return [(0, [f"{A}:{slots}"]), (1, [f"{A}:{slots}", f"{B}:{slots}"]), (None, [f"{B}:{slots}"])]


@pytest.mark.parametrize("slots", [2])  # 1 slot a host: the same path (suite time)
def test_hosts_added_and_removed(run_hvdrun, hvdrun_env, tmp_path, slots):
    """B's workers join for epoch 1 and A's leave for epoch 2: rank 0 is A's first worker until A leaves, then
    B's first worker (started with rank ``slots``). Two resets: with two slots a host, the job also runs under
    Horovod's reset-limit scenario's passing limit, --reset-limit 2."""
    limit = ["--reset-limit", "2"] if slots == 2 else []
    done, epochs = run_scenario(run_hvdrun, hvdrun_env, tmp_path,
                                ["-np", str(slots), "--min-np", str(slots), "--max-np", str(2 * slots), *limit],
                                add_then_remove(slots))
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary(epochs) == [(A, 0, slots, 1), (A, 0, 2 * slots, 2), (B, slots, slots, 3)], done.stderr[-3000:]
    assert f"<stderr>:hvdrun: elastic: this worker leaves the job: host {A} left discovery script" in done.stderr


# -- a single rank fails --------------------------------------------------------------------------------------

BOTH_HOSTS: Schedule = [(None, [f"{A}:2", f"{B}:2"])]
START_RANK_0_FAILS_IN_EPOCH_1 = {(1, 0): [0]}


@pytest.mark.parametrize("fail_mode, fixed_hosts", [("kill", False), ("exception", True)],
                         ids=["kill", "exception-fixed-hosts"])  # each way to fail, each way to find hosts
def test_single_rank_failure_blacklists_its_host(run_hvdrun, hvdrun_env, tmp_path, fail_mode, fixed_hosts):
    """Horovod's expectation (its default, and hvdrun's for a job on two hosts): rank 0 fails at the start of
    epoch 1, host A is blacklisted, its other worker leaves, and B's two workers train on (rank 0: start rank 2).
    With fixed hosts (Horovod's test_fault_tolerance_without_scaling) hvdrun needs -np 4 for four workers, where
    Horovod takes every slot of -H."""
    options = ["-np", "4" if fixed_hosts else "2", "--min-np", "2", *([] if fixed_hosts else ["--max-np", "4"])]
    done, epochs = run_scenario(run_hvdrun, hvdrun_env, tmp_path, options, BOTH_HOSTS,
                                START_RANK_0_FAILS_IN_EPOCH_1, fail_mode, fixed_hosts)
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary(epochs) == [(A, 0, 4, 1), (B, 2, 2, 2), (B, 2, 2, 2)], done.stderr[-3000:]
    assert f"hvdrun: elastic: host {A} is blacklisted for " in done.stderr
    assert "after worker 0 failed on it: no worker starts there until then; worker(s) 1 leave at the next round " \
           "(--blacklist-scope host)" in done.stderr
    assert f"[1]<stderr>:hvdrun: elastic: this worker leaves the job: host {A} is blacklisted" in done.stderr


def test_single_rank_failure_with_slot_scope_keeps_the_host_mates(run_hvdrun, hvdrun_env, tmp_path):
    """hvdrun's --blacklist-scope slot: only the failed slot cools down, so A's second worker stays and
    becomes rank 0 (start rank 1) of three."""
    options = ["-np", "2", "--min-np", "2", "--max-np", "4", "--blacklist-scope", "slot"]
    done, epochs = run_scenario(run_hvdrun, hvdrun_env, tmp_path, options, BOTH_HOSTS,
                                START_RANK_0_FAILS_IN_EPOCH_1, "exception")
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary(epochs) == [(A, 0, 4, 1), (A, 1, 3, 2), (A, 1, 3, 2)], done.stderr[-3000:]
    assert f"hvdrun: elastic: slot 0 of host {A} cools down for " in done.stderr
    assert "leaves the job" not in done.stderr


def test_a_job_that_grows_onto_a_second_host_blacklists_hosts_from_then_on(run_hvdrun, hvdrun_env, tmp_path):
    """Without --blacklist-scope the scope is decided at each failure: the job starts on A alone (slot scope), B
    joins for epoch 1, and when start rank 0 fails in epoch 2 host A is blacklisted, as Horovod does."""
    options = ["-np", "2", "--min-np", "2", "--max-np", "4"]
    done, epochs = run_scenario(run_hvdrun, hvdrun_env, tmp_path, options, [(0, [f"{A}:2"]), (None, BOTH_HOSTS[0][1])],
                                {(2, 0): [0]})
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary(epochs) == [(A, 0, 2, 1), (A, 0, 4, 2), (B, 2, 2, 3)], done.stderr[-3000:]
    assert "after worker 0 failed on it: no worker starts there until then; worker(s) 1 leave at the next round " \
           "(--blacklist-scope host)" in done.stderr


# -- one rank on each host fails ------------------------------------------------------------------------------

def test_all_hosts_blacklisted_ends_the_job(run_hvdrun, hvdrun_env, tmp_path):
    """Start ranks 0 (on A) and 2 (on B) fail together: both hosts are blacklisted and the job fails, as in
    Horovod."""
    done, epochs = run_scenario(run_hvdrun, hvdrun_env, tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "4"],
                                BOTH_HOSTS, {(1, 0): [0, 2]})
    assert done.returncode == 1, done.stderr[-3000:]
    assert "hvdrun: error: elastic job stopped: 0 worker(s) left, fewer than --min-np 2, and every host is cooling " \
           "down after a failure; the last loss: worker " in done.stderr
    assert summary(epochs) == [(A, 0, 4, 1)]


def test_all_hosts_lose_a_rank_with_slot_scope_and_the_others_go_on(run_hvdrun, hvdrun_env, tmp_path):
    """The same failures with --blacklist-scope slot: start ranks 1 and 3 are left, enough for --min-np 2."""
    options = ["-np", "2", "--min-np", "2", "--max-np", "4", "--blacklist-scope", "slot"]
    done, epochs = run_scenario(run_hvdrun, hvdrun_env, tmp_path, options, BOTH_HOSTS, {(1, 0): [0, 2]})
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary(epochs) == [(A, 0, 4, 1), (A, 1, 2, 2), (A, 1, 2, 2)], done.stderr[-3000:]


def test_all_ranks_failing_ends_the_job(run_hvdrun, hvdrun_env, tmp_path):
    """Horovod's test_all_ranks_failure: every worker fails at the start of epoch 1; the job fails and says why."""
    done, epochs = run_scenario(run_hvdrun, hvdrun_env, tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "4"],
                                BOTH_HOSTS, {(1, 0): [0, 1, 2, 3]})
    assert done.returncode == 1, done.stderr[-3000:]
    assert "hvdrun: error: elastic job stopped: 0 worker(s) left, fewer than --min-np 2, and every host is cooling " \
           "down after a failure; the last loss: worker " in done.stderr
    assert summary(epochs) == [(A, 0, 4, 1)]


def test_too_few_workers_past_the_elastic_timeout_ends_the_job(run_hvdrun, hvdrun_env, tmp_path):
    """Horovod's test_min_hosts_timeout: four workers, --min-np 4, start rank 0 fails and its host is blacklisted;
    two workers are left and no host can replace the others, so the job ends after --elastic-timeout (Horovod's
    test sets 1 s; hvdrun's timeout also bounds a new worker's start, so it leaves the workers time to start)."""
    options = ["-np", "4", "--min-np", "4", "--max-np", "4", "--elastic-timeout", "10"]
    done, epochs = run_scenario(run_hvdrun, hvdrun_env, tmp_path, options, BOTH_HOSTS, START_RANK_0_FAILS_IN_EPOCH_1)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "hvdrun: error: elastic job stopped: 2 worker(s) left, fewer than --min-np 4, for more than 10 s " \
           f"(--elastic-timeout); the last loss: worker 0 on host {A} " in done.stderr
    assert summary(epochs) == [(A, 0, 4, 1)]


# -- reset limit ----------------------------------------------------------------------------------------------

def test_reset_limit_one_fails_at_the_second_reset(run_hvdrun, hvdrun_env, tmp_path):
    """Adding B is the first reset, removing A the second: a limit of 1 stops the job after epoch 1 (a limit of
    2 lets it finish: test_hosts_added_and_removed[2])."""
    options = ["-np", "2", "--min-np", "2", "--max-np", "4", "--reset-limit", "1"]
    done, epochs = run_scenario(run_hvdrun, hvdrun_env, tmp_path, options, add_then_remove(2))
    assert done.returncode == 1
    assert "hvdrun: error: elastic job stopped: it needs reset 2, and --reset-limit is 1" in done.stderr
    assert summary(epochs) == [(A, 0, 2, 1), (A, 0, 4, 2)]
