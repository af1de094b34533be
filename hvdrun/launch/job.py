"""From run options to running workers: parse -> hosts -> slots -> per-rank env -> launch.

:func:`plan_job` does every check that can fail on bad input before anything starts;
:func:`run_job` starts and supervises the workers of a plan.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hvdrun.config import ClusterConfig, load_cluster, load_config
from hvdrun.envvars import START_TIMEOUT, TIMELINE, Rendezvous, forwarded_env, thread_env, worker_env
from hvdrun.errors import UsageError
from hvdrun.hosts import Host, detect_allocation, parse_host_string, parse_hostfile
from hvdrun.launch.base import WorkerGroup, WorkerSpec
from hvdrun.launch.local import LocalLauncher
from hvdrun.launch.output import OutputRouter
from hvdrun.ranks import GpuLayout, Slot, assign_slots, total_slots

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain"})


@dataclass(frozen=True)
class RunOptions:
    """What the user asked for on the command line (``hvdrun [options] COMMAND``)."""

    command: tuple[str, ...]
    num_proc: int | None = None
    hosts: str | None = None
    hostfile: str | None = None
    cluster: str | None = None
    config_file: str | None = None
    gpus_per_node: int | None = None
    gpus_per_rank: int | None = None
    launcher: str | None = None
    env_specs: tuple[str, ...] = ()
    prefix_output: bool = True
    output_dir: str | None = None
    grace_s: float = 5.0
    start_timeout_s: float | None = None
    verbose: bool = False
    timeline_filename: str | None = None


@dataclass(frozen=True)
class JobPlan:
    """A validated job: one spec per rank, and how to start them."""

    specs: tuple[WorkerSpec, ...]
    launcher: str
    options: RunOptions
    rendezvous: Rendezvous

    @property
    def slots(self) -> list[Slot]:
        """The ranks' slots, in rank order."""
        return [spec.slot for spec in self.specs]


def _load_cluster_config(options: RunOptions) -> ClusterConfig | None:
    if options.cluster and options.config_file:
        raise UsageError("give either --cluster NAME or --config FILE, not both")
    if options.cluster:
        return load_cluster(options.cluster)
    return load_config(options.config_file) if options.config_file else None


def _resolve_hosts(options: RunOptions, config: ClusterConfig | None, layout: GpuLayout,
                   environ: Mapping[str, str]) -> tuple[Host, ...]:
    if options.hosts and options.hostfile:
        raise UsageError("give either -H or --hostfile, not both")
    if options.hosts:
        return parse_host_string(options.hosts)
    if options.hostfile:
        return parse_hostfile(options.hostfile)
    if config and config.hosts:
        return config.hosts
    allocation = detect_allocation(environ)
    if allocation:
        hosts = allocation[1]
        if layout.gpus_per_node:  # one rank per GPU (or per gpus_per_rank GPUs) on every node
            per_node = max(layout.gpus_per_node // layout.gpus_per_rank, 1)
            hosts = tuple(replace(host, slots=per_node) for host in hosts)
        return hosts
    return (Host("localhost", options.num_proc or 1),)


def _gpu_layout(options: RunOptions, config: ClusterConfig | None) -> GpuLayout:
    gpus_per_node = options.gpus_per_node if options.gpus_per_node is not None else (
        config.gpus_per_node if config else 0)
    order = config.gpu_order if config and config.gpu_order and len(config.gpu_order) == gpus_per_node else None
    gpus_per_rank = options.gpus_per_rank or (config.gpus_per_rank if config else 1)
    return GpuLayout(gpus_per_node=gpus_per_node, gpu_order=order, gpus_per_rank=gpus_per_rank)


def resolve_command(command: Sequence[str]) -> tuple[str, ...]:
    """``train.py ...`` runs under this Python; any other program runs as given.

    Raises:
        UsageError: no command, a missing script, or a program not on PATH.
    """
    if not command:
        raise UsageError("no command given; expected e.g. 'hvdrun -np 2 train.py'")
    program, args = command[0], tuple(command[1:])
    if program.endswith(".py"):
        if not Path(program).is_file():
            raise UsageError(f"script '{program}' not found (working directory {os.getcwd()})")
        return (sys.executable, "-u", program, *args)
    if shutil.which(program) is None:
        raise UsageError(f"program '{program}' not found on PATH and not an executable file")
    return (program, *args)


def is_local_host(name: str) -> bool:
    """True when ``name`` is this machine (no DNS lookup: names and interface addresses only)."""
    if name in LOCAL_NAMES or name.startswith("127.") or name == socket.gethostname():
        return True
    import psutil

    return any(addr.address.split("%")[0] == name for addrs in psutil.net_if_addrs().values() for addr in addrs)


def _choose_launcher(options: RunOptions, config: ClusterConfig | None, hosts: Sequence[Host]) -> str:
    launcher = options.launcher or (config.launcher if config else None) or "local"
    remote = [h.name for h in hosts if not is_local_host(h.name)]
    if launcher != "local":
        raise UsageError(f"launcher '{launcher}' is not available in this hvdrun yet; use --launcher local")
    if remote:
        raise UsageError(f"host '{remote[0]}' is not this machine; the local launcher starts ranks on "
                         "this machine only (e.g. -H localhost:4)")
    return launcher


def _new_rendezvous() -> Rendezvous:
    return Rendezvous(addr="127.0.0.1", port=_free_port(), master_port=_free_port(),
                      secret=secrets.token_hex(32), job_id=secrets.token_hex(4))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def plan_job(options: RunOptions, environ: Mapping[str, str]) -> JobPlan:
    """Validate ``options`` and compute every rank's spec. Starts nothing.

    Raises:
        UsageError: any invalid input (hosts, config, -np, -x, command); exit code 2.
    """
    config = _load_cluster_config(options)
    layout = _gpu_layout(options, config)
    hosts = _resolve_hosts(options, config, layout, environ)
    slots = assign_slots(hosts, options.num_proc or total_slots(hosts), layout)
    launcher = _choose_launcher(options, config, hosts)
    argv = resolve_command(options.command)
    base_env = {**environ, **(config.env if config else {}), **forwarded_env(options.env_specs, environ)}
    if options.start_timeout_s is not None:
        base_env[START_TIMEOUT] = str(options.start_timeout_s)
    if options.timeline_filename:
        base_env[TIMELINE[0]] = str(Path(options.timeline_filename).resolve())
    rendezvous = _new_rendezvous()
    cpus = os.cpu_count() or 1
    specs = tuple(WorkerSpec(slot=slot, argv=argv, cwd=os.getcwd(),
                             env={**base_env, **thread_env(slot, cpus, base_env), **worker_env(slot, rendezvous)})
                  for slot in slots)
    return JobPlan(specs=specs, launcher=launcher, options=options, rendezvous=rendezvous)


def describe_plan(plan: JobPlan) -> str:
    """A table of the ranks: host, local and cross rank, GPUs, and the command."""
    lines = [f"hvdrun: {len(plan.specs)} ranks, launcher {plan.launcher}: {' '.join(plan.specs[0].argv)}",
             "  rank  host                  local  cross  gpus"]
    for slot in plan.slots:
        lines.append(f"  {slot.rank:<5} {slot.hostname:<21} {slot.local_rank}/{slot.local_size:<4} "
                     f"{slot.cross_rank}/{slot.cross_size:<4} {','.join(slot.devices) or '-'}")
    return "\n".join(lines)


def run_job(plan: JobPlan) -> None:
    """Start every rank of ``plan`` and supervise them until the job ends.

    Raises:
        WorkerFailed: a rank failed (exit code = that rank's).
        JobInterrupted: hvdrun was interrupted.
    """
    from hvdrun.runtime.transport.shm import remove_job_segments

    options = plan.options
    router = OutputRouter(len(plan.specs), prefix=options.prefix_output, output_dir=options.output_dir)
    try:
        WorkerGroup(LocalLauncher(grace_s=options.grace_s), router).run(plan.specs)
    finally:
        remove_job_segments(plan.rendezvous.job_id)  # left by ranks killed during init()
