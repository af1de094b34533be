"""``--launcher mpiexec`` with the mpich wheel's hydra: locally, and over ssh across the namespace hosts."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, SshHosts, host_processes, job_processes, wait_until
from tests.integration.test_local_launch import script
from tests.integration.test_ssh_launch import ALLREDUCE, SLEEPER, results, start_and_wait_ready

pytestmark = pytest.mark.integration


def command_lines(processes: list[psutil.Process]) -> list[str]:
    lines = []
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            lines.append(" ".join(proc.cmdline()))
    return lines


def proxies_left(token: str, hosts: SshHosts) -> list[str]:
    """Command lines of this job's hydra proxies (and of the ssh clients starting them): on this machine they carry
    the job's token, on the hosts they run in a login session of the hosts' sshd (another pytest-xdist worker's
    jobs have neither)."""
    return [line for line in command_lines(job_processes(token) + host_processes(hosts.addrs))
            if "hydra_pmi_proxy" in line]


def test_mpiexec_across_two_hosts(run_hvdrun, ssh_hosts, tmp_path, token):
    worker = script(tmp_path, "allreduce.py", ALLREDUCE)
    done = run_hvdrun("--launcher", "mpiexec", "-H", ssh_hosts.hosts(2), *ssh_hosts.args(), "--output-dir", "logs",
                      worker, "a b", "$(touch pwned)")
    assert done.returncode == 0, done.stderr
    ranks = results(done.stdout)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and all(r["ok"] and r["size"] == 4 for r in ranks)
    assert [r["host"] for r in ranks] == ["h1", "h1", "h2", "h2"]
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert all(r["argv"] == ["a b", "$(touch pwned)"] for r in ranks) and not (tmp_path / "pwned").exists()
    for rank in range(4):
        assert f"[{rank}]<stdout>:RESULT " in done.stdout
        assert "RESULT " in (tmp_path / "logs" / f"rank.{rank}" / "stdout").read_text()
    assert wait_until(lambda: not proxies_left(token, ssh_hosts), 10), proxies_left(token, ssh_hosts)


def test_mpiexec_on_this_machine_runs_the_ring(run_hvdrun, tmp_path):
    worker = script(tmp_path, "allreduce.py", ALLREDUCE)
    done = run_hvdrun("--launcher", "mpiexec", "-np", "3", worker)
    assert done.returncode == 0, done.stderr
    assert [r["ok"] for r in results(done.stdout)] == [True] * 3


MPI_WORLD = """
import json
from mpi4py import MPI
import numpy as np
comm = MPI.COMM_WORLD
total = np.array([comm.rank + 1.0])
comm.Allreduce(MPI.IN_PLACE, total)
print("RESULT " + json.dumps({"rank": comm.rank, "size": comm.size, "sum": float(total[0])}), flush=True)
"""


@pytest.mark.parametrize("where", ["local", "hosts"])
def test_mpi_programs_run_as_one_world_under_the_guard(run_hvdrun, ssh_hosts, tmp_path, where):
    """The guard between mpiexec's proxy and the rank hands MPICH's PMI_FD down: MPI_Init connects."""
    worker = script(tmp_path, "world.py", MPI_WORLD)
    hosts = ["-np", "2"] if where == "local" else ["-H", ssh_hosts.hosts(1), *ssh_hosts.args()]
    done = run_hvdrun("--launcher", "mpiexec", *hosts, worker)
    assert done.returncode == 0, done.stderr
    assert [(r["rank"], r["size"], r["sum"]) for r in results(done.stdout)] == [(0, 2, 3.0), (1, 2, 3.0)]


def test_mpiexec_names_the_failed_rank_and_stops_the_others(run_hvdrun, ssh_hosts, tmp_path, token):
    sleeper = script(tmp_path, "sleeper.py", SLEEPER)
    start = time.monotonic()
    done = run_hvdrun("--launcher", "mpiexec", "-H", ssh_hosts.hosts(2), *ssh_hosts.args(), "--grace-period", "2",
                      sleeper, "2")
    assert done.returncode == 3, done.stderr
    assert f"rank 2 on host {ssh_hosts.addrs[1]} exited with code 3" in done.stderr
    assert "remote rank is about to fail" in done.stderr
    assert time.monotonic() - start < 60  # the others sleep 300 s: they were stopped
    assert wait_until(lambda: not proxies_left(token, ssh_hosts), 10), proxies_left(token, ssh_hosts)


def test_interrupting_hvdrun_stops_mpiexec_everywhere(ssh_hosts, hvdrun_env, tmp_path, token):
    proc = start_and_wait_ready(ssh_hosts, hvdrun_env, tmp_path, "--launcher", "mpiexec")
    assert proxies_left(token, ssh_hosts)  # found while they run
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 128 + signal.SIGINT
    assert wait_until(lambda: not job_processes(token), 15), job_processes(token)
    assert wait_until(lambda: not proxies_left(token, ssh_hosts), 10), proxies_left(token, ssh_hosts)


def launcher_dir(token: str) -> Path:
    """The temporary directory of this job's mpiexec launcher, as mpiexec's command line names it."""
    pattern = re.escape(tempfile.gettempdir()) + r"/hvdrun-mpiexec-[^/\s]+"
    [found] = {match for line in command_lines(job_processes(token)) for match in re.findall(pattern, line)}
    return Path(found)


def test_sigkill_of_hvdrun_stops_mpiexec_everywhere(ssh_hosts, hvdrun_env, tmp_path, token):
    proc = start_and_wait_ready(ssh_hosts, hvdrun_env, tmp_path, "--launcher", "mpiexec", "--grace-period", "1")
    directory = launcher_dir(token)
    assert (directory / "ssh").exists()  # mpiexec's ssh agent script
    assert proxies_left(token, ssh_hosts)  # found while they run
    proc.kill()
    proc.wait(timeout=10)
    assert wait_until(lambda: not job_processes(token), 15), job_processes(token)
    assert wait_until(lambda: not proxies_left(token, ssh_hosts), 10), proxies_left(token, ssh_hosts)
    assert wait_until(lambda: not directory.exists(), 10), directory  # the guard removed it


def test_unknown_mpiexec_flavour_is_a_usage_error(run_hvdrun, tmp_path):
    done = run_hvdrun("--launcher", "mpiexec", "--mpi-flavour", "lam", sys.executable)
    assert done.returncode == 2 and "Invalid value for '--mpi-flavour'" in done.stderr


FAKE_PALS = REPO / "tests" / "fakes" / "fake_pals_mpiexec.py"

PINNED = """
import json, os
import numpy as np
from hvdrun.runtime import context
from hvdrun.runtime.negotiation import Request
runtime = context.init()
world = runtime.world
total = runtime.engine.submit(Request("sum", "allreduce", "float64", (3,)), np.ones(3)).wait()
print("PIN " + json.dumps({"rank": world.rank, "local": world.local_rank, "gpus": os.environ["CUDA_VISIBLE_DEVICES"],
                            "ok": total.tolist() == [float(world.size)] * 3}), flush=True)
context.shutdown()
"""


def test_pals_line_through_a_fake_pals_mpiexec_pins_gpus_in_polaris_order(run_hvdrun, hvdrun_env, tmp_path):
    """FAKE PALS (tests/fakes): hvdrun's side of the contract, i.e. its line, the shim's slots and pinning."""
    config = tmp_path / "polaris-like.yaml"
    config.write_text("launcher: mpiexec\ngpus_per_node: 4\ngpu_order: [3, 2, 1, 0]\nhosts: ['localhost:4']\n")
    hvdrun_env.update({"HVDRUN_MPIEXEC": str(FAKE_PALS), "FAKE_PALS_RECORD": str(tmp_path / "record.json")})
    done = run_hvdrun("--config", str(config), "--mpi-flavour", "pals", script(tmp_path, "pinned.py", PINNED))
    assert done.returncode == 0, done.stderr
    pins = sorted((json.loads(line.split("PIN ", 1)[1]) for line in done.stdout.splitlines() if "PIN " in line),
                  key=lambda r: r["rank"])
    assert [(p["rank"], p["local"], p["gpus"], p["ok"]) for p in pins] == [
        (0, 0, "3,2,1,0", True), (1, 1, "3,2,1,0", True), (2, 2, "3,2,1,0", True), (3, 3, "3,2,1,0", True)]
    assert all(f"[{rank}]<stdout>:PIN " in done.stdout for rank in range(4))
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["argv"][:9] == ["--np", "4", "--ppn", "4", "--cpu-bind", "none", "--envall", "--line-buffer",
                                  "--hostfile"]
    assert record["hosts"] == ["localhost"]


DEVICE_VARIABLES = """
import json, os
names = ("ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
         "HVDRUN_DEVICE_ORDINAL")
print("PIN " + json.dumps({"rank": int(os.environ["HVDRUN_RANK"]), **{n: os.environ.get(n) for n in names}}))
"""


def test_the_shipped_polaris_config_through_a_fake_pals_mpiexec(run_hvdrun, hvdrun_env, tmp_path):
    """FAKE PALS: polaris.yaml shows every rank GPUs 3,2,1,0 (local rank L's is device L), gives PALS ALCF's
    --depth=8 --cpu-bind depth and the NCCL network plugin's settings reach every rank."""
    hvdrun_env.update({"HVDRUN_MPIEXEC": str(FAKE_PALS), "FAKE_PALS_RECORD": str(tmp_path / "record.json")})
    shown = DEVICE_VARIABLES.replace('"HVDRUN_DEVICE_ORDINAL")',
                                     '"HVDRUN_DEVICE_ORDINAL", "NCCL_NET", "FI_MR_CACHE_MONITOR")')
    done = run_hvdrun("--cluster", "polaris", "-H", "localhost:4", "-np", "4", "--", sys.executable, "-c", shown)
    assert done.returncode == 0, done.stderr
    pins = sorted((json.loads(line.split("PIN ", 1)[1]) for line in done.stdout.splitlines() if "PIN " in line),
                  key=lambda r: r["rank"])
    assert {p["CUDA_VISIBLE_DEVICES"] for p in pins} == {"3,2,1,0"}
    assert [p["HVDRUN_DEVICE_ORDINAL"] for p in pins] == ["0", "1", "2", "3"]
    assert {(p["NCCL_NET"], p["FI_MR_CACHE_MONITOR"]) for p in pins} == {("AWS Libfabric", "userfaultfd")}
    assert not any(p["ZE_AFFINITY_MASK"] or p["ROCR_VISIBLE_DEVICES"] for p in pins)
    argv = json.loads((tmp_path / "record.json").read_text())["argv"]
    assert argv[argv.index("--ppn") + 1] == "4" and "--depth=8" in argv
    assert argv[argv.index("--cpu-bind") + 1] == "depth"


def test_aurora_through_a_fake_pals_mpiexec_shows_twelve_flat_tiles(run_hvdrun, hvdrun_env, tmp_path):
    """FAKE PALS: the shipped aurora.yaml shows each of 12 ranks the 12 tiles (FLAT), its own at its local rank,
    and no CUDA variable."""
    hvdrun_env.update({"HVDRUN_MPIEXEC": str(FAKE_PALS), "FAKE_PALS_RECORD": str(tmp_path / "record.json")})
    hvdrun_env.pop("CUDA_VISIBLE_DEVICES", None)
    done = run_hvdrun("--cluster", "aurora", "-H", "localhost:12", "-np", "12", "--",
                      sys.executable, "-c", DEVICE_VARIABLES)
    assert done.returncode == 0, done.stderr
    pins = sorted((json.loads(line.split("PIN ", 1)[1]) for line in done.stdout.splitlines() if "PIN " in line),
                  key=lambda r: r["rank"])
    assert {p["ZE_AFFINITY_MASK"] for p in pins} == {",".join(map(str, range(12)))}
    assert {p["ZE_FLAT_DEVICE_HIERARCHY"] for p in pins} == {"FLAT"}
    assert [p["HVDRUN_DEVICE_ORDINAL"] for p in pins] == [str(local) for local in range(12)]
    assert not any(p["CUDA_VISIBLE_DEVICES"] or p["ROCR_VISIBLE_DEVICES"] for p in pins)
    argv = json.loads((tmp_path / "record.json").read_text())["argv"]  # PALS binds ALCF's 12 core lists itself
    assert argv[argv.index("--cpu-bind") + 1] == "list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:" \
                                                 "85-92:93-100"


def test_gpu_bind_launcher_with_an_mpiexec_other_than_pals_is_a_usage_error(run_hvdrun, tmp_path):
    config = tmp_path / "binds-elsewhere.yaml"
    config.write_text("launcher: mpiexec\nmpi_flavour: mpich\ngpus_per_node: 2\ngpu_bind: launcher\n"
                      "hosts: ['localhost:2']\n")
    done = run_hvdrun("--config", str(config), "--", sys.executable, "-c", "print('ran')")
    assert done.returncode == 2 and "ran" not in done.stdout, done.stderr
    assert done.stderr.strip().splitlines() == [
        "hvdrun: error: gpu_bind: launcher pins GPUs with Cray PALS's --gpu-bind, but this mpiexec is mpich; "
        "set gpu_bind: hvdrun in the cluster file (or --mpi-flavour pals)"]


def test_a_cluster_that_lets_pals_pin_gpus_gets_gpu_bind_and_no_variable(run_hvdrun, hvdrun_env, tmp_path):
    """FAKE PALS: gpu_bind: launcher hands each rank's tile to PALS's --gpu-bind as a GPU.tile id (PALS fails to
    parse FLAT ids, ALCF's Aurora page says); hvdrun sets no ZE_AFFINITY_MASK, only the COMPOSITE hierarchy
    those ids need."""
    config = tmp_path / "aurora-pals-binds.yaml"
    config.write_text("launcher: mpiexec\nmpi_flavour: pals\ngpu_vendor: intel\ngpus_per_node: 4\ntiles_per_gpu: 2\n"
                      "gpu_bind: launcher\nhosts: ['localhost:4']\n")
    hvdrun_env.update({"HVDRUN_MPIEXEC": str(FAKE_PALS), "FAKE_PALS_RECORD": str(tmp_path / "record.json")})
    done = run_hvdrun("--config", str(config), "--", sys.executable, "-c", DEVICE_VARIABLES)
    assert done.returncode == 0, done.stderr
    pins = [json.loads(line.split("PIN ", 1)[1]) for line in done.stdout.splitlines() if "PIN " in line]
    assert len(pins) == 4 and not any(p["ZE_AFFINITY_MASK"] for p in pins)
    assert {p["ZE_FLAT_DEVICE_HIERARCHY"] for p in pins} == {"COMPOSITE"}
    argv = json.loads((tmp_path / "record.json").read_text())["argv"]
    assert argv[argv.index("--gpu-bind") + 1] == "list:0.0:0.1:1.0:1.1"


def test_a_node_pals_could_not_reach_is_blamed_and_the_restart_runs_without_it(run_hvdrun, hvdrun_env, ssh_hosts,
                                                                                 tmp_path):
    """FAKE PALS: its first launch prints PALS's "Couldn't forward RPC launch(...) to child NODE" (reported by the
    first node, about the second): the failure names the child, and the restart runs on the first and the spare."""
    hvdrun_env.update({"HVDRUN_MPIEXEC": str(FAKE_PALS), "FAKE_PALS_RECORD": str(tmp_path / "record.json"),
                       "FAKE_PALS_UNREACHABLE": str(tmp_path / "once")})
    first, child, spare = ssh_hosts.addrs[:3]
    done = run_hvdrun("--launcher", "mpiexec", "--mpi-flavour", "pals", "-H", f"{first}:1,{child}:1,{spare}:1",
                      "-np", "2", "--max-restarts", "1", "--", sys.executable, "-c", "print('ran')")
    assert done.returncode == 0, done.stderr
    assert re.search(rf"hvdrun: restart 1 of 1: attempt 1 ended with a node fault \(rank 1 on host {re.escape(child)} "
                     rf"made mpiexec exit with code 255: PALS could not reach node {re.escape(child)} \(launch failed "
                     rf"on {re.escape(first)}: Couldn't forward RPC launch", done.stderr), done.stderr
    runs = [json.loads(line) for line in (tmp_path / "record.json").read_text().splitlines()]
    assert [run["hosts"] for run in runs] == [[first, child], [first, spare]]  # around the child, not the reporter
    assert done.stdout.count("<stdout>:ran") == 2
