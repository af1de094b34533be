"""The runtime with real processes: collectives against NumPy, faults, security, lifecycle, backends."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hvdrun.protocol.wire import AuthError, authenticate_server
from tests.conftest import REPO

pytestmark = pytest.mark.integration
WORKERS = Path(__file__).parent / "workers"


def worker(name: str) -> str:
    return str(WORKERS / name)


def ranks_reporting(stdout: str, pattern: str) -> set[int]:
    return {int(m.group(1)) for m in re.finditer(r"^\[(\d+)\]<stdout>:" + pattern, stdout, re.MULTILINE)}


@pytest.mark.parametrize("size", [1, 2, 3, 4])  # odd and even; dtypes.py sweeps 2 and 4 ranks too; 16 ranks:
# test_scale_out.py (suite time: 8 ranks here took 10 s on 2 cores)
def test_every_collective_dtype_and_op_against_numpy(run_hvdrun, size):
    result = run_hvdrun("-np", str(size), worker("collectives.py"), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ranks_reporting(result.stdout, r"rank \d+: \d+ checks passed") == set(range(size))


DEVICE_PATH_ON_CPU = {"HVDRUN_DEVICE_BACKEND": "gloo", "HVDRUN_CPU_VIA_DEVICE_BACKEND": "1"}


@pytest.mark.parametrize("env", [{"HVDRUN_TRANSPORT": "tcp"}, {"HVDRUN_BACKEND": "gloo"}, DEVICE_PATH_ON_CPU],
                         ids=["tcp", "gloo", "device-path"])
def test_collectives_over_tcp_gloo_and_the_device_path(run_hvdrun, hvdrun_env, env):
    hvdrun_env.update(env)
    result = run_hvdrun("-np", "3", worker("collectives.py"), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ranks_reporting(result.stdout, r"rank \d+: \d+ checks passed") == {0, 1, 2}


def launcher_free_env() -> dict[str, str]:
    """This process's environment without any launcher's variables: a job of one rank."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("HVDRUN_", "OMPI_", "PMI_", "SLURM"))}


def test_device_path_with_a_single_rank(tmp_path):
    result = subprocess.run([sys.executable, worker("collectives.py")],
                            env={**launcher_free_env(), "HVDRUN_CPU_VIA_DEVICE_BACKEND": "1"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0: 225 checks passed" in result.stdout


def test_shared_memory_within_hosts_and_tcp_between(run_hvdrun):
    result = run_hvdrun("-H", "localhost:2,127.0.0.1:2", worker("collectives.py"), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ranks_reporting(result.stdout, r"rank \d+: \d+ checks passed") == {0, 1, 2, 3}


def test_async_ops_in_different_orders(run_hvdrun):
    result = run_hvdrun("-np", "4", worker("order.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert ranks_reporting(result.stdout, r"rank \d+: order ok") == {0, 1, 2, 3}


PASSIVE_WAITS = {"HVDRUN_WAIT_POLICY": "passive"}


@pytest.mark.parametrize(("ranks", "lane", "env"),
                         [(2, "1", {}), (2, "0", PASSIVE_WAITS), (4, "1", {}), (2, "1", DEVICE_PATH_ON_CPU)],
                         ids=["fast-lane", "engine-only", "fast-lane-4-ranks", "device-path-express"])
def test_fast_lane_exact_ordered_mismatched_joined_threaded_and_long(run_hvdrun, hvdrun_env, ranks, lane, env):
    hvdrun_env.update({"HVDRUN_FAST_LANE": lane, **env})
    result = run_hvdrun("-np", str(ranks), worker("fast_lane.py"), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    checks = re.findall(r"CHECK (\S+) rank (\d): (.*)", result.stdout)
    assert len(checks) == ranks * 12 and all(verdict == "ok" for _, _, verdict in checks), checks
    # waits spin while a rank has a core of its own (auto, the default), else sleep at once (auto past the cores, or
    # passive)
    policy = hvdrun_env.get("HVDRUN_WAIT_POLICY", "auto")
    spinning = policy == "active" or (policy == "auto" and ranks <= (os.cpu_count() or 1))
    waits = re.findall(r"WAIT rank \d spin (\S+) s, lane spins (\S+)", result.stdout)
    expected = ("0.001", "200" if lane == "1" else "-") if spinning else ("0", "0" if lane == "1" else "-")
    assert waits == [expected] * ranks, waits
    used = [int(n) for n in re.findall(r"LANE rank \d used (-?\d+)", result.stdout)]
    express = [int(n) for n in re.findall(r"EXPRESS rank \d used (\d+)", result.stdout)]
    if env is DEVICE_PATH_ON_CPU:  # tensors on the device path: the lane takes only the barriers, express cycles
        # the allreduces
        assert min(express) > 100 and len(set(used)) == 1, (used, express)
    elif lane == "1":  # the lane took the blocking small allreduces and barriers (the same ones on every rank)
        assert used[0] > 300 and len(set(used)) == 1, used
    else:  # off, the lane is never built and every op takes the engine's queued path
        assert used == [-1] * ranks and express == [0] * ranks, (used, express)


def test_mismatches_raise_on_every_rank_naming_op_and_ranks(run_hvdrun):
    result = run_hvdrun("-np", "3", worker("mismatch.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    expected = {
        "shape": "allreduce 'shape': shape differs across ranks (rank 0: (3,); ranks 1, 2: (4,))",
        "dtype": "allreduce 'dtype': dtype differs across ranks (rank 0: float32; ranks 1, 2: float64)",
        "op": "allreduce 'op': reduction op differs across ranks (rank 0: Sum; ranks 1, 2: Max)",
        "root": "broadcast 'root': root rank differs across ranks (rank 0: 0; rank 1: 1; rank 2: 2)",
        "kind": "allreduce 'kind': operation differs across ranks (rank 0: allreduce; ranks 1, 2: allgather)",
    }
    for case, message in expected.items():
        for rank in range(3):
            assert f"[{rank}]<stdout>:rank {rank} {case}: {message}" in result.stdout


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_each_rank_sends_2_n_minus_1_over_n_of_the_buffer(run_hvdrun, hvdrun_env, size, transport):
    hvdrun_env["HVDRUN_TRANSPORT"] = transport
    result = run_hvdrun("-np", str(size), worker("bytes_sent.py"), "3000")
    assert result.returncode == 0, result.stderr[-3000:]
    total = 3000 * size * 2 * 4
    sent = 2 * (size - 1) * total // size
    channel = "TcpTx" if transport == "tcp" else "ShmTx"
    assert ranks_reporting(result.stdout, rf"rank \d+: sent {sent} bytes for S={total} N={size} over {channel}") \
        == set(range(size))


def test_init_shutdown_a_hundred_times_and_calls_before_init(run_hvdrun):
    result = run_hvdrun("-np", "2", worker("lifecycle.py"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("lifecycle ok: 100 cycles") == 2


def test_size_one_without_any_launcher(tmp_path):
    result = subprocess.run([sys.executable, worker("lifecycle.py")], env=launcher_free_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "lifecycle ok" in result.stdout


def test_stalled_rank_is_named_then_every_rank_raises(run_hvdrun, hvdrun_env):
    hvdrun_env.update(HVDRUN_STALL_CHECK_TIME_SECONDS="1", HVDRUN_STALL_SHUTDOWN_TIME_SECONDS="3")
    result = run_hvdrun("-np", "3", worker("stall.py"))
    assert "hvdrun: warning: 1 collective(s) waited more than 1 s for some ranks: 'late' missing rank 1" in \
        result.stderr
    assert ranks_reporting(result.stdout, r"rank \d+ raised: stalled: .*'late' missing rank 1") == {0, 1, 2}
    # rank 0 said where every rank was with the warning, and again a second before the shutdown
    for moment in ("as the stall check warns", "as the stall check fails the job"):
        report = result.stderr.split(f"[0]<stderr>:hvdrun: where every rank is, {moment}\n", 1)[1]
        assert report.startswith("[0]<stderr>:hvdrun: stacks of 3 of 3 rank(s)\n[0]<stderr>:first divergence: rank 1 "
                                 "has not reached #1 allreduce 'late' that ranks 0,2 wait in: rank 1 has run no "
                                 "collective yet and waits in no collective (main thread at stall.py:"), report


def test_a_failure_reported_while_ranks_wait_on_gloo_ends_their_wait(spawn_ranks):
    """gloo cannot interrupt an op and sees a peer's end only on the connections the op waits on; an alive peer's
    engine even keeps completing negotiation cycles with them. The job's abort must still end the wait on every
    rank, naming the failure (the group's timeout is 300 s here)."""
    procs = spawn_ranks(worker("gloo_abort.py"), 3, env={"HVDRUN_BACKEND": "gloo", "HVDRUN_START_TIMEOUT": "300"})
    try:
        for rank in (0, 1):
            stdout, stderr = procs[rank].communicate(timeout=60)  # a bound against the hang, not a timing claim
            assert procs[rank].returncode == 0, stderr[-2000:]
            assert f"rank {rank} raised: rank 2 gave up on purpose" in stdout, (stdout, stderr[-2000:])
    finally:
        procs[2].kill()


TWO_HOSTS = [("a", 2), ("b", 2)]


@pytest.mark.parametrize(("victim", "hosts", "elements"),
                         [(1, None, 100_000), (0, None, 100_000), (1, TWO_HOSTS, 100_000), (2, TWO_HOSTS, 100_000),
                          (1, TWO_HOSTS, 1000), (0, TWO_HOSTS, 1000), (3, TWO_HOSTS, 1000)],
                         ids=["rank-1-dies", "rank-0-dies", "2x2-local-peer-dies", "2x2-other-host-dies",
                              "2x2-whole-ops-local-peer-dies", "2x2-whole-ops-leader-dies",
                              "2x2-whole-ops-other-host-dies"])
def test_killed_peer_makes_every_other_rank_raise(spawn_ranks, compiled_built, victim, hosts, elements):
    """One host, and 2 hosts x 2 (the survivors wait on their host's post board or a link across hosts); with
    small named ops the survivors wait inside the compiled module's whole ops (HVDRUN_COMPILED=on): on the board
    for the host's posts or the leader's result, or on the socket across hosts."""
    whole = elements < 100_000
    env = {"HVDRUN_COMPILED": "on"} if whole else None
    args = (str(victim), str(elements), "50" if whole else "-1")
    procs = spawn_ranks(worker("killed_peer.py"), 4, args=args, hosts=hosts, env=env)
    outputs = {}
    for rank, proc in procs.items():
        outputs[rank] = proc.communicate(timeout=60)
    assert procs[victim].returncode == -9
    survivors = [r for r in procs if r != victim]
    for rank in survivors:
        stdout, stderr = outputs[rank]
        assert procs[rank].returncode == 0, stderr[-2000:]
        raised = re.search(r"raised after ([\d.]+) s \((\d+) whole ops\)", stdout)
        assert float(raised.group(1)) < 30, stdout  # a bound against hanging, not a timing claim
        assert not whole or int(raised.group(2)) >= 40, stdout  # the steps before the death ran whole
        assert f"rank {victim}" in stdout or "rank 0" in stdout, stdout


def test_connection_without_the_secret_is_refused(spawn_ranks):
    procs = spawn_ranks(worker("order.py"), 2, ranks=[0])
    rendezvous = spawn_ranks.rendezvous
    deadline = time.monotonic() + 30
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", rendezvous.port), timeout=5)
            break
        except OSError:
            assert time.monotonic() < deadline, "rank 0 never listened"
            time.sleep(0.05)
    with sock, pytest.raises(AuthError, match="refused our secret"):
        authenticate_server(sock, b"not-the-job-secret", "rank 0")
    with socket.create_connection(("127.0.0.1", rendezvous.port), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(64))
        raw.settimeout(10)
        assert raw.recv(4) == b"HVD1"  # the greeting, then the connection is dropped for the bad answer
    procs.update(spawn_ranks(worker("order.py"), 2, ranks=[1], rendezvous=rendezvous))
    for rank, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0 and f"rank {rank}: order ok" in stdout, stderr[-2000:]


def test_rendezvous_timeout_names_the_missing_ranks(spawn_ranks):
    procs = spawn_ranks(worker("order.py"), 3, ranks=[0], env={"HVDRUN_START_TIMEOUT": "2"})
    stdout, stderr = procs[0].communicate(timeout=60)
    assert procs[0].returncode != 0
    assert "rendezvous timed out: ranks 1, 2 never joined rank 0" in stderr


MPIEXEC = Path(sys.executable).with_name("mpiexec")


@pytest.mark.skipif(not MPIEXEC.exists() and not shutil.which("mpiexec"), reason="mpich wheel not installed")
def test_mpi_backend_under_mpiexec(tmp_path, hvdrun_env):
    env = {k: v for k, v in hvdrun_env.items() if not k.startswith("HVDRUN_") or k == "HVDRUN_TEST_TOKEN"}
    result = subprocess.run([str(MPIEXEC if MPIEXEC.exists() else "mpiexec"), "-n", "2", sys.executable,
                             worker("collectives.py")], env={**env, "OMP_NUM_THREADS": "1"}, cwd=REPO,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(re.findall(r"rank \d: \d+ checks passed", result.stdout)) == 2


@pytest.mark.parametrize("backend", ["ring", "gloo"])
def test_a_job_on_one_machine_listens_on_loopback_only(run_hvdrun, backend):
    done = run_hvdrun("-np", "2", "-x", f"HVDRUN_BACKEND={backend}", "-x", "HVDRUN_TRANSPORT=tcp",
                      str(WORKERS / "listening.py"))
    assert done.returncode == 0, done.stderr
    lines = [line.split("LISTEN ", 1)[1] for line in done.stdout.splitlines() if "LISTEN " in line]
    reports = sorted((json.loads(line) for line in lines), key=lambda r: r["rank"])
    assert len(reports) == 2 and reports[0]["addresses"], reports  # rank 0 at least serves the rendezvous
    assert all(set(r["addresses"]) <= {"127.0.0.1"} for r in reports), reports


def wait_for_listener(port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return
        except OSError:
            assert time.monotonic() < deadline, "rank 0 never listened"
            time.sleep(0.05)


def test_silent_slow_and_flooding_connections_are_dropped_and_the_job_still_forms(spawn_ranks):
    procs = spawn_ranks(worker("order.py"), 2, ranks=[0])
    port = spawn_ranks.rendezvous.port
    wait_for_listener(port)
    silent = socket.create_connection(("127.0.0.1", port), timeout=5)
    slow = socket.create_connection(("127.0.0.1", port), timeout=5)
    flood = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(60)]
    silent.settimeout(30)
    while silent.recv(4096):  # the greeting, then EOF once the handshake deadline passed
        pass
    # a byte a second, 20 of the 64 (nonce + HMAC) the server waits for: only a deadline on the whole
    # handshake ends it (a timeout per recv never fires)
    for _ in range(20):
        try:
            slow.sendall(b"x")
        except OSError:
            break
        time.sleep(1)
    else:
        raise AssertionError("a connection trickling bytes was kept without ever authenticating")
    procs.update(spawn_ranks(worker("order.py"), 2, ranks=[1], rendezvous=spawn_ranks.rendezvous))
    for rank, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0 and f"rank {rank}: order ok" in stdout, stderr[-2000:]
    for sock in [silent, slow, *flood]:
        sock.close()


def test_a_rendezvous_port_taken_meanwhile_is_retried_then_named(spawn_ranks):
    from hvdrun.envvars import Rendezvous
    from hvdrun.launch.remote.hostfacts import free_ports

    port, master = free_ports(2)
    squatter = socket.create_server(("127.0.0.1", port))
    rendezvous = Rendezvous("127.0.0.1", port, master, "ab" * 32, "tport")
    # flat: rank 1 joins rank 0 over TCP itself (by default it would join through its host's leader, rank 0's
    # local socket, and never meet the squatter)
    procs = spawn_ranks(worker("order.py"), 2, rendezvous=rendezvous,
                        env={"HVDRUN_START_TIMEOUT": "20", "HVDRUN_RENDEZVOUS": "flat"})
    squatter.settimeout(15)
    caught, _ = squatter.accept()  # rank 1 reached the squatter instead of rank 0
    caught.close()
    squatter.close()  # freed within the retry window: rank 0 binds, rank 1 tries again, the job forms
    for rank, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0 and f"rank {rank}: order ok" in stdout, stderr[-2000:]
    squatter = socket.create_server(("127.0.0.1", port))
    try:
        procs = spawn_ranks(worker("order.py"), 1, rendezvous=Rendezvous("127.0.0.1", port, master, "ab" * 32, "tp2"),
                            env={"HVDRUN_RANK": "0", "HVDRUN_SIZE": "2", "HVDRUN_START_TIMEOUT": "20"})
        _, stderr = procs[0].communicate(timeout=60)
    finally:
        squatter.close()
    assert procs[0].returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use; the port hvdrun chose was taken" in stderr
    assert "OSError" not in stderr.splitlines()[-1]


DTYPE_BACKENDS = {"shm-ring+lane": {}, "tcp-ring": {"HVDRUN_TRANSPORT": "tcp"}, "gloo": {"HVDRUN_BACKEND": "gloo"},
                  "device-path": DEVICE_PATH_ON_CPU}
ALL_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "bfloat16", "float16", "float32", "float64")
LANE_DTYPES = {"uint8", "int8", "int16", "int32", "int64", "float32", "float64"}  # float16/bfloat16 widen on the engine


def dtype_rows() -> set[str]:
    """What tests/integration/workers/dtypes.py must report: every dtype through every collective and op."""
    ops = ("sum", "average", "min", "max", "product")
    rows = {f"{dtype} {kind}-{op}" for dtype in ALL_DTYPES for op in ops for kind in ("allreduce", "reducescatter")}
    rows |= {f"{dtype} {kind}" for dtype in ALL_DTYPES + ("bool",)
             for kind in ("grouped-reducescatter", "allgather", "grouped-allgather", "broadcast", "alltoall")}
    rows |= {f"{dtype} adasum" for dtype in ("bfloat16", "float16", "float32", "float64")}
    return rows | {f"bool {kind}-{op}" for kind in ("allreduce", "reducescatter") for op in ("min", "max")} | {
        "bool refuses-sum-average-product", "float16-against-bfloat16 refused"}


def assert_dtype_table(stdout: str, size: int, lane: bool = False) -> None:
    """Every row on rank 0, every rank's count; with ``lane``, the fast lane served blocking allreduces of every
    dtype it takes (each dtype's five ops are attempted there)."""
    passed = {int(rank) for rank in re.findall(rf"rank (\d+): {len(dtype_rows())} dtype checks passed", stdout)}
    assert passed == set(range(size)), stdout[-3000:]
    rows = set(re.findall(r"^(?:\[0\]<stdout>:)?row (.+)$", stdout, re.MULTILINE))
    assert rows == dtype_rows(), rows ^ dtype_rows()
    errors = re.search(r"precision bfloat16=([\d.]+)ulp float16=([\d.]+)ulp", stdout)
    assert errors and max(map(float, errors.groups())) <= 0.5, errors  # rounded once from float32
    served = re.search(r"^(?:\[0\]<stdout>:)?lane served(.*)$", stdout, re.MULTILINE)
    assert served, stdout[-3000:]
    counts = dict(item.split("=") for item in served.group(1).split())
    assert set(counts) == (LANE_DTYPES if lane else set()), counts


@pytest.mark.parametrize(("ranks", "backend"), [(2, "shm-ring+lane"), (4, "shm-ring+lane"), (2, "tcp-ring"),
                                                (2, "gloo"), (2, "device-path")])
def test_every_dtype_op_and_collective_on_every_backend(run_hvdrun, hvdrun_env, ranks, backend):
    hvdrun_env.update(DTYPE_BACKENDS[backend])
    result = run_hvdrun("-np", str(ranks), worker("dtypes.py"), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_dtype_table(result.stdout, ranks, lane=backend == "shm-ring+lane")


@pytest.mark.skipif(not MPIEXEC.exists() and not shutil.which("mpiexec"), reason="mpich wheel not installed")
def test_every_dtype_op_and_collective_on_mpi(hvdrun_env):
    env = {k: v for k, v in hvdrun_env.items() if not k.startswith("HVDRUN_") or k == "HVDRUN_TEST_TOKEN"}
    result = subprocess.run([str(MPIEXEC if MPIEXEC.exists() else "mpiexec"), "-n", "2", sys.executable,
                             worker("dtypes.py")], env={**env, "OMP_NUM_THREADS": "1"}, cwd=REPO,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_dtype_table(result.stdout, 2)


def test_a_device_backend_this_torch_lacks_is_named_on_every_rank(run_hvdrun, hvdrun_env, tmp_path):
    """Intel GPUs' xccl cannot run here: the choice reaches the device path and its error reaches every rank."""
    program = tmp_path / "xccl.py"
    program.write_text("import torch\nimport hvdrun.torch as hvd\nhvd.init()\ntry:\n    hvd.allreduce(torch.ones(4))\n"
                       "except hvd.HorovodInternalError as e:\n    print(f'rank {hvd.rank()}: {e}', flush=True)\n"
                       "hvd.shutdown()\n")
    hvdrun_env.update({"HVDRUN_DEVICE_BACKEND": "xccl", "HVDRUN_CPU_VIA_DEVICE_BACKEND": "1"})
    done = run_hvdrun("-np", "2", str(program))
    assert done.returncode == 0, done.stderr
    for rank in range(2):
        assert (f"[{rank}]<stdout>:rank {rank}: HVDRUN_DEVICE_BACKEND=xccl: this torch ({torch.__version__}) has no "
                "XCCL process group") in done.stdout, done.stdout


MANY_DESCRIPTORS = """
import os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), hard))
null = os.open(os.devnull, os.O_RDONLY)
held = [os.dup(null) for _ in range(1100)]  # every socket and pipe hvdrun opens from here on is numbered past 1024
import numpy as np
from hvdrun.runtime import context
from hvdrun.runtime.negotiation import Request
runtime = context.init()
rank, size = runtime.world.rank, runtime.world.size
for step in range(20):
    total = runtime.engine.submit(Request(f"sum.{step}", "allreduce", "float64", (1000,)),
                                  np.full(1000, rank + 1.0)).wait()
    assert (total == size * (size + 1) / 2).all()
context.shutdown()
print(f"MANY rank {rank} ok", flush=True)
"""


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_job_whose_descriptors_are_numbered_past_1024_runs(run_hvdrun, hvdrun_env, tmp_path, transport):
    """select() cannot watch them (rank 0 of a thousand hosts holds a socket for each): the waits use poll()."""
    hvdrun_env["HVDRUN_TRANSPORT"] = transport
    program = tmp_path / "many.py"
    program.write_text(MANY_DESCRIPTORS)
    done = run_hvdrun("-np", "3", sys.executable, str(program), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ranks_reporting(done.stdout, r"MANY rank (\d+) ok") == {0, 1, 2}
