"""A real OpenPBS server for the tests (tests/infra/pbs_cluster.sh) on SSH hosts, set up as ALCF sets up Aurora.

The server's host is named ``aurora-...`` (hvdrun believes a PBS server's queues only for the cluster its name names)
and its queues are the ones ``cluster_configs/aurora.yaml`` states: execution queues with ``resources_min.nodect``,
``resources_max.nodect`` and ``resources_max.walltime``, and ``prod`` a routing queue (``route_destinations``) to
execution queues that take jobs only from it. ALCF's least walltime of every queue, 5 minutes (the YAML's own note),
is ``resources_min.walltime``: a limit hvdrun does not check, so only the server refuses a shorter job.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from hvdrun.config import QueueLimits, format_hms, load_cluster

REPO = Path(__file__).resolve().parent.parent
PBS_FIXTURE = REPO / "tests" / "infra" / "pbs_cluster.sh"
PBS_EXEC = Path(os.environ.get("PBS_EXEC", "/opt/pbs"))
SITE = "aurora"  # the shipped cluster whose queues the server takes
LEAST_WALLTIME = "00:05:00"  # every Aurora queue's (aurora.yaml)
SYSTEM = "fixture"  # every node's resources_available.system


@dataclass(frozen=True)
class PbsServer:
    """A running server: ``env`` reaches it (PBS_CONF_FILE, PATH), ``nodes`` are its MOM hosts' names."""

    env: dict[str, str]
    nodes: list[str]
    directory: Path

    def qmgr(self, *commands: str) -> None:
        """Run each ``qmgr -c COMMAND`` as the server's administrator."""
        for command in commands:
            done = subprocess.run(["qmgr", "-c", command], env=self.env, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise RuntimeError(f"qmgr -c {command!r} failed: {done.stderr.strip()}")

    @contextmanager
    def changed(self, change: str, undo: str) -> Iterator[None]:
        """The server with ``qmgr -c change`` applied, undone again (``undo``) at the end."""
        self.qmgr(change)
        try:
            yield
        finally:
            self.qmgr(undo)

    def daemon_pid(self, name: str) -> int:
        """The pid of this server's daemon ``name`` (pbs_server.bin, pbs_sched, ...)."""
        home = self.directory / self.nodes[0] / "home"
        pid_file = {"pbs_server.bin": home / "server_priv" / "server.lock",
                    "pbs_sched": home / "sched_priv" / "sched.lock"}[name]
        return int(pid_file.read_text().split()[0])


def start(ssh_dir: Path, directory: Path, datastore_port: int) -> PbsServer:
    """Start PBS on the SSH hosts of ``ssh_dir`` (started with ``--etc-hosts``) and give it Aurora's queues."""
    done = subprocess.run(["bash", str(PBS_FIXTURE), "start", "--hosts-from", str(ssh_dir), "-d", str(directory),
                           "--ds-port", str(datastore_port)], capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        raise RuntimeError(f"pbs_cluster.sh start failed: {done.stderr}")
    exports = dict(line.removeprefix("export ").split("=", 1) for line in done.stdout.splitlines()
                   if line.startswith("export "))
    env = {**os.environ, "PBS_CONF_FILE": exports["PBS_CONF_FILE"], "PATH": f"{PBS_EXEC / 'bin'}:{os.environ['PATH']}"}
    server = PbsServer(env, exports["HVD_PBS_NODES"].split(","), directory)
    server.qmgr(*site_queues())
    return server


def stop(directory: Path) -> None:
    """Stop every daemon and job of the server and remove its directory."""
    subprocess.run(["bash", str(PBS_FIXTURE), "stop", "-d", str(directory)], capture_output=True, timeout=90)


def site_queues() -> list[str]:
    """qmgr commands that replace the server's queues by the site's (``cluster_configs/aurora.yaml``)."""
    defaults = load_cluster(SITE).scheduler
    assert defaults is not None and defaults.queue
    commands = []
    for name, limits in defaults.queues.items():
        if limits.routes:
            commands += [f"create queue {name} queue_type=route", *_limits(name, limits),
                         f"set queue {name} route_destinations = \"{','.join(r.name for r in limits.routes)}\""]
            for route in limits.routes:
                commands += [f"create queue {route.name} queue_type=execution",
                             f"set queue {route.name} from_route_only = true",
                             *_limits(route.name, QueueLimits(route.min_nodes, route.max_nodes,
                                                              route.max_walltime_s))]
        else:
            commands += [f"create queue {name} queue_type=execution", *_limits(name, limits)]
    for name in _all_queue_names(defaults.queues):
        commands += [f"set queue {name} enabled = true", f"set queue {name} started = true"]
    return [*commands, f"set server default_queue = {defaults.queue}", "delete queue workq"]


def _limits(name: str, limits: QueueLimits) -> list[str]:
    commands = [f"set queue {name} resources_min.walltime = {LEAST_WALLTIME}"]
    if limits.min_nodes is not None:
        commands.append(f"set queue {name} resources_min.nodect = {limits.min_nodes}")
    if limits.max_nodes is not None:
        commands.append(f"set queue {name} resources_max.nodect = {limits.max_nodes}")
    if limits.max_walltime_s is not None:
        commands.append(f"set queue {name} resources_max.walltime = {format_hms(limits.max_walltime_s)}")
    return commands


def _all_queue_names(queues: dict[str, QueueLimits]) -> list[str]:
    return [name for queue, limits in queues.items() for name in (queue, *(r.name for r in limits.routes))]


def job_config(path: Path) -> Path:
    """A cluster YAML for jobs on this server: aurora.yaml's scheduler (queues, defaults, filesystems), ranks
    started by hvdrun over SSH from ``$PBS_NODEFILE``, none of Aurora's modules, GPUs or variables."""
    data = yaml.safe_load((REPO / "cluster_configs" / f"{SITE}.yaml").read_text())
    scheduler = {**data["scheduler"], "system": SYSTEM, "setup": [], "required": ["walltime"],
                 "walltime": "00:10:00", "filesystem_mpi_args": {}}
    path.write_text(yaml.safe_dump({"name": SITE, "description": "hvdrun's test PBS server, as Aurora",
                                    "launcher": "ssh", "scheduler": scheduler}, sort_keys=False))
    return path
