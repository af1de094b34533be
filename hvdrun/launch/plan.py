"""A job's plan from its run options: parse -> hosts -> GPUs -> slots -> per-rank environment.

:func:`plan_job` does every check that can fail on bad input before anything starts; what it returns,
:class:`JobPlan`, is all :mod:`hvdrun.launch.job` needs to start and supervise the ranks.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from hvdrun.atomic_files import why_unwritable
from hvdrun.config import ClusterConfig, load_cluster_config
from hvdrun.envvars import (
    BACKEND,
    BIND_REPORT,
    CPU_BIND,
    DEFAULT_START_TIMEOUT_S,
    DEVICE_ORDINAL,
    GPU_LAYOUT,
    HOROVOD_COMPAT,
    PRELOAD,
    START_TIMEOUT,
    STATE_DIR,
    TIMELINE,
    Rendezvous,
    check_tuning,
    forwarded_env,
    interface_env,
    job_devices,
    thread_env,
    worker_env,
)
from hvdrun.errors import UsageError
from hvdrun.hosts import (
    Host,
    detect_allocation,
    excluded_hosts,
    is_local_host,
    parse_host_string,
    parse_hostfile,
    without_excluded,
)
from hvdrun.launch.elastic.discovery import FixedHosts, ScriptDiscovery, make_discovery
from hvdrun.launch.elastic.worker_pool import (
    DEFAULT_COOLDOWN_S,
    DEFAULT_ELASTIC_TIMEOUT_S,
    ElasticSettings,
    check_settings,
)
from hvdrun.launch.launcher import WorkerSpec
from hvdrun.launch.remote.preload import AUTO, choose_modules, rank_source
from hvdrun.launch.staging import DEFAULT_STAGE_DIR, StagePlan, check_stage_dir, plan_staging, staged_env
from hvdrun.launch.supervision import DEFAULT_FORWARD_SIGNALS, parse_signal_list
from hvdrun.launch.warning import WalltimeWarning, plan_warning
from hvdrun.ranks import GpuLayout, Slot, assign_slots, layout_value, parse_rank_list, total_slots
from hvdrun.schedulers import SCHEDULERS, SLURM


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
    gpu_visibility: str | None = None
    launcher: str | None = None
    env_specs: tuple[str, ...] = ()
    prefix_output: bool = True
    output_dir: str | None = None
    grace_s: float = 5.0
    start_timeout_s: float | None = None
    verbose: bool = False
    timeline_filename: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_known_hosts: str | None = None
    network_interface: str | None = None
    ssh_fanout: int | None = None
    mpi_flavour: str | None = None
    mpi_args: str | None = None
    ranks_per_node: int | None = None
    module: bool = False
    extra_env: tuple[tuple[str, str], ...] = ()  # worker variables from horovodrun's options
    prefix_timestamp: bool = False
    horovod_compat: bool = False
    min_np: int | None = None
    max_np: int | None = None
    host_discovery_script: str | None = None
    slots_per_host: int | None = None
    elastic_timeout_s: float | None = None
    reset_limit: int | None = None
    cooldown_range: tuple[float, float] | None = None
    blacklist_scope: str | None = None
    max_restarts: int = 0
    spares: int = 0
    exclude_hosts: str | None = None  # comma-separated host names
    exclude_hosts_file: str | None = None
    cpu_bind: str | None = None  # none | cores | numa | list:A-B:C-D... (launch/remote/cpubind.py)
    ranks_output: str | None = None  # the ranks shown on the console: "0", "0,3-5"
    idle_timeout_s: float | None = None
    forward_signals: str | None = None  # "USR1,USR2" (default), "none"
    stage_env: bool = False  # copy the ranks' environment to every host's disk first (launch/staging.py)
    stage_dir: str | None = None  # where on each host (implies stage_env); default: the YAML's local_dir, else /tmp
    preload: str = AUTO  # auto | none | mod,mod: what each host's fork server imports once (launch/remote/preload.py)
    metrics_port: str | None = None  # [ADDR:]PORT: the job's metrics in Prometheus' format (observe/metrics.py)
    metrics_file: str | None = None  # append the job's metrics as JSON lines
    metrics_interval_s: float | None = None  # seconds between two samples of the ranks' vitals
    report: str | None = None  # write the job report (HTML) here when the job ends (observe/report.py)
    warn_before_s: float | None = None  # warn the ranks this long before the allocation ends (launch/warning.py)
    warn_signal: str | None = None  # the warning's signal (default USR1)
    state_dir: str | None = None  # where hvd.elastic state outlives the job (torch/lasting_state.py)

    @property
    def elastic(self) -> bool:
        """Horovod's rule: elastic when discovery, --min-np or --max-np is given."""
        return bool(self.host_discovery_script or self.min_np or self.max_np)


@dataclass(frozen=True)
class JobPlan:
    """A validated job: where every rank runs, what it runs, and how to start it."""

    slots: tuple[Slot, ...]
    command: tuple[str, ...]
    launcher: str
    options: RunOptions
    base_env: dict[str, str] = field(repr=False)
    cwd: str
    default_python: str = sys.executable
    ssh_port: int | None = None
    layout: GpuLayout = GpuLayout()
    mpi_flavour: str | None = None
    elastic: ElasticPlan | None = None
    hosts: tuple[Host, ...] = ()  # every host the job may use (spares included): restarts pick from them
    console_ranks: frozenset[int] | None = None  # --ranks-output; None: every rank
    forward_signals: tuple[int, ...] = DEFAULT_FORWARD_SIGNALS
    stage: StagePlan | None = None  # --stage-env: what to stage where
    staged: Mapping[str, str] = field(default_factory=dict)  # host name -> its staged copy's Python, once staged
    notes: tuple[str, ...] = ()  # what the user should hear about the plan (a YAML setting that did not apply)
    warning: WalltimeWarning | None = None  # the allocation's end, and --warn-before's warning

    def python_for(self, host: Host) -> str:
        """The Python of ``host``: its staged copy's (``--stage-env``), its own from the cluster YAML, else the
        launcher's."""
        return self.staged.get(host.name) or host.python or self.default_python

    def argv_for(self, host: Host) -> tuple[str, ...]:
        """The command on ``host``: ``train.py ...`` (or a module, with ``--module``) runs under that host's Python."""
        if self.options.module:
            return (self.python_for(host), "-u", "-m", *self.command)
        if self.command[0].endswith(".py"):
            return (self.python_for(host), "-u", *self.command)
        return self.command

    def spec(self, slot: Slot, rendezvous: Rendezvous, cpus: Callable[[Host], int],
             extra_env: Mapping[str, str] | None = None) -> WorkerSpec:
        """The spec of the rank in ``slot``."""
        python = self.python_for(slot.host)
        staged = staged_env(python, self.base_env) if slot.host.name in self.staged else {}
        return WorkerSpec(slot=slot, argv=self.argv_for(slot.host), cwd=self.cwd, python=python,
                          env={**self.base_env, **staged, **thread_env(slot, cpus(slot.host), self.base_env),
                               **worker_env(slot, rendezvous), **(extra_env or {})})

    def specs(self, rendezvous: Rendezvous, cpus: Callable[[Host], int]) -> tuple[WorkerSpec, ...]:
        """Every rank's spec, once rank 0's rendezvous endpoint is known."""
        return tuple(self.spec(slot, rendezvous, cpus) for slot in self.slots)


@dataclass(frozen=True)
class ElasticPlan:
    """An elastic job's hosts (fixed, or a discovery script) and settings."""

    settings: ElasticSettings
    hosts: tuple[Host, ...]
    script: str | None = None
    slots_per_host: int | None = None

    def discovery(self) -> FixedHosts | ScriptDiscovery:
        """Where the job finds its hosts while it runs."""
        return make_discovery(self.script, self.slots_per_host, self.hosts)


def _resolve_hosts(options: RunOptions, config: ClusterConfig | None, layout: GpuLayout,
                   environ: Mapping[str, str]) -> tuple[tuple[Host, ...], str]:
    """The hosts and where they came from: -H, hostfile, config, pbs, cobalt, slurm or default."""
    if options.hosts is not None and options.hostfile is not None:
        raise UsageError("give either -H or --hostfile, not both")
    if options.hosts is not None:
        return parse_host_string(options.hosts), "-H"
    if options.hostfile is not None:
        return parse_hostfile(options.hostfile), "hostfile"
    if config and config.hosts:
        return config.hosts, "config"
    allocation = detect_allocation(environ)
    if allocation:
        scheduler, hosts = allocation
        return _rank_per_gpu(hosts, layout), scheduler
    return (Host("localhost", options.num_proc or 1),), "default"


def _rank_per_gpu(hosts: tuple[Host, ...], layout: GpuLayout) -> tuple[Host, ...]:
    """An allocation's nodes with one slot per GPU (or per ``gpus_per_rank`` GPUs); as they are without GPUs."""
    if not layout.gpus_per_node:
        return hosts
    per_node = max(layout.gpus_per_node // layout.gpus_per_rank, 1)
    return tuple(replace(host, slots=per_node) for host in hosts)


def _gpu_layout(options: RunOptions, config: ClusterConfig | None) -> GpuLayout:
    """The GPU layout of the options and the cluster YAML."""
    gpus_per_node = options.gpus_per_node if options.gpus_per_node is not None else (
        config.gpus_per_node if config else 0)
    order = config.gpu_order if config and config.gpu_order and len(config.gpu_order) == gpus_per_node else None
    gpus_per_rank = options.gpus_per_rank or (config.gpus_per_rank if config else 1)
    return GpuLayout(gpus_per_node=gpus_per_node, gpu_order=order, gpus_per_rank=gpus_per_rank,
                     vendor=config.gpu_vendor if config else "nvidia",
                     tiles_per_gpu=config.tiles_per_gpu if config else 1,
                     binder=config.gpu_bind if config else "hvdrun",
                     visibility=options.gpu_visibility or (config.gpu_visibility if config else "node"))


def _within_job_devices(layout: GpuLayout, options: RunOptions, environ: Mapping[str, str]) -> GpuLayout:
    """``layout`` on the GPUs the scheduler gave the job, where hvdrun's environment names them (Slurm
    ``--gpus``, PBS by-gpu): the first ``--gpus-per-node`` of them when that option is given.

    Raises:
        UsageError: ``--gpus-per-node`` asks for more GPUs than the job was given.
    """
    given = job_devices(layout.vendor, environ) if layout.gpus_per_node else None
    if given is None:
        return layout
    variable, ids = given
    wanted = options.gpus_per_node
    if wanted is not None and wanted > len(ids):
        raise UsageError(f"--gpus-per-node {wanted}, but the job was given {len(ids)} GPUs ({variable}="
                         f"{','.join(ids)} in hvdrun's environment); lower --gpus-per-node, or ask the scheduler "
                         "for more GPUs")
    return layout.within((variable, ids[:wanted] if wanted is not None else ids))


def _hosts_and_gpus(options: RunOptions, config: ClusterConfig | None,
                    environ: Mapping[str, str]) -> tuple[tuple[Host, ...], str, GpuLayout]:
    """The hosts, where they came from, and the GPU layout: within the job's own GPUs where those GPUs are the
    hosts' (hvdrun runs in the allocation, or every host is this machine), else the YAML's and the options'."""
    layout = _gpu_layout(options, config)
    if options.host_discovery_script:
        hosts, source = make_discovery(options.host_discovery_script, options.slots_per_host, ()).find(), "discovery"
    else:
        hosts, source = _resolve_hosts(options, config, layout, environ)
    if source in SCHEDULERS:  # the allocation's nodes get one rank per GPU of the job's own
        layout = _within_job_devices(layout, options, environ)
        hosts = _rank_per_gpu(hosts, layout)
    elif all(is_local_host(host.name) for host in hosts):
        layout = _within_job_devices(layout, options, environ)
    return hosts, source, layout


def resolve_command(command: Sequence[str], check_program: bool = True, module: bool = False) -> tuple[str, ...]:
    """Check ``command``: a ``train.py`` must exist; another program must be on PATH (when ``check_program``);
    a module (``module``) must be a dotted name.

    Raises:
        UsageError: no command, a missing script, or a program not on PATH.
    """
    if not command:
        raise UsageError("no command given; expected e.g. 'hvdrun -np 2 train.py'")
    program = command[0]
    if module:
        if not all(part.isidentifier() for part in program.split(".")):
            raise UsageError(f"--module {program!r} is not a module name (e.g. mypackage.train)")
        return tuple(command)
    if program.endswith(".py"):
        if not Path(program).is_file():
            raise UsageError(f"script '{program}' not found (working directory {os.getcwd()})")
    elif check_program and shutil.which(program) is None:
        raise UsageError(f"program '{program}' not found on PATH and not an executable file")
    return tuple(command)


def _choose_launcher(options: RunOptions, config: ClusterConfig | None, hosts: Sequence[Host], source: str) -> str:
    remote = [h.name for h in hosts if not is_local_host(h.name)]
    in_slurm = source == SLURM and bool(remote) and shutil.which("srun") is not None
    launcher = options.launcher or (config.launcher if config else None) or (
        "srun" if in_slurm else "ssh" if remote else "local")
    if launcher == "local" and remote:
        raise UsageError(f"host '{remote[0]}' is not this machine; the local launcher starts ranks on "
                         "this machine only (e.g. -H localhost:4); use --launcher ssh for other hosts")
    return launcher


def plan_job(options: RunOptions, environ: Mapping[str, str]) -> JobPlan:
    """Validate ``options`` and compute where every rank runs. Starts nothing, connects nowhere.

    Raises:
        UsageError: any invalid input (hosts, config, -np, -x, command); exit code 2.
    """
    config = load_cluster_config(options.cluster, options.config_file)
    hosts, source, layout = _hosts_and_gpus(options, config, environ)
    ranks_per_node = options.ranks_per_node or (config.ranks_per_node if config else None)
    if ranks_per_node:
        hosts = tuple(replace(host, slots=ranks_per_node) for host in hosts)
    if options.host_discovery_script and (options.exclude_hosts or options.exclude_hosts_file):
        raise UsageError("--exclude-hosts/--exclude-hosts-file leave hosts out of a fixed list; with "
                         "--host-discovery-script, leave them out of what the script prints")
    hosts = without_excluded(hosts, excluded_hosts(options.exclude_hosts, options.exclude_hosts_file))
    interface, notes = _network_interface(options, config, hosts)
    options = replace(options, network_interface=interface)
    elastic = _elastic_plan(options, hosts) if options.elastic else None
    if elastic and (options.max_restarts or options.spares):
        raise UsageError("--max-restarts/--spares restart a whole job; an elastic job (--min-np/--max-np/"
                         "--host-discovery-script) recovers by itself: give one or the other")
    if elastic and (options.metrics_port or options.metrics_file or options.report):
        raise UsageError("--metrics-port/--metrics-file/--report watch a job of fixed ranks through its rank 0; an "
                         "elastic job (--min-np/--max-np/--host-discovery-script) has none yet")
    slots = () if elastic else assign_slots(hosts, _num_proc(options, hosts), layout)
    launcher = _choose_launcher(options, config, hosts, source)
    if elastic:
        check_settings(elastic.settings, launcher)
    command = resolve_command(options.command, check_program=launcher == "local", module=options.module)
    base_env = {**environ, **(config.env if config else {}), **dict(options.extra_env),
                **forwarded_env(options.env_specs, environ)}
    base_env.pop(DEVICE_ORDINAL, None)  # a rank's own, set with its GPUs (an hvdrun started inside a rank inherits it)
    if options.horovod_compat:
        base_env[HOROVOD_COMPAT] = "1"
    base_env.update(interface_env(options.network_interface, base_env))
    check_tuning(base_env)
    _check_backend(base_env, launcher)
    _prepare_output_dir(options.output_dir)
    _check_files_written_at_the_end(options)
    if options.start_timeout_s is not None:
        base_env[START_TIMEOUT] = str(options.start_timeout_s)
    if options.timeline_filename:
        base_env[TIMELINE[0]] = _timeline_path(options.timeline_filename, hosts)
    base_env.update(_binding_env(options, config, slots, layout))
    base_env.pop(PRELOAD, None)
    modules = choose_modules(options.preload, rank_source(command, options.module))
    if modules:
        base_env[PRELOAD] = ",".join(modules)
    warning, warning_notes = plan_warning(options.warn_before_s, options.warn_signal, environ, options.verbose)
    base_env.update(warning.env() if warning else {})
    base_env.update(_state_dir_env(options.state_dir))
    default_python = (config.python if config else None) or sys.executable
    return JobPlan(slots=tuple(slots), command=command, launcher=launcher, options=options, base_env=base_env,
                   cwd=os.getcwd(), default_python=default_python,
                   ssh_port=config.ssh_port if config else None, layout=layout,
                   mpi_flavour=options.mpi_flavour or (config.mpi_flavour if config else None), elastic=elastic,
                   hosts=hosts, console_ranks=_console_ranks(options, len(slots)),
                   forward_signals=DEFAULT_FORWARD_SIGNALS if options.forward_signals is None else
                   parse_signal_list(options.forward_signals),
                   stage=_stage_plan(options, config, hosts, default_python),
                   notes=(*notes, *warning_notes), warning=warning)


def _state_dir_env(state_dir: str | None) -> dict[str, str]:
    """``--state-dir``: ``HVDRUN_STATE_DIR`` for the ranks, made absolute (the ranks may start elsewhere). A
    directory that cannot be written is not an error here: rank 0 says so when it saves, and the job goes on."""
    return {STATE_DIR: str(Path(state_dir).expanduser().resolve())} if state_dir else {}



def _timeline_path(filename: str, hosts: Sequence[Host]) -> str:
    """The timeline's absolute path. Where rank 0 runs on this machine, a place it could not write the file to
    (when the job ends) is a usage error now."""
    path = Path(filename).resolve()
    if hosts and is_local_host(hosts[0].name) and (why := why_unwritable(path)):
        raise UsageError(f"--timeline-filename {filename}: {why} (rank 0 writes the timeline there when the job "
                         "ends)")
    return str(path)


def _check_files_written_at_the_end(options: RunOptions) -> None:
    """``--report`` and ``--metrics-file``, which hvdrun writes as the job runs or ends: a place it could not write
    them to is a usage error before anything starts, not a failure after hours of training."""
    for option, path, appended in (("--report", options.report, False),
                                   ("--metrics-file", options.metrics_file, True)):
        if path and (why := why_unwritable(path, appended)):
            raise UsageError(f"{option} {path}: {why}")

def _network_interface(options: RunOptions, config: ClusterConfig | None,
                       hosts: Sequence[Host]) -> tuple[str | None, tuple[str, ...]]:
    """The interface rank 0 advertises its address on, and a note when the YAML's did not apply:
    ``--network-interface``, else the cluster file's ``network_interface`` (Aurora's hsn0) when the job spans
    hosts and, where rank 0 runs here, this machine has it (a login node or a laptop may not: the route to the
    first remote host decides then, as without the setting); a job on this machine alone talks over loopback."""
    from hvdrun.launch.remote.hostfacts import interface_address

    if options.network_interface or config is None or not config.network_interface:
        return options.network_interface, ()
    name = config.network_interface
    if all(is_local_host(host.name) for host in hosts):
        return None, ()
    if hosts and is_local_host(hosts[0].name) and interface_address(name) is None:
        return None, (f"this machine has no IPv4 address on {name} (network_interface of {config.source}); rank 0 "
                      "advertises the address of the route to the other hosts instead",)
    return name, ()


def _stage_plan(options: RunOptions, config: ClusterConfig | None, hosts: Sequence[Host],
                default_python: str) -> StagePlan | None:
    """``--stage-env``: the directory (``--stage-dir``, the YAML's ``local_dir``, else /tmp) and the environment
    of every host's Python (spares too); None without it."""
    if not (options.stage_env or options.stage_dir):
        return None
    if options.elastic:
        raise UsageError("--stage-env copies the environment before the ranks start, and an elastic job's hosts "
                         "join while it runs: drop --stage-env, or the elastic options")
    if options.stage_dir:
        directory = check_stage_dir(options.stage_dir, "--stage-dir")
    elif config is not None and config.local_dir:
        directory = check_stage_dir(config.local_dir, f"{config.source}: local_dir")
    else:
        directory = DEFAULT_STAGE_DIR
    return plan_staging(directory, [host.python or default_python for host in hosts])


def _console_ranks(options: RunOptions, size: int) -> frozenset[int] | None:
    """``--ranks-output``: the ranks the console shows (None: all); a rank the job does not have is an error."""
    if options.ranks_output is None:
        return None
    try:
        ranks = parse_rank_list(options.ranks_output)
    except UsageError as e:
        raise UsageError(f"--ranks-output: {e}") from None
    if size and max(ranks) >= size:
        raise UsageError(f"--ranks-output {options.ranks_output}: the job has {size} ranks (0-{size - 1}); "
                         f"e.g. --ranks-output 0")
    return ranks


def _binding_env(options: RunOptions, config: ClusterConfig | None, slots: Sequence[Slot],
                 layout: GpuLayout) -> dict[str, str]:
    """``HVDRUN_CPU_BIND`` (``--cpu-bind``, else the YAML's ``cpu_bind``) and, with ``--verbose``, the
    bindings report; the guard applies both on each host. A list too short for a host's ranks is a usage error."""
    from hvdrun.launch.remote.cpubind import CpuBindError, parse_cpu_bind

    policy = options.cpu_bind or (config.cpu_bind if config else None) or "none"
    try:
        bind = parse_cpu_bind(policy)
    except CpuBindError as e:
        where = "" if options.cpu_bind or config is None else f"{config.source}: cpu_bind: "
        raise UsageError(f"{where}{e}") from None
    most = max((slot.local_size for slot in slots), default=0)
    if bind.policy == "list" and len(bind.lists) < most:
        raise UsageError(f"--cpu-bind {policy}: {len(bind.lists)} core lists for {most} ranks on a host; give one "
                         "list per local rank")
    env = {**({CPU_BIND: policy} if bind.binds else {}), **({BIND_REPORT: "1"} if options.verbose else {})}
    if bind.policy == "cores" and layout.gpus_per_node:
        env[GPU_LAYOUT] = layout_value(layout)
    return env


def _num_proc(options: RunOptions, hosts: tuple[Host, ...]) -> int:
    """-np, or every slot of the hosts not held back by --spares."""
    if options.spares and options.spares >= len(hosts):
        raise UsageError(f"--spares {options.spares} holds back every one of the {len(hosts)} host(s); "
                         "give more hosts or fewer spares")
    in_use = hosts[:len(hosts) - options.spares]
    if options.num_proc is None:
        return total_slots(in_use)
    if options.spares and options.num_proc > total_slots(in_use):
        raise UsageError(f"-np {options.num_proc} needs more than the {total_slots(in_use)} slots left after "
                         f"--spares {options.spares}; lower -np or give fewer spares")
    return options.num_proc


def _elastic_plan(options: RunOptions, hosts: tuple[Host, ...]) -> ElasticPlan:
    """The elastic settings: --min-np defaults to -np; with a fixed host list -np also caps the workers; without
    --blacklist-scope the pool decides at each failure (:meth:`WorkerPool.scope`)."""
    cap = options.max_np or (options.num_proc if not options.host_discovery_script else None)
    settings = ElasticSettings(min_np=options.min_np or options.num_proc or 1, max_np=cap,
                               timeout_s=options.elastic_timeout_s or DEFAULT_ELASTIC_TIMEOUT_S,
                               reset_limit=options.reset_limit,
                               cooldown_s=tuple(options.cooldown_range or DEFAULT_COOLDOWN_S),  # type: ignore[arg-type]
                               blacklist_scope=options.blacklist_scope)
    return ElasticPlan(settings, hosts, options.host_discovery_script, options.slots_per_host)


def _check_backend(env: Mapping[str, str], launcher: str) -> None:
    """HVDRUN_BACKEND=mpi needs ranks that MPI started: under the local or SSH launcher each rank would be a
    world of its own."""
    if env.get(BACKEND, "").lower() == "mpi" and launcher in ("local", "ssh"):
        raise UsageError(f"{BACKEND}=mpi needs ranks started by MPI, and the {launcher} launcher does not start "
                         f"them that way: use --launcher mpiexec (or drop {BACKEND} to use hvdrun's ring)")


def _prepare_output_dir(path: str | None) -> None:
    """Create ``--output-dir`` before anything starts; an unusable one is a usage error."""
    if path is None:
        return
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--output-dir {path}: cannot create it: {e.strerror}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--output-dir {path}: not writable by this user")


def describe_plan(plan: JobPlan) -> str:
    """A table of the ranks: host, local and cross rank, GPUs, and the command."""
    lines = [f"hvdrun: {len(plan.slots)} ranks, launcher {plan.launcher}: {' '.join(plan.command)}"]
    if plan.base_env.get(PRELOAD) and plan.launcher in ("local", "ssh"):
        lines.append(f"hvdrun: preload: {plan.base_env[PRELOAD]} (imported once per host; ranks start by fork "
                     "where their Python and environment allow)")
    lines.append("  rank  host                  local  cross  gpus")
    for slot in plan.slots:
        lines.append(f"  {slot.rank:<5} {slot.hostname:<21} {slot.local_rank}/{slot.local_size:<4} "
                     f"{slot.cross_rank}/{slot.cross_size:<4} {','.join(slot.devices) or '-'}")
    return "\n".join(lines)


def start_timeout_s(options: RunOptions) -> float:
    """--start-timeout, or its default."""
    return options.start_timeout_s or DEFAULT_START_TIMEOUT_S
