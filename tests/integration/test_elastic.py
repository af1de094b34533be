"""Elastic training with real processes: ranks die, hosts join and leave discovery, the job goes on.

The training (workers/elastic_train.py) ends with the same weights as single-process full-batch
descent whatever the world size, so a run that lost or gained workers must still match it: that
proves the survivors restored the last commit and the joiners received the state.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import job_processes, wait_until

pytestmark = pytest.mark.integration

WORKERS = Path(__file__).parent / "workers"
TRAIN = str(WORKERS / "elastic_train.py")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def finals(stdout: str) -> list[dict]:
    """The FINAL line of every rank that finished."""
    found = []
    for match in re.finditer(r"FINAL rank (\d+) size (\d+) worker (\d+) resets (\d+) diff (\S+) weights (\[.*\])",
                             stdout):
        rank, size, worker, resets = map(int, match.groups()[:4])
        found.append({"rank": rank, "size": size, "worker": worker, "resets": resets,
                      "diff": float(match.group(5)), "weights": json.loads(match.group(6))})
    return sorted(found, key=lambda f: f["rank"])


def assert_trained_to_reference(stdout: str, size: int) -> list[dict]:
    done = finals(stdout)
    assert [f["rank"] for f in done] == list(range(size)), stdout[-3000:]
    assert all(f["size"] == size for f in done)
    assert max(f["diff"] for f in done) < 1e-9, [f["diff"] for f in done]
    assert all(f["weights"] == done[0]["weights"] for f in done)
    return done


def discovery_script(tmp_path: Path, hosts: str) -> tuple[Path, Path]:
    """A discovery script that prints the file it returns (tests rewrite the file)."""
    listing = tmp_path / "hosts.txt"
    listing.write_text(hosts + "\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    return script, listing


def start(hvdrun_env: dict[str, str], tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hvdrun", *args], env=hvdrun_env, cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("victim", [2, 0], ids=["rank-2", "rank-0-the-rendezvous-server"])
def test_killed_rank_mid_epoch_leaves_three_ranks_with_the_reference_model(run_hvdrun, hvdrun_env, tmp_path, victim):
    hvdrun_env.update(ELASTIC_STEPS="20", ELASTIC_KILL_WORKER=str(victim), ELASTIC_KILL_STEP="10",
                      OMP_NUM_THREADS="1")
    done = run_hvdrun("-np", "4", "-H", "localhost:4", "--min-np", "2", "--output-dir", "logs", TRAIN, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    survivors = assert_trained_to_reference(done.stdout, 3)
    assert sorted(f["worker"] for f in survivors) == sorted({0, 1, 2, 3} - {victim})
    assert all(f["resets"] == 1 for f in survivors)
    assert (f"worker {victim} (rank {victim}) on host localhost was killed by signal 9 (SIGKILL); 3 worker(s) go on"
            in done.stderr)
    assert "round 2: 3 rank(s) on 1 host(s)" in done.stderr
    # the survivors went back to the last commit (step 8) and trained on from there
    sizes_after_kill = re.findall(r"step (\d+) size 3", done.stdout)
    assert sizes_after_kill and int(sizes_after_kill[0]) == 9
    # output stays per worker across the reset: the victim's log ends with its death, the others' with FINAL
    assert "killing myself at step 10" in (tmp_path / "logs" / f"rank.{victim}" / "stdout").read_text()
    for worker in {0, 1, 2, 3} - {victim}:
        assert "FINAL" in (tmp_path / "logs" / f"rank.{worker}" / "stdout").read_text()


@pytest.mark.parametrize("backend", [{}, {"HVDRUN_BACKEND": "gloo"}], ids=["ring-shm", "gloo"])  # tcp: over SSH
def test_three_deaths_in_one_job_rank_zero_among_them(run_hvdrun, hvdrun_env, backend):
    hvdrun_env.update(ELASTIC_STEPS="30", ELASTIC_KILLS="2:5,0:13,4:21", OMP_NUM_THREADS="1", **backend)
    # cool-downs longer than the job: a refilled slot would add a round (a run under load can pass 60 s)
    done = run_hvdrun("-np", "5", "-H", "localhost:5", "--min-np", "2", "--blacklist-cooldown-range", "900", "900",
                      TRAIN, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    survivors = assert_trained_to_reference(done.stdout, 2)
    assert sorted(f["worker"] for f in survivors) == [1, 3] and all(f["resets"] == 3 for f in survivors)
    assert [int(n) for n in re.findall(r"round \d+: (\d+) rank", done.stderr)] == [5, 4, 3, 2]


def test_single_machine_survives_a_rank_death_and_refills_the_slot_after_its_cooldown(run_hvdrun, hvdrun_env,
                                                                                      tmp_path):
    script, _ = discovery_script(tmp_path, "localhost:3")
    hvdrun_env.update(ELASTIC_STEPS="60", ELASTIC_KILL_WORKER="1", ELASTIC_KILL_STEP="6", ELASTIC_STEP_SLEEP="0.1",
                      OMP_NUM_THREADS="1")
    done = run_hvdrun("--min-np", "2", "--host-discovery-script", str(script), "--blacklist-cooldown-range", "1", "1",
                      TRAIN, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = re.findall(r"round (\d+): (\d+) rank\(s\)", done.stderr)
    assert [int(n) for _, n in rounds][:2] == [3, 2], done.stderr  # the survivors went on alone first
    assert int(rounds[-1][1]) == 3  # then a new worker took the cooled-down slot
    final = assert_trained_to_reference(done.stdout, 3)
    assert 1 not in [f["worker"] for f in final] and 3 in [f["worker"] for f in final]



def test_a_worker_waiting_for_a_round_when_the_training_ends_leaves_and_the_job_succeeds(run_hvdrun, hvdrun_env):
    # the survivors never commit again, so they never learn of the slot refilled after its 1 s cool-down: the new
    # worker is still waiting for a round when they finish (it used to form one alone, without the state, and fail)
    hvdrun_env.update(ELASTIC_STEPS="24", ELASTIC_KILL_WORKER="1", ELASTIC_KILL_STEP="2", ELASTIC_STEP_SLEEP="0.25",
                      ELASTIC_COMMIT_EVERY="1000", OMP_NUM_THREADS="1")
    done = run_hvdrun("-np", "3", "-H", "localhost:3", "--min-np", "2", "--blacklist-cooldown-range", "1", "1",
                      TRAIN, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(f["worker"] for f in assert_trained_to_reference(done.stdout, 2)) == [0, 2]
    assert "worker 3 on host localhost leaves: the training ended before it joined a round" in done.stderr


def change_discovery_mid_training(hvdrun_env: dict[str, str], tmp_path: Path, before: str, after: str,
                                  token: str) -> tuple[str, str]:
    """Train from a discovery listing ``before``; once step 4 is done, the listing becomes ``after``."""
    script, listing = discovery_script(tmp_path, before)
    hvdrun_env.update(ELASTIC_STEPS="60", ELASTIC_STEP_SLEEP="0.1", ELASTIC_MARK_DIR=str(tmp_path),
                      OMP_NUM_THREADS="1")
    job = start(hvdrun_env, tmp_path, "--min-np", "2", "--host-discovery-script", str(script), TRAIN)
    try:
        assert wait_until(lambda: (tmp_path / "step4").exists(), 60), "training did not start"
        listing.write_text(after + "\n")
        stdout, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert wait_until(lambda: not job_processes(token))
    return stdout, stderr


def test_host_added_to_discovery_joins_and_the_world_grows(hvdrun_env, tmp_path, token):
    stdout, stderr = change_discovery_mid_training(hvdrun_env, tmp_path, "localhost:2", "localhost:3", token)
    final = assert_trained_to_reference(stdout, 3)
    assert {f["worker"] for f in final} == {0, 1, 2}
    assert re.search(r"round 2: 3 rank\(s\)", stderr)


def test_host_removed_from_discovery_leaves_cleanly(hvdrun_env, tmp_path, token):
    stdout, stderr = change_discovery_mid_training(hvdrun_env, tmp_path, "localhost:3", "localhost:2", token)
    assert_trained_to_reference(stdout, 2)
    assert "[2]<stderr>:hvdrun: elastic: this worker leaves the job: host localhost has 2 slot(s) now" in stderr
    assert "killed" not in stderr and "Traceback" not in stderr


def test_below_min_np_past_the_timeout_ends_the_job_naming_why(run_hvdrun, hvdrun_env):
    hvdrun_env.update(ELASTIC_STEPS="400", ELASTIC_KILL_WORKER="1", ELASTIC_KILL_STEP="5", OMP_NUM_THREADS="1")
    # 12 s: long enough for a worker to import torch and join on two cores under the suite's load (2-3 s idle,
    # 6 s and more seen in CI)
    done = run_hvdrun("-np", "2", "-H", "localhost:2", "--min-np", "2", "--elastic-timeout", "12", TRAIN, timeout=90)
    assert done.returncode == 128 + 9, done.stderr
    assert ("hvdrun: error: elastic job stopped: 1 worker(s) left, fewer than --min-np 2, for more than 12 s "
            "(--elastic-timeout); the last loss: worker 1 on host localhost was killed by signal 9 (SIGKILL)") \
        in done.stderr
    assert "Traceback" not in done.stderr


def test_reset_limit_stops_the_job(run_hvdrun, hvdrun_env):
    hvdrun_env.update(ELASTIC_STEPS="400", ELASTIC_KILL_WORKER="2", ELASTIC_KILL_STEP="3", OMP_NUM_THREADS="1")
    done = run_hvdrun("-np", "3", "-H", "localhost:3", "--min-np", "1", "--reset-limit", "0", TRAIN, timeout=60)
    assert done.returncode == 1
    assert "hvdrun: error: elastic job stopped: it needs reset 1, and --reset-limit is 0" in done.stderr


def test_horovods_elastic_synthetic_benchmark_survives_a_killed_worker(hvdrun_env, tmp_path, token):
    hvdrun_env["OMP_NUM_THREADS"] = "1"
    job = start(hvdrun_env, tmp_path, "-np", "3", "-H", "localhost:3", "--min-np", "2",
                str(EXAMPLES / "elastic_synthetic_benchmark.py"), "--num-iters", "12", "--batch-size", "8")
    lines: list[str] = []
    try:
        assert job.stdout is not None
        for line in job.stdout:
            lines.append(line)
            if "Iter #3:" in line:
                break
        victim = next(p for p in job_processes(token) if p.environ().get("HVDRUN_WORKER_ID") == "2"
                      and "elastic_synthetic_benchmark.py" in " ".join(p.cmdline()) and "guard" not in
                      " ".join(p.cmdline()))
        victim.kill()
        stdout, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    output = "".join(lines) + stdout
    assert job.returncode == 0, stderr[-3000:]
    assert "(3 workers)" in output and "(2 workers)" in output
    assert re.search(r"Img/sec per CPU: [\d.]+ over 12 iterations; 2 workers at the end", output)
    assert wait_until(lambda: not job_processes(token))


@pytest.mark.parametrize("args, message", [
    (["--min-np", "3", "--max-np", "2"], "--max-np 2 is below --min-np 3"),
    (["--min-np", "1", "--launcher", "mpiexec"], "elastic jobs (--min-np/--max-np/--host-discovery-script) run "
                                                  "with the local or ssh launcher, not mpiexec"),
])
def test_bad_elastic_options_are_usage_errors(run_hvdrun, args, message):
    done = run_hvdrun("-np", "2", *args, "true")
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_bad_discovery_output_is_a_usage_error_naming_the_line(run_hvdrun, tmp_path):
    script, _ = discovery_script(tmp_path, "localhost:2\nnode;rm -rf /:3")
    done = run_hvdrun("--host-discovery-script", str(script), "true")
    assert done.returncode == 2
    assert f"--host-discovery-script {script}, line 2" in done.stderr and "Traceback" not in done.stderr


def test_over_ssh_a_remote_rank_dies_and_a_new_host_joins(hvdrun_env, ssh_hosts, tmp_path, token):
    first, fourth = ssh_hosts.addrs[:3], ssh_hosts.addrs[3]
    script, listing = discovery_script(tmp_path, "\n".join(f"{addr}:1" for addr in first))
    hvdrun_env.update(ELASTIC_STEPS="80", ELASTIC_KILL_WORKER="1", ELASTIC_KILL_STEP="9", ELASTIC_STEP_SLEEP="0.1",
                      ELASTIC_MARK_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    job = start(hvdrun_env, tmp_path, "--min-np", "2", "--host-discovery-script", str(script), *ssh_hosts.args(),
                TRAIN)
    try:  # rank 0 runs on h1 and marks its steps in tmp_path, which every namespace host shares
        assert wait_until(lambda: (tmp_path / "step16").exists(), 90), "training did not go on after the death"
        listing.write_text("\n".join(f"{addr}:1" for addr in [*first, fourth]) + "\n")
        stdout, stderr = job.communicate(timeout=150)
    finally:
        job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert f"worker 1 (rank 1) on host {first[1]} was killed by signal 9 (SIGKILL)" in stderr
    assert [int(n) for n in re.findall(r"round \d+: (\d+) rank", stderr)] == [3, 2, 3], stderr[-2000:]
    final = assert_trained_to_reference(stdout, 3)
    assert sorted(f["worker"] for f in final) == [0, 2, 3]  # worker 3 is the one started on h4
    assert wait_until(lambda: not job_processes(token))


def test_no_process_outlives_an_interrupted_elastic_job(hvdrun_env, tmp_path, token):
    hvdrun_env.update(ELASTIC_STEPS="100000", ELASTIC_STEP_SLEEP="0.05", ELASTIC_MARK_DIR=str(tmp_path),
                      OMP_NUM_THREADS="1")
    job = start(hvdrun_env, tmp_path, "-np", "2", "-H", "localhost:2", "--min-np", "1", TRAIN)
    try:
        assert wait_until(lambda: (tmp_path / "step3").exists(), 60)
        time.sleep(0.2)
        job.send_signal(2)
        _, stderr = job.communicate(timeout=30)
    finally:
        job.kill()
    assert job.returncode == 130 and "received SIGINT; stopped every worker" in stderr
    assert wait_until(lambda: not job_processes(token)), [p.cmdline() for p in job_processes(token)]


def test_discovery_lines_parse_like_horovods():
    from hvdrun.launch.elastic.discovery import DiscoveryError, parse_discovery_output

    hosts = parse_discovery_output("a:4\nb\n# spare\n\nroot@c:2  # comment\n", "d.sh", 8)
    assert [(h.name, h.slots, h.user) for h in hosts] == [("a", 4, None), ("b", 8, None), ("c", 2, "root")]
    with pytest.raises(DiscoveryError, match="listed more than once"):
        parse_discovery_output("a:1\na:2\n", "d.sh", 1)
    with pytest.raises(DiscoveryError, match="line 1"):
        parse_discovery_output("a:zero\n", "d.sh", 1)


def test_elastic_sampler_resumes_the_unprocessed_samples():
    from hvdrun.torch.elastic import ElasticSampler

    sampler = ElasticSampler(list(range(10)), shuffle=False)
    assert list(sampler) == list(range(10)) and len(sampler) == 10
    sampler.record_batch(0, 4)
    sampler.load_state_dict(sampler.state_dict())
    assert list(sampler) == list(range(4, 10))
    sampler.set_epoch(1)
    shuffled = ElasticSampler(list(range(10)), shuffle=True, seed=3)
    shuffled.set_epoch(1)
    assert sorted(shuffled) == list(range(10)) and list(shuffled) != list(range(10))

