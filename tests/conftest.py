"""Shared fixtures: run hvdrun as a real process and find the processes a job left behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import psutil
import pytest

from hvdrun.envvars import FORK_SERVER_FROM
from tests import pbs_server as pbs
from tests.zygote import ForkedRank, Zygote

REPO = Path(__file__).resolve().parent.parent
TOKEN_VAR = "HVDRUN_TEST_TOKEN"
# login shells of the suite's jobs (Slurm's bash -l inherits this environment) that run `pyenv init` wait 1 s, not
# 60, for a rehash lock that a killed session left behind (the sshd fixture sets the same for SSH sessions)
os.environ.setdefault("PYENV_REHASH_TIMEOUT", "1")


def job_processes(token: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment carries ``token``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(TOKEN_VAR) == token:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def host_processes(addrs: Sequence[str]) -> list[psutil.Process]:
    """Live processes started through the sshd of the hosts at ``addrs``: their environment (the login session's,
    below every rank's own) names the address the host was reached at in ``SSH_CONNECTION``. Host agents, their
    fork servers and the guards they fork carry no job variables in their environment, but this one."""
    found = []
    for proc in psutil.process_iter():
        try:
            words = proc.environ().get("SSH_CONNECTION", "").split()
            if len(words) == 4 and words[2] in addrs and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def shm_files(job_id: str) -> list[Path]:
    """The files of hvdrun job ``job_id`` (its ``HVDRUN_JOB_ID``) in /dev/shm: rings, bells, boards. Only this
    job's: jobs of other tests (another pytest-xdist worker's) may have theirs there at the same time."""
    return sorted(Path("/dev/shm").glob(f"hvdrun-{job_id}-*"))


def unavailable(reason: str) -> NoReturn:
    """Skip a test whose real fixture (sshd, Slurm, PBS) this machine cannot run, with the reason; under CI
    (``HVDRUN_TESTS_REQUIRE_FIXTURES=1``, set by .ci/run) fail instead: CI must run every test."""
    if os.environ.get("HVDRUN_TESTS_REQUIRE_FIXTURES") == "1":
        pytest.fail(f"{reason}; CI requires every fixture", pytrace=False)
    pytest.skip(reason)


def wait_until(condition: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passes; return its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def where_it_hangs(process: subprocess.Popen, stderr: str = "") -> str:
    """What a test that timed out waiting for ``process`` reports: the threads of it and of its children
    (``py-spy dump``) and the stderr it read so far, then ``process`` is killed."""
    dumps = [threads_of(pid) for pid in [process.pid, *(child.pid for child in _children(process.pid))][:5]]
    process.kill()
    return "\n".join([*dumps, "--- its stderr", stderr[-4000:]])


def threads_of(pid: int) -> str:
    """``py-spy dump --pid PID``: where every thread of a Python process is."""
    done = subprocess.run([str(Path(sys.executable).with_name("py-spy")), "dump", "--pid", str(pid)],
                          capture_output=True, text=True, timeout=30)
    return f"--- py-spy dump --pid {pid}\n{done.stdout or done.stderr}"


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.fixture
def token() -> str:
    """A unique marker put in the environment of hvdrun and so of every process of the job."""
    return uuid.uuid4().hex


@pytest.fixture
def hvdrun_env(token: str, zygote: Zygote) -> dict[str, str]:
    """Environment for an hvdrun process whose job can be traced by ``token``. A local job's fork server is forked
    by the ``zygote``, which already imported torch (``hvdrun/launch/remote/zygote.py``); a test of the fork
    server's own start, or of a job a scheduler starts, removes ``HVDRUN_FORK_SERVER_FROM``."""
    return {**os.environ, TOKEN_VAR: token, "PYTHONUNBUFFERED": "1", FORK_SERVER_FROM: str(zygote.path)}


@pytest.fixture
def run_hvdrun(hvdrun_env: dict[str, str], token: str, tmp_path: Path):
    """Run ``hvdrun ARGS`` to completion; afterwards assert no process of the job is left."""

    def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", "hvdrun", *args], env=hvdrun_env, cwd=tmp_path,
                              capture_output=True, timeout=timeout)
        # decoded by hand: text mode would turn the workers' \r into \n
        return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())

    yield run
    assert wait_until(lambda: not job_processes(token)), f"left behind: {job_processes(token)}"


@pytest.fixture(scope="session")
def compiled_built() -> Path:
    """The optional compiled module (hvdrun.runtime.compiled), built when missing (``make test`` builds it first, so
    every job of the suite takes it; tests that compare the paths set HVDRUN_COMPILED per rank)."""
    from hvdrun.runtime import compiled

    return compiled.LIBRARY if compiled.LIBRARY.exists() else compiled.build()


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    """One process per pytest worker that imported torch and forks the ranks ``spawn_ranks`` starts."""
    started = Zygote.start(Path(f"/tmp/hvdrun-zygote-{os.getpid()}.sock"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def spawn_ranks(hvdrun_env: dict[str, str], token: str, tmp_path: Path, zygote: Zygote):
    """Start ranks of one job directly (hvdrun's env contract, no supervising launcher), forked from the
    ``zygote`` as hvdrun's preload forks them (a new interpreter where it could not be).

    Returns ``start(script, size, ranks=None, env=None, hosts=None) -> {rank: Popen}``; afterwards every
    process is killed and the test fails if any was left running. ``hosts``: ``[(name, slots), ...]`` gives ranks
    host names of their own (``HVDRUN_HOSTNAME``), so the runtime sees several hosts and connects them by TCP.
    """
    from hvdrun.envvars import Rendezvous, worker_env
    from hvdrun.hosts import Host
    from hvdrun.launch.remote.hostfacts import free_ports
    from hvdrun.ranks import assign_slots

    started: list[subprocess.Popen[str] | ForkedRank] = []
    job_ids: set[str] = set()

    def start(script: str, size: int, ranks: list[int] | None = None, env: dict[str, str] | None = None,
              args: tuple[str, ...] = (), rendezvous: Rendezvous | None = None,
              hosts: list[tuple[str, int]] | None = None) -> dict[int, subprocess.Popen[str] | ForkedRank]:
        rendezvous = rendezvous or Rendezvous("127.0.0.1", *free_ports(2), uuid.uuid4().hex, "t" + token[:6])
        procs = {}
        for slot in assign_slots([Host(name, slots) for name, slots in hosts or [("localhost", size)]], size):
            if ranks is not None and slot.rank not in ranks:
                continue
            job_env = worker_env(slot, rendezvous)
            full_env = {**hvdrun_env, **job_env, "OMP_NUM_THREADS": "1", **(env or {})}
            command = [sys.executable, script, *args]
            procs[slot.rank] = zygote.spawn(command, full_env, tmp_path, job_env) or subprocess.Popen(
                command, env=full_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            started.append(procs[slot.rank])
        start.rendezvous = rendezvous  # type: ignore[attr-defined]
        job_ids.add(rendezvous.job_id)
        return procs

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None and not stream.closed:
                stream.close()
    for job_id in job_ids:  # no guard here: remove the rings of ranks this fixture killed
        for path in shm_files(job_id):
            path.unlink(missing_ok=True)
    assert wait_until(lambda: not job_processes(token)), f"left behind: {job_processes(token)}"


# -- SSH hosts: real OpenSSH servers, one per network namespace (tests/infra/ssh_hosts.sh) -------------

SSH_FIXTURE = REPO / "tests" / "infra" / "ssh_hosts.sh"


@dataclass(frozen=True)
class SshHosts:
    """Throw-away hosts hK at ``addrs[K-1]`` with sshd on port 22, a client key and their known_hosts."""

    dir: Path
    names: list[str]
    addrs: list[str]
    key: str
    known_hosts: str
    local_addr: str
    subnet: str

    def unused_addr(self) -> str:
        """An address on the hosts' subnet that no host has (unreachable)."""
        return f"{self.subnet}.77"

    def args(self) -> list[str]:
        """hvdrun options that reach these hosts."""
        return ["-i", self.key, "--ssh-known-hosts", self.known_hosts]

    def hosts(self, slots: int, count: int = 2) -> str:
        """``-H`` value for the first ``count`` hosts with ``slots`` each."""
        return ",".join(f"{addr}:{slots}" for addr in self.addrs[:count])


def _fixture_command(action: str, directory: Path, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(["bash", str(SSH_FIXTURE), action, "-d", str(directory), *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"ssh_hosts.sh {action} failed: {done.stderr}")
    return done.stdout


FIXTURES_PER_PROCESS = 5  # fixture_tag offsets: 0 ssh_hosts, 1 slurm_cluster, 2 and 3 hosts two tests start,
# 4 pbs_server


def fixture_tag(offset: int) -> int:
    """The tag (:func:`fixture_names`) of this test process's fixture number ``offset`` (see
    FIXTURES_PER_PROCESS): distinct for every fixture of every pytest process running at once. A plain run
    counts from its own pid. Each pytest-xdist worker (``PYTEST_XDIST_WORKER`` gw0, gw1, ...) is a process of
    its own whose pid + 1 may be another worker's pid, so a worker counts from the pid of the controller all
    workers of the run share, in a block of tags of its own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return os.getpid() * FIXTURES_PER_PROCESS + offset
    return (os.getppid() * 64 + int(worker.removeprefix("gw"))) * FIXTURES_PER_PROCESS + offset


def fixture_names(tag: int) -> dict[str, str]:
    """Namespace, bridge and subnet names of one fixture: distinct per test run, so that runs sharing a
    machine never touch each other's hosts (a bridge name has at most 15 characters)."""
    tag %= 10_000
    return {"HVD_FX_NS_PREFIX": f"hv{tag}h", "HVD_FX_BRIDGE": f"hv{tag}br0",
            "HVD_FX_SUBNET": f"10.{200 + tag % 50}.{tag // 50 % 250}"}


def start_ssh_hosts(directory: Path, count: int, env: dict[str, str] | None = None, *args: str) -> SshHosts:
    """Start ``count`` sshd hosts in network namespaces (root only); stop them with :func:`stop_ssh_hosts`."""
    if os.geteuid() != 0:
        unavailable("SSH hosts need root (network namespaces)")
    if not Path("/usr/sbin/sshd").exists():
        unavailable("openssh-server is not installed (make test installs it)")
    _fixture_command("stop", directory, "--force", env=env)  # leftovers of a crashed run with these names
    _fixture_command("start", directory, "-n", str(count), "-m", "netns", *args, env=env)
    info = json.loads((directory / "hosts.json").read_text())
    return SshHosts(directory, [h["name"] for h in info["hosts"]], [h["addr"] for h in info["hosts"]], info["key"],
                    info["known_hosts"], info["local_addr"], (env or {}).get("HVD_FX_SUBNET", "10.200.0"))


def stop_ssh_hosts(directory: Path, env: dict[str, str] | None = None) -> None:
    """Stop the hosts and everything still running on them, and remove their directory."""
    _fixture_command("stop", directory, "--purge", env=env)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def ssh_hosts() -> Iterator[SshHosts]:
    """Four SSH hosts h1..h4 for the whole session."""
    directory = Path(f"/tmp/hvdrun-ssh-{os.getpid()}")
    names = fixture_names(fixture_tag(0))
    hosts = start_ssh_hosts(directory, 4, names)
    try:
        yield hosts
    finally:
        stop_ssh_hosts(directory, names)


# -- Slurm: a real slurmctld + one slurmd per SSH host (tests/infra/slurm_cluster.sh) -------------------

SLURM_FIXTURE = REPO / "tests" / "infra" / "slurm_cluster.sh"


@dataclass(frozen=True)
class SlurmCluster:
    """A 2-node Slurm cluster whose nodes are SSH hosts (names resolve through /etc/hosts)."""

    env: dict[str, str]
    nodes: list[str]
    ssh: SshHosts


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """Slurm (with the Torque-style qsub/qstat/qdel wrappers) on two SSH hosts, for the whole session; partitions
    debug (the default, no limits), short (MaxTime=00:10:00 MaxNodes=1) and wide (MinNodes=2). Its tests are in
    test_scheduler_jobs.py and test_queue_limits_servers.py: ``make test`` gives each file's tests to one
    pytest-xdist worker (``--dist loadfile``), so one slurmctld per worker that runs them serves the run."""
    if os.geteuid() != 0:
        unavailable("the Slurm cluster needs root (slurmd, network namespaces)")
    if not shutil.which("slurmctld") or not shutil.which("qsub"):
        unavailable("slurm-wlm / slurm-wlm-torque are not installed (make test installs them)")
    tag = fixture_tag(1)
    names = {**fixture_names(tag), "HVD_FX_NAME_PREFIX": f"hv{tag % 10_000}n"}
    ssh_dir, slurm_dir = Path(f"/tmp/hvdrun-sq-{os.getpid()}"), Path(f"/tmp/hvdrun-sl-{os.getpid()}")
    hosts = start_ssh_hosts(ssh_dir, 2, names, "--etc-hosts")
    port = str(17000 + tag % 400 * 5)
    try:
        done = subprocess.run(["bash", str(SLURM_FIXTURE), "start", "--hosts-from", str(ssh_dir), "--pbs", "--auth",
                               "none", "-d", str(slurm_dir), "-p", port], capture_output=True, text=True, timeout=90)
        if done.returncode != 0:
            raise RuntimeError(f"slurm_cluster.sh start failed: {done.stderr}")
        env = dict(line.removeprefix("export ").split("=", 1) for line in done.stdout.splitlines()
                   if line.startswith("export "))
        yield SlurmCluster(env, env["HVD_SLURM_NODES"].split(","), hosts)
    finally:
        subprocess.run(["bash", str(SLURM_FIXTURE), "stop", "-d", str(slurm_dir)], capture_output=True, timeout=90)
        shutil.rmtree(slurm_dir, ignore_errors=True)
        stop_ssh_hosts(ssh_dir, names)


# -- PBS: a real OpenPBS server and a MOM per SSH host (tests/infra/pbs_cluster.sh, tests/pbs_server.py) --------

@pytest.fixture(scope="session")
def pbs_server() -> Iterator[tuple[pbs.PbsServer, SshHosts]]:
    """OpenPBS on two SSH hosts named ``aurora-...`` with Aurora's queues, for the whole session. Its tests are in
    test_pbs.py, given to one pytest-xdist worker (``--dist loadfile``): one server serves the run."""
    if os.geteuid() != 0:
        unavailable("the PBS server needs root (its daemons, network namespaces)")
    if not (pbs.PBS_EXEC / "sbin" / "pbs_server").exists():
        unavailable(f"OpenPBS is not built in {pbs.PBS_EXEC} (make test builds it)")
    tag = fixture_tag(4)
    names = {**fixture_names(tag), "HVD_FX_NAME_PREFIX": f"aurora-p{tag % 10_000}n"}
    ssh_dir, pbs_dir = Path(f"/tmp/hvdrun-pq-{os.getpid()}"), Path(f"/var/spool/hvdrun-pbs-{os.getpid()}")
    hosts = start_ssh_hosts(ssh_dir, 2, names, "--etc-hosts")
    try:
        yield pbs.start(ssh_dir, pbs_dir, datastore_port=20000 + tag % 5000), hosts
    finally:
        pbs.stop(pbs_dir)
        stop_ssh_hosts(ssh_dir, names)
