"""Cluster YAML files -> frozen, validated :class:`ClusterConfig`.

A cluster file describes one machine type::

    name: polaris
    launcher: mpiexec          # local | ssh | mpiexec
    gpus_per_node: 4
    gpu_order: [3, 2, 1, 0]    # CUDA_VISIBLE_DEVICES order; ints or MIG UUIDs
    gpu_vendor: nvidia         # nvidia | intel | amd: CUDA_VISIBLE_DEVICES, ZE_AFFINITY_MASK or ROCR_VISIBLE_DEVICES
    tiles_per_gpu: 2           # Intel GPUs whose tiles get a rank each (gpus_per_node then counts tiles)
    cpu_bind: list:1-8:9-16    # none | cores | numa | list:A-B:C-D... (one core list per local rank)
    gpu_bind: hvdrun           # hvdrun (the vendor's variable) | launcher (PALS --gpu-bind, with rank visibility)
    gpu_visibility: node       # node: every rank sees its host's GPUs in gpu_order (ordinal local_rank is its
                               # own); rank: each rank sees only its own GPU(s) (strict isolation)
    gpus_per_rank: 1
    hosts: ["x3001c0s7b0n0:4"] # optional; usually the scheduler allocation is used
                               # or mappings: {name: n1, slots: 4, user: me, python: /x/bin/python}
    python: /opt/conda/bin/python  # the workers' Python on every host (or venv: /path/to/venv)
    local_dir: /tmp            # a directory on each node's own disk: where --stage-env copies the environment
    network_interface: hsn0    # rank 0 advertises its address on this interface when the job spans hosts
    ssh_port: 22
    mpi_flavour: pals          # launcher mpiexec: mpich | openmpi | pals (default: detected)
    ranks_per_node: 4          # ranks on every host (default: its slots, or one per GPU)
    env: {NCCL_NET_GDR_LEVEL: PHB}
    scheduler:                 # defaults for `hvdrun qsub`; its flags override them
      kind: pbs                # pbs | cobalt | slurm
      queue: debug
      account: MyProject
      walltime: "01:00:00"     # minutes (90) or HH:MM:SS
      filesystems: [home, eagle]
      system: polaris          # PBS: select=N:system=polaris
      place: scatter           # PBS: -l place=...
      required: [account, walltime, filesystems]   # fields a job must have on this machine
      valid_filesystems: [home, eagle]
      setup: ["module use /soft/modulefiles", "module load conda"]   # shell lines run before hvdrun
      filesystem_mpi_args: {daos_user_fs: [--no-vni]}   # mpiexec arguments a job on that filesystem needs
      queues:                  # limits checked before submitting
        debug: {min_nodes: 1, max_nodes: 2, max_walltime: "01:00:00"}
        by-gpu: {nodes_allowed: [1, 2, 4, 8], unit: gpus}
    sources:                   # the pages the site facts above were read from (hvdrun/site_sources.py)
      repository: argonne-lcf/user-guides
      commit: 7d04a3f91d5eaf6d731be6d267617c2e5cbe722e
      read: "2026-11-27"
      pages: {docs/polaris/running-jobs/index.md: [scheduler.queues]}

Unknown keys and wrong types raise :class:`ConfigError` naming the file, the key and
what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hvdrun.errors import ConfigError, HostSpecError, UsageError
from hvdrun.hosts import Host, merge_duplicates, parse_host_item
from hvdrun.ranks import GPU_BINDERS, GPU_VENDORS, GPU_VISIBILITIES
from hvdrun.resources import data_dir
from hvdrun.schedulers import DEFAULT_SCHEDULER, SCHEDULERS
from hvdrun.site_sources import SiteSources, parse_sources

LAUNCHERS = ("local", "ssh", "mpiexec", "srun")
MPI_FLAVOURS = ("mpich", "openmpi", "pals")
REQUIRABLE = ("account", "walltime", "filesystems", "queue")

_TOP_KEYS = ("name", "description", "launcher", "gpus_per_node", "gpu_order", "gpus_per_rank", "hosts", "env",
             "ssh_port", "python", "venv", "scheduler", "mpi_flavour", "ranks_per_node", "gpu_vendor", "tiles_per_gpu",
             "gpu_visibility", "cpu_bind", "gpu_bind", "local_dir", "network_interface", "mounts", "sources")
_HOST_KEYS = ("name", "slots", "user", "python", "venv")
_SCHEDULER_KEYS = ("kind", "queue", "account", "walltime", "filesystems", "template", "extra_directives",
                   "skip_directives", "max_nodes", "system", "place", "required", "valid_filesystems", "setup",
                   "queues", "max_walltime", "filesystem_mpi_args", "copper")
_COPPER_KEYS = ("module", "launch", "stop", "mount", "when")
COPPER_WHEN = ("asked", "custom_env")  # --copper only, or also every job with its own environment (--venv, --conda)
_COPPER_MOUNT_RE = re.compile(r"(?:[A-Za-z0-9_./-]|\$\{[A-Za-z_][A-Za-z0-9_]*\})+")  # a path; ${VAR} expands
_COMMAND_RE = re.compile(r"[A-Za-z0-9_./-]+")
_QUEUE_KEYS = ("min_nodes", "max_nodes", "max_walltime", "nodes_allowed", "unit", "routes")
_ROUTE_KEYS = ("min_nodes", "max_nodes", "max_walltime")
_INTERFACE_RE = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")  # a Linux interface name (IFNAMSIZ 16)
_WALLTIME_RE = re.compile(r"(?:(\d{1,3})-)?(\d{1,4}):([0-5]\d):([0-5]\d)")


def parse_walltime(value: str | int, where: str) -> int:
    """Seconds of a walltime given as minutes (``90``), ``HH:MM:SS`` or ``D-HH:MM:SS``.

    Raises:
        UsageError: anything else, or zero.
    """
    text = str(value).strip()
    if text.isdigit():
        seconds = int(text) * 60
    else:
        match = _WALLTIME_RE.fullmatch(text)
        if not match:
            raise UsageError(f"{where}: walltime {text!r} is not minutes (e.g. 90) or HH:MM:SS (e.g. 01:30:00)")
        days, hours, minutes, secs = (int(g or 0) for g in match.groups())
        seconds = ((days * 24 + hours) * 60 + minutes) * 60 + secs
    if seconds <= 0:
        raise UsageError(f"{where}: walltime {text!r} must be longer than zero")
    return seconds


def format_hms(seconds: int) -> str:
    """``5400`` -> ``01:30:00`` (hours may exceed 24: ``48:00:00``)."""
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


@dataclass(frozen=True)
class QueueRoute:
    """One execution queue a routing queue sends jobs of ``min_nodes``..``max_nodes`` nodes to."""

    name: str
    min_nodes: int
    max_nodes: int | None
    max_walltime_s: int | None


@dataclass(frozen=True)
class QueueLimits:
    """What one queue accepts; ``unit`` says what ``-n`` counts there (``nodes`` or ``gpus``).

    ``routes`` lists the execution queues of a routing queue (Polaris's and Aurora's ``prod``), whose
    walltime limits depend on the node count.
    """

    min_nodes: int | None = None
    max_nodes: int | None = None
    max_walltime_s: int | None = None
    nodes_allowed: tuple[int, ...] = ()
    unit: str = "nodes"
    routes: tuple[QueueRoute, ...] = ()


@dataclass(frozen=True)
class CopperSettings:
    """ALCF's Copper (a read-only cooperative cache of Python imports) as the cluster file gives it: the module,
    its start and stop scripts, the mount (``${USER}`` expands in the job) and when a job gets it."""

    module: str
    launch: str
    stop: str
    mount: str
    when: str = "asked"


@dataclass(frozen=True)
class SchedulerDefaults:
    """Defaults for job scripts of this cluster; ``hvdrun qsub`` flags override them."""

    kind: str = DEFAULT_SCHEDULER
    queue: str | None = None
    account: str | None = None
    walltime: str | None = None
    filesystems: tuple[str, ...] = ()
    template: str | None = None
    extra_directives: tuple[str, ...] = ()
    skip_directives: tuple[str, ...] = ()
    max_nodes: int | None = None
    system: str | None = None
    place: str | None = None
    required: tuple[str, ...] = ()
    valid_filesystems: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    queues: Mapping[str, QueueLimits] = field(default_factory=dict)
    max_walltime_s: int | None = None
    filesystem_mpi_args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # filesystem -> mpiexec args
    copper: CopperSettings | None = None  # hvdrun qsub --copper (jobs/spec.py)


@dataclass(frozen=True)
class ClusterConfig:
    """One machine type, as read from a cluster YAML file."""

    name: str
    source: str
    launcher: str | None = None
    gpus_per_node: int = 0
    gpu_order: tuple[str, ...] | None = None
    gpus_per_rank: int = 1
    hosts: tuple[Host, ...] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    ssh_port: int | None = None
    python: str | None = None
    scheduler: SchedulerDefaults | None = None
    mpi_flavour: str | None = None
    ranks_per_node: int | None = None
    gpu_vendor: str = "nvidia"
    tiles_per_gpu: int = 1
    cpu_bind: str | None = None
    gpu_bind: str = "hvdrun"
    gpu_visibility: str = "node"  # node: every rank sees the host's GPUs in gpu_order; rank: only its own
    local_dir: str | None = None  # node-local directory for --stage-env (launch/staging.py)
    network_interface: str | None = None  # rank 0's address is this interface's when the job spans hosts
    mounts: tuple[str, ...] = ()  # file systems every node must have mounted (hvdrun check --health, --preflight)
    sources: SiteSources | None = None  # the pages the site facts come from (site_sources.py)


class _Section:
    """Typed access to one mapping of a YAML file; errors name the file and the key."""

    def __init__(self, data: Any, source: str, prefix: str, allowed: tuple[str, ...]) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: '{prefix or 'top level'}' must be a mapping, got {_kind(data)}")
        unknown = [str(k) for k in data if k not in allowed]
        if unknown:
            raise ConfigError(f"{source}: unknown key '{prefix}{unknown[0]}'; allowed keys: {', '.join(allowed)}")
        self.data, self.source, self.prefix = data, source, prefix

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = self.data.get(key, default)
        if value is None or value is default:
            return value
        if isinstance(value, bool) and kind is int or not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise ConfigError(f"{self.source}: '{self.prefix}{key}' must be {names}, got {_kind(value)} {value!r}")
        return value

    def positive_int(self, key: str, default: int | None) -> int | None:
        value = self.get(key, int, default)
        if value is not None and value < (0 if key == "gpus_per_node" else 1):
            raise ConfigError(f"{self.source}: '{self.prefix}{key}' must be a positive integer, got {value}")
        return value

    def choice(self, key: str, choices: tuple[str, ...], default: str | None) -> str | None:
        value = self.get(key, str, default)
        if value is not None and value not in choices:
            raise ConfigError(f"{self.source}: '{self.prefix}{key}' is '{value}'; expected one of {', '.join(choices)}")
        return value

    def str_list(self, key: str) -> tuple[str, ...]:
        values = self.get(key, list, [])
        for value in values:
            if not isinstance(value, (str, int)) or isinstance(value, bool):
                raise ConfigError(f"{self.source}: items of '{self.prefix}{key}' must be strings, got {value!r}")
        return tuple(str(v) for v in values)


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "nothing"}.get(type(value), type(value).__name__)


def _parse_hosts(section: _Section, default_python: str | None) -> tuple[Host, ...] | None:
    items = section.get("hosts", list)
    if items is None:
        return None
    hosts = []
    for index, item in enumerate(items):
        where = f"{section.source}: hosts[{index}]"
        python = None
        if isinstance(item, dict):
            entry = _Section(item, section.source, f"hosts[{index}].", _HOST_KEYS)
            python = _python(entry)
            item = f"{entry.get('name', str, '')}:{entry.positive_int('slots', 1)}"
            user = entry.get("user", str)
            item = f"{user}@{item}" if user else item
        if not isinstance(item, str):
            raise ConfigError(f"{where} must be 'host:slots' or a mapping with name and slots, got {item!r}")
        try:
            hosts.append(replace(parse_host_item(item, where), python=python or default_python))
        except HostSpecError as e:
            raise ConfigError(str(e)) from e
    return merge_duplicates(hosts, f"{section.source}: hosts")


def _python(section: _Section) -> str | None:
    """``python: PATH`` or ``venv: DIR`` (meaning DIR/bin/python); not both."""
    python, venv = section.get("python", str), section.get("venv", str)
    if python and venv:
        raise ConfigError(f"{section.source}: give either '{section.prefix}python' or '{section.prefix}venv', not both")
    for key, value in (("python", python), ("venv", venv)):
        if value is not None and (not value.startswith("/") or any(c in value for c in "\n\0")):
            raise ConfigError(f"{section.source}: '{section.prefix}{key}' must be an absolute path, got {value!r}")
    return python or (f"{venv.rstrip('/')}/bin/python" if venv else None)


def _absolute_path(section: _Section, key: str) -> str | None:
    """An absolute path (no line break or NUL), or None when the key is missing."""
    value = section.get(key, str)
    if value is not None and (not value.startswith("/") or any(c in value for c in "\n\r\0")):
        raise ConfigError(f"{section.source}: '{section.prefix}{key}' must be an absolute path, e.g. /tmp, "
                          f"got {value!r}")
    return value


def _mounts(section: _Section) -> tuple[str, ...]:
    """``mounts``: absolute paths, each a mount point every node must have (``/lus/flare``)."""
    paths = tuple(section.str_list("mounts"))
    for path in paths:
        if not path.startswith("/") or any(c in path for c in "\n\r\0"):
            raise ConfigError(f"{section.source}: every entry of '{section.prefix}mounts' must be an absolute path, "
                              f"e.g. [/lus/flare], got {path!r}")
    return paths


def _parse_env(section: _Section) -> dict[str, str]:
    env = section.get("env", dict, {})
    for key, value in env.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"{section.source}: env key {key!r} is not a valid variable name")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{section.source}: env.{key} must be a string or number, got {value!r}")
    return {key: str(value) for key, value in env.items()}


def _parse_scheduler(top: _Section) -> SchedulerDefaults | None:
    data = top.data.get("scheduler")
    if data is None:
        return None
    s = _Section(data, top.source, "scheduler.", _SCHEDULER_KEYS)
    walltime = s.get("walltime", (str, int))
    if walltime is not None:
        _walltime_s(str(walltime), f"{top.source}: scheduler.walltime")
    required = s.str_list("required")
    for name in required:
        if name not in REQUIRABLE:
            raise ConfigError(f"{top.source}: scheduler.required lists {name!r}; allowed: {', '.join(REQUIRABLE)}")
    return SchedulerDefaults(
        kind=s.choice("kind", SCHEDULERS, DEFAULT_SCHEDULER) or DEFAULT_SCHEDULER,
        queue=s.get("queue", str), account=s.get("account", str),
        walltime=str(walltime) if walltime is not None else None,
        filesystems=s.str_list("filesystems"), template=s.get("template", str),
        extra_directives=s.str_list("extra_directives"), skip_directives=s.str_list("skip_directives"),
        max_nodes=s.positive_int("max_nodes", None), system=s.get("system", str), place=s.get("place", str),
        required=required, valid_filesystems=s.str_list("valid_filesystems"), setup=s.str_list("setup"),
        queues=_parse_queues(s), max_walltime_s=_optional_walltime_s(s, "max_walltime", "scheduler."),
        filesystem_mpi_args=_filesystem_mpi_args(s), copper=_copper(s),
    )


def _copper(s: _Section) -> CopperSettings | None:
    """``scheduler.copper``: module, launch and stop scripts, mount, when (asked | custom_env)."""
    data = s.data.get("copper")
    if data is None:
        return None
    c = _Section(data, s.source, "scheduler.copper.", _COPPER_KEYS)
    values = {}
    for key, pattern, example in (("module", _COMMAND_RE, "copper"), ("launch", _COMMAND_RE, "launch_copper.sh"),
                                  ("stop", _COMMAND_RE, "stop_copper.sh"),
                                  ("mount", _COPPER_MOUNT_RE, "/tmp/${USER}/copper_mount")):
        value = c.get(key, str)
        if value is None or not pattern.fullmatch(value):
            raise ConfigError(f"{s.source}: scheduler.copper.{key} must be given, e.g. {example!r}, got {value!r}")
        values[key] = value
    return CopperSettings(**values, when=c.choice("when", COPPER_WHEN, "asked") or "asked")


def _filesystem_mpi_args(s: _Section) -> dict[str, tuple[str, ...]]:
    """``filesystem_mpi_args``: filesystem -> the mpiexec arguments a job that requests it needs (a filesystem
    of ``valid_filesystems``, when that is given)."""
    result = {}
    valid = s.str_list("valid_filesystems")
    for name, args in s.get("filesystem_mpi_args", dict, {}).items():
        where = f"{s.source}: scheduler.filesystem_mpi_args.{name}"
        if valid and name not in valid:
            raise ConfigError(f"{where}: '{name}' is not in scheduler.valid_filesystems ({', '.join(valid)})")
        if not isinstance(args, list) or not args or not all(isinstance(a, str) and a.strip() for a in args):
            raise ConfigError(f"{where} must list mpiexec arguments, e.g. [--no-vni], got {args!r}")
        result[str(name)] = tuple(args)
    return result


def _walltime_s(text: str, where: str) -> int:
    try:
        return parse_walltime(text, where)
    except UsageError as e:
        raise ConfigError(str(e)) from e


def _optional_walltime_s(section: _Section, key: str, prefix: str) -> int | None:
    value = section.get(key, (str, int))
    return _walltime_s(str(value), f"{section.source}: {prefix}{key}") if value is not None else None


def _parse_queues(s: _Section) -> dict[str, QueueLimits]:
    queues = {}
    for name, data in s.get("queues", dict, {}).items():
        prefix = f"scheduler.queues.{name}."
        q = _Section(data, s.source, prefix, _QUEUE_KEYS)
        allowed = q.get("nodes_allowed", list, [])
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in allowed):
            raise ConfigError(f"{s.source}: {prefix}nodes_allowed must list positive integers, got {allowed!r}")
        queues[str(name)] = QueueLimits(
            min_nodes=q.positive_int("min_nodes", None), max_nodes=q.positive_int("max_nodes", None),
            max_walltime_s=_optional_walltime_s(q, "max_walltime", prefix),
            nodes_allowed=tuple(allowed), unit=q.choice("unit", ("nodes", "gpus"), "nodes") or "nodes",
            routes=_parse_routes(q, prefix))
    return queues


def _parse_routes(queue: _Section, prefix: str) -> tuple[QueueRoute, ...]:
    routes = []
    for name, data in queue.get("routes", dict, {}).items():
        where = f"{prefix}routes.{name}."
        r = _Section(data, queue.source, where, _ROUTE_KEYS)
        routes.append(QueueRoute(name=str(name), min_nodes=r.positive_int("min_nodes", 1) or 1,
                                 max_nodes=r.positive_int("max_nodes", None),
                                 max_walltime_s=_optional_walltime_s(r, "max_walltime", where)))
    return tuple(routes)


def _gpu_visibility(top: _Section, binder: str, source: str) -> str:
    """``gpu_visibility``: node by default; rank where PALS pins (``gpu_bind: launcher`` shows a rank only its own)."""
    visibility = top.choice("gpu_visibility", GPU_VISIBILITIES, None)
    if binder == "launcher" and visibility == "node":
        raise ConfigError(f"{source}: gpu_bind: launcher has PALS show each rank only its own GPUs, which is "
                          "gpu_visibility: rank; drop one of the two (gpu_bind: hvdrun shows every rank its node's)")
    return visibility or ("rank" if binder == "launcher" else "node")


def parse_config(data: Any, source: str) -> ClusterConfig:
    """Validate a decoded YAML document and return its :class:`ClusterConfig`."""
    top = _Section(data, source, "", _TOP_KEYS)
    gpus_per_node = top.positive_int("gpus_per_node", 0) or 0
    gpu_order = top.str_list("gpu_order") or None
    if gpu_order is not None and gpus_per_node and len(gpu_order) != gpus_per_node:
        raise ConfigError(f"{source}: gpu_order lists {len(gpu_order)} GPUs but gpus_per_node is {gpus_per_node}")
    python = _python(top)
    vendor = top.choice("gpu_vendor", GPU_VENDORS, "nvidia") or "nvidia"
    tiles = top.positive_int("tiles_per_gpu", 1) or 1
    if tiles > 1 and vendor != "intel":
        raise ConfigError(f"{source}: tiles_per_gpu is {tiles} but gpu_vendor is '{vendor}'; tiles are pinned "
                          "one by one only on Intel GPUs (gpu_vendor: intel)")
    if tiles > 1 and gpus_per_node % tiles:
        raise ConfigError(f"{source}: gpus_per_node {gpus_per_node} counts tiles and must be a multiple of "
                          f"tiles_per_gpu {tiles}")
    binder = top.choice("gpu_bind", GPU_BINDERS, "hvdrun") or "hvdrun"
    return ClusterConfig(
        name=top.get("name", str, Path(source).stem), source=source, python=python,
        launcher=top.choice("launcher", LAUNCHERS, None),
        gpus_per_node=gpus_per_node or (len(gpu_order) if gpu_order else 0), gpu_order=gpu_order,
        gpus_per_rank=top.positive_int("gpus_per_rank", 1) or 1,
        hosts=_parse_hosts(top, python), env=_parse_env(top),
        ssh_port=top.positive_int("ssh_port", None), scheduler=_parse_scheduler(top),
        mpi_flavour=top.choice("mpi_flavour", MPI_FLAVOURS, None),
        ranks_per_node=top.positive_int("ranks_per_node", None), gpu_vendor=vendor, tiles_per_gpu=tiles,
        cpu_bind=top.get("cpu_bind", str),  # checked where it is used (launch/job.py)
        gpu_bind=binder, gpu_visibility=_gpu_visibility(top, binder, source),
        local_dir=_absolute_path(top, "local_dir"), network_interface=_interface(top), mounts=_mounts(top),
        sources=parse_sources(data.get("sources"), data, source),
    )


def _interface(top: _Section) -> str | None:
    """``network_interface``: a Linux interface name such as hsn0."""
    name = top.get("network_interface", str)
    if name is not None and not _INTERFACE_RE.fullmatch(name):
        raise ConfigError(f"{top.source}: 'network_interface' must be an interface name such as hsn0 or ib0 "
                          f"(up to 15 letters, digits, '_', '.', ':', '@' or '-'), got {name!r}")
    return name


def load_config(path: str | Path) -> ClusterConfig:
    """Read and validate the cluster YAML file at ``path``."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read cluster config '{path}': {e.strerror}") from e
    except UnicodeDecodeError:
        raise ConfigError(f"cluster config '{path}' is not a UTF-8 text file (expected YAML)") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error_message(str(path), e)) from e
    return parse_config(data, str(path))


def yaml_error_message(where: str, error: Exception) -> str:
    """One line for PyYAML's multi-line error, e.g. for ``a: b: c`` in bad.yaml:
    ``bad.yaml:1:5: not valid YAML: mapping values are not allowed here``."""
    import yaml

    if not isinstance(error, yaml.MarkedYAMLError) or error.problem_mark is None:
        return f"{where}: not valid YAML: {str(error).splitlines()[0]}"
    mark = error.problem_mark
    message = f"{where}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {error.problem}"
    if error.context and error.context_mark is not None:
        start = error.context_mark
        message += f" ({error.context} that starts at {start.line + 1}:{start.column + 1})"
    return message


def available_clusters() -> list[str]:
    """Names of the cluster files shipped in ``cluster_configs/``."""
    return sorted(p.stem for p in data_dir("cluster_configs").glob("*.yaml"))


def load_cluster(name: str) -> ClusterConfig:
    """Load the shipped cluster file ``cluster_configs/<name>.yaml``."""
    path = data_dir("cluster_configs") / f"{name}.yaml"
    if "/" in name or not path.is_file():
        raise ConfigError(f"unknown cluster '{name}'; available: {', '.join(available_clusters())} "
                          "(or give a file with --config)")
    return load_config(path)


def load_cluster_config(cluster: str | None, config_file: str | Path | None) -> ClusterConfig | None:
    """The cluster YAML that ``--cluster NAME`` or ``--config FILE`` names (None when neither is given).

    Raises:
        UsageError: both are given.
        ConfigError: the cluster is unknown, or the file cannot be read or is not valid.
    """
    if cluster and config_file:
        raise UsageError("give either --cluster NAME or --config FILE, not both")
    if cluster:
        return load_cluster(cluster)
    return load_config(config_file) if config_file else None
