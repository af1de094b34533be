"""The launcher -> worker environment contract. The ONLY module that spells these names.

Every worker, however it was started, receives its place in the job three times over:
as ``HVDRUN_*``, as Horovod's ``HOROVOD_*`` and as torchrun's ``RANK``/``WORLD_SIZE``/...
so hvdrun, Horovod and torch.distributed ``env://`` scripts all run unchanged.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdrun.errors import UsageError
from hvdrun.ranks import Slot

RANK = "HVDRUN_RANK"
SIZE = "HVDRUN_SIZE"
LOCAL_RANK = "HVDRUN_LOCAL_RANK"
LOCAL_SIZE = "HVDRUN_LOCAL_SIZE"
CROSS_RANK = "HVDRUN_CROSS_RANK"
CROSS_SIZE = "HVDRUN_CROSS_SIZE"
HOSTNAME = "HVDRUN_HOSTNAME"
RENDEZVOUS_ADDR = "HVDRUN_RENDEZVOUS_ADDR"
RENDEZVOUS_PORT = "HVDRUN_RENDEZVOUS_PORT"
SECRET = "HVDRUN_SECRET"
# never on a command line (`ps` shows those to every user of a node): mpiexec gets them in its environment,
# an SSH guard reads them from its channel (launch/mpiexec.py, launch/ssh.py)
STAGE_TOKEN = "HVDRUN_STAGE_TOKEN"  # --stage-env: what the staging relays prove (launch/stage_tree.py)
OFF_THE_COMMAND_LINE = (SECRET, STAGE_TOKEN)
JOB_ID = "HVDRUN_JOB_ID"
BACKEND = "HVDRUN_BACKEND"
MPIEXEC = "HVDRUN_MPIEXEC"  # the mpiexec --launcher mpiexec runs (default: beside this Python, then PATH)
MPI_PLAN = "HVDRUN_MPI_PLAN"  # hosts, -np and GPU layout, for ranks started by mpiexec (launch/remote/mpirank.py)
# elastic jobs: where the launcher's membership service listens, and which worker this process is
ELASTIC_ADDR = "HVDRUN_ELASTIC_ADDR"
ELASTIC_PORT = "HVDRUN_ELASTIC_PORT"
WORKER_ID = "HVDRUN_WORKER_ID"
FAST_LANE = "HVDRUN_FAST_LANE"  # 0: blocking small allreduces of a one-host job take the engine's path too
# device tensors: the torch.distributed backend that runs them (nccl|gloo), and 1 to route CPU tensors there too
DEVICE_BACKEND = "HVDRUN_DEVICE_BACKEND"
CPU_VIA_DEVICE = "HVDRUN_CPU_VIA_DEVICE_BACKEND"
# --cpu-bind none|cores|numa|depth:D|list:..., applied by the guard (launch/remote/cpubind.py)
CPU_BIND = "HVDRUN_CPU_BIND"
GPU_LAYOUT = "HVDRUN_GPU_LAYOUT"  # --cpu-bind cores: the GPU layout, so the guard puts cores beside each GPU
# the index, among the devices the rank sees, of its own (first) device: hvd.init() makes it the current device
DEVICE_ORDINAL = "HVDRUN_DEVICE_ORDINAL"
BIND_REPORT = "HVDRUN_BIND_REPORT"  # 1: the guard prints the rank's cores, NUMA node and GPU (--verbose)

_TOPOLOGY = {
    "rank": (RANK, "HOROVOD_RANK"),
    "size": (SIZE, "HOROVOD_SIZE"),
    "local_rank": (LOCAL_RANK, "HOROVOD_LOCAL_RANK"),
    "local_size": (LOCAL_SIZE, "HOROVOD_LOCAL_SIZE"),
    "cross_rank": (CROSS_RANK, "HOROVOD_CROSS_RANK"),
    "cross_size": (CROSS_SIZE, "HOROVOD_CROSS_SIZE"),
}
HOROVOD_HOSTNAME = "HOROVOD_HOSTNAME"

TORCH_RANK = "RANK"
TORCH_WORLD_SIZE = "WORLD_SIZE"
TORCH_LOCAL_RANK = "LOCAL_RANK"
TORCH_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
TORCH_GROUP_RANK = "GROUP_RANK"
TORCH_GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
TORCH_ROLE_RANK = "ROLE_RANK"
TORCH_ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
# torchrun's job-wide variables: frameworks test TORCHELASTIC_RUN_ID (is_torchelastic_launched())
TORCHELASTIC = {"ROLE_NAME": "default"}
# which attempt of a job this is (hvdrun --max-restarts): hvdrun's name and torchrun's
RESTART_COUNT = "HVDRUN_RESTART_COUNT"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCH_MASTER_ADDR = "MASTER_ADDR"
TORCH_MASTER_PORT = "MASTER_PORT"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
ZE_AFFINITY_MASK = "ZE_AFFINITY_MASK"  # Intel Level Zero: devices, or GPU.tile ids (Aurora)
ZE_FLAT_DEVICE_HIERARCHY = "ZE_FLAT_DEVICE_HIERARCHY"
ROCR_VISIBLE_DEVICES = "ROCR_VISIBLE_DEVICES"  # AMD ROCm runtime: the devices this process may see
HIP_VISIBLE_DEVICES = "HIP_VISIBLE_DEVICES"  # AMD HIP: indexes among what ROCR_VISIBLE_DEVICES left visible
# whichever shows a rank its devices (ROCR first: on AMD, CUDA_VISIBLE_DEVICES holds indexes within ROCR's)
DEVICE_VARIABLES = (ROCR_VISIBLE_DEVICES, ZE_AFFINITY_MASK, CUDA_VISIBLE_DEVICES)
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"
OMP_NUM_THREADS = "OMP_NUM_THREADS"

# A worker whose uncaught exception is a collective failure (a consequence of another rank's failure) writes
# this line to its stderr before the traceback; the launcher strips it and blames the root cause instead.
CONSEQUENCE_MARKER = b"\x1ehvdrun:failed-because-of-another-rank\n"
# A rank launched by hvdrun writes these lines to its stderr when it enters init() and when init()'s rendezvous
# completed; the launcher strips them, and ends a job at once when a rank ended without entering init() while
# another waits there for it.
INIT_MARKER = b"\x1ehvdrun:entered-init\n"
JOINED_MARKER = b"\x1ehvdrun:joined\n"

_VAR_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # used with fullmatch


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0 serves the job's rendezvous, and the secret that authenticates it.

    Attributes:
        addr: address every worker can reach.
        port: hvdrun's runtime store.
        master_port: torch.distributed's store for ``env://`` scripts.
        secret: per-job secret (hex); runtime connections without it are refused.
        job_id: a short id naming the job in logs and shared-memory segments.
        restart_count: which attempt of the job this is (0: the first; ``--max-restarts``).
        max_restarts: how many restarts the job may make.
        run_id: torchrun's ``TORCHELASTIC_RUN_ID``, the same for every attempt (default: ``job_id``).
        tree: where each host of a large job joins (``HVDRUN_RENDEZVOUS_TREE``, see :mod:`hvdrun.protocol.tree`;
            empty: every host joins rank 0).
    """

    addr: str
    port: int
    master_port: int
    secret: str
    job_id: str
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = ""
    tree: str = ""


def job_env(rendezvous: Rendezvous) -> dict[str, str]:
    """The variables that are the same on every rank of a job."""
    return {
        RENDEZVOUS_ADDR: rendezvous.addr, RENDEZVOUS_PORT: str(rendezvous.port),
        SECRET: rendezvous.secret, JOB_ID: rendezvous.job_id,
        TORCH_MASTER_ADDR: rendezvous.addr, TORCH_MASTER_PORT: str(rendezvous.master_port),
        PYTHONUNBUFFERED: "1", TORCHELASTIC_RUN_ID: rendezvous.run_id or rendezvous.job_id, **TORCHELASTIC,
        RESTART_COUNT: str(rendezvous.restart_count), TORCHELASTIC_RESTART_COUNT: str(rendezvous.restart_count),
        TORCHELASTIC_MAX_RESTARTS: str(rendezvous.max_restarts),
        RENDEZVOUS_TREE: rendezvous.tree,  # always: an empty value keeps a tree in hvdrun's own environment out
    }


def rendezvous_of(environ: Mapping[str, str]) -> Rendezvous:
    """Read back the :class:`Rendezvous` that :func:`job_env` wrote."""
    return Rendezvous(environ[RENDEZVOUS_ADDR], int(environ[RENDEZVOUS_PORT]), int(environ[TORCH_MASTER_PORT]),
                      environ[SECRET], environ[JOB_ID], int(environ.get(RESTART_COUNT, 0)),
                      int(environ.get(TORCHELASTIC_MAX_RESTARTS, 0)), environ.get(TORCHELASTIC_RUN_ID, ""),
                      environ.get(RENDEZVOUS_TREE, ""))


def topology_env(place: Any) -> dict[str, str]:
    """The variables that give a rank's place: ``place`` is a :class:`Slot` or the runtime's world
    (anything with rank, size, local_rank, local_size, cross_rank and cross_size)."""
    env = {name: str(getattr(place, attr)) for attr, names in _TOPOLOGY.items() for name in names}
    env.update({
        TORCH_RANK: str(place.rank), TORCH_WORLD_SIZE: str(place.size),
        TORCH_LOCAL_RANK: str(place.local_rank), TORCH_LOCAL_WORLD_SIZE: str(place.local_size),
        TORCH_GROUP_RANK: str(place.cross_rank), TORCH_GROUP_WORLD_SIZE: str(place.cross_size),
        TORCH_ROLE_RANK: str(place.rank), TORCH_ROLE_WORLD_SIZE: str(place.size),
    })
    return env


def worker_env(slot: Slot, rendezvous: Rendezvous) -> dict[str, str]:
    """The variables one rank gets on top of the forwarded environment."""
    env = job_env(rendezvous)
    env.update(topology_env(slot))
    env.update({
        HOSTNAME: slot.hostname, HOROVOD_HOSTNAME: slot.hostname,
        TORCH_GROUP_RANK: str(slot.host_index), TORCH_GROUP_WORLD_SIZE: str(slot.host_count),
    })
    env.update(device_env(slot.gpu_vendor, slot.visible_devices, slot.device_hierarchy))
    if slot.device_ordinal is not None:
        env[DEVICE_ORDINAL] = str(slot.device_ordinal)
    return env


def device_env(vendor: str, devices: Sequence[str], hierarchy: str = "") -> dict[str, str]:
    """The variables that show a rank ``devices`` of a ``vendor`` GPU, in this order (none without devices):
    device ``i`` of the rank's runtime is ``devices[i]``.

    * nvidia: ``CUDA_VISIBLE_DEVICES`` (indices, or GPU/MIG UUIDs).
    * intel: ``ZE_AFFINITY_MASK``, with ``ZE_FLAT_DEVICE_HIERARCHY`` set to ``hierarchy`` where the ids need
      one: ``FLAT`` for tiles (every tile a device, ids 0..11 on Aurora, the hierarchy ALCF recommends for
      AI/ML), ``COMPOSITE`` for ``GPU.tile`` ids (``0.0`` .. ``5.1``).
    * amd: ``ROCR_VISIBLE_DEVICES`` chooses the devices (in index order: the order is not relied on), and HIP's
      and CUDA's variables give the order, as indexes among what ROCR left (``devices`` 4,5,2,3: ROCR 2,3,4,5,
      HIP 2,3,0,1); they are always set, since an inherited ``HIP_VISIBLE_DEVICES=3`` beside
      ``ROCR_VISIBLE_DEVICES=3`` would otherwise leave the rank with no GPU.
    """
    if not devices:
        return {}
    listed = ",".join(devices)
    if vendor == "intel":
        return {ZE_AFFINITY_MASK: listed, **({ZE_FLAT_DEVICE_HIERARCHY: hierarchy} if hierarchy else {})}
    if vendor == "amd":
        chosen = sorted(devices, key=lambda d: (not d.isdigit(), int(d) if d.isdigit() else 0, d))
        order = ",".join(str(chosen.index(device)) for device in devices)
        return {ROCR_VISIBLE_DEVICES: ",".join(chosen), HIP_VISIBLE_DEVICES: order, CUDA_VISIBLE_DEVICES: order}
    return {CUDA_VISIBLE_DEVICES: listed}


def devices_shown(environ: Mapping[str, str]) -> tuple[str, list[str]] | None:
    """The devices a rank's runtime shows it, in device order, and the variables that say so (for reports):
    ROCR's devices in the order HIP's indexes give on AMD, else the first variable of :data:`DEVICE_VARIABLES`."""
    name = next((name for name in DEVICE_VARIABLES if environ.get(name)), None)
    if name is None:
        return None
    listed = environ[name].split(",")
    order = environ.get(HIP_VISIBLE_DEVICES, "").split(",") if name == ROCR_VISIBLE_DEVICES else []
    if order and all(i.isdigit() and int(i) < len(listed) for i in order):
        return f"{name}={environ[name]} {HIP_VISIBLE_DEVICES}={environ[HIP_VISIBLE_DEVICES]}", [
            listed[int(i)] for i in order]
    return f"{name}={environ[name]}", listed


_JOB_DEVICE_VARIABLE = {"nvidia": CUDA_VISIBLE_DEVICES, "intel": ZE_AFFINITY_MASK, "amd": ROCR_VISIBLE_DEVICES}


def job_devices(vendor: str, environ: Mapping[str, str]) -> tuple[str, tuple[str, ...]] | None:
    """The devices the scheduler gave the job (Slurm ``--gpus``, PBS by-gpu), from the vendor's variable in the
    launcher's environment: ``(variable, ids)``, or None when it is unset, empty or names no device."""
    name = _JOB_DEVICE_VARIABLE.get(vendor, CUDA_VISIBLE_DEVICES)
    ids = tuple(part.strip() for part in environ.get(name, "").split(",") if part.strip())
    if not ids or ids == ("NoDevFiles",):  # Slurm's value for a step without GPUs
        return None
    return name, ids


def rank_variable_names() -> frozenset[str]:
    """Names whose values differ from rank to rank (set by the launcher or the mpiexec rank shim)."""
    return frozenset({*(name for names in _TOPOLOGY.values() for name in names), HOSTNAME, HOROVOD_HOSTNAME,
                      TORCH_RANK, TORCH_WORLD_SIZE, TORCH_LOCAL_RANK, TORCH_LOCAL_WORLD_SIZE, TORCH_GROUP_RANK,
                      TORCH_GROUP_WORLD_SIZE, TORCH_ROLE_RANK, TORCH_ROLE_WORLD_SIZE, CUDA_VISIBLE_DEVICES,
                      ZE_AFFINITY_MASK, ZE_FLAT_DEVICE_HIERARCHY, ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES,
                      OMP_NUM_THREADS, DEVICE_ORDINAL})


def thread_env(slot: Slot, cpus: int, environ: Mapping[str, str]) -> dict[str, str]:
    """``OMP_NUM_THREADS`` = cpus / ranks on the host, unless the user set it (torchrun does the same).

    Without it, every rank's OpenMP pool spins on all cores and starves the others' communication.
    """
    if OMP_NUM_THREADS in environ:
        return {}
    return {OMP_NUM_THREADS: str(max(1, cpus // slot.local_size))}


_SOCKET_IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_env(interface: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """``--network-interface IF``: torch.distributed's gloo and NCCL use IF too, unless the user chose already."""
    if not interface:
        return {}
    return {name: interface for name in _SOCKET_IFNAMES if name not in environ}


def forwarded_env(specs: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """Resolve ``-x VAR`` (value from ``environ``) and ``-x VAR=value`` options.

    Raises:
        UsageError: a name is not a valid variable name, or ``VAR`` is not set.
    """
    result: dict[str, str] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not _VAR_NAME_RE.fullmatch(name):
            raise UsageError(f"-x {spec!r}: {name!r} is not a valid environment variable name; "
                             "expected -x NAME or -x NAME=value")
        if not sep:
            if name not in environ:
                raise UsageError(f"-x {name}: {name} is not set in hvdrun's environment; "
                                 f"set it or give -x {name}=value")
            value = environ[name]
        result[name] = value
    return result


# Shared-memory files of a rank (runtime/transport/shm.py); the launcher's guard removes them once the rank is gone.
SHM_DIR = "/dev/shm"


def shm_segment_base(job_key: str, rank: int, sender: int | None = None) -> str:
    """``/dev/shm/hvdrun-JOB-GEN-RANK`` (+ ``.ring`` / ``.bell``) for ``job_key`` = ``JOB-GEN``; a link's own
    segment (what ``sender`` writes to ``rank``) adds ``.fromSENDER``."""
    base = f"{SHM_DIR}/hvdrun-{job_key}-{rank}"
    return base if sender is None else f"{base}.from{sender}"


def shm_files_glob(job_id: str, rank: int | str = "*") -> str:
    """Every shared-memory file of ``rank`` (default: of every rank) of a job, in any init() generation."""
    return f"{SHM_DIR}/hvdrun-{job_id}-*-{rank}.*"


def guard_options(env: Mapping[str, str]) -> list[str]:
    """The guard's options for a worker with environment ``env``: remove its shared-memory files when it is
    gone, and treat processes carrying its job id and rank as its own even outside its process group."""
    job, rank = env.get(JOB_ID), env.get(RANK)
    if not job or rank is None:
        return []
    return ["--remove", shm_files_glob(job, rank), "--track", f"{JOB_ID}={job}", "--track", f"{RANK}={rank}"]


# The launcher's variables that describe its own login session, not the job: a worker on another host
# keeps that host's values (Horovod's launcher leaves out the same kind).
_SESSION_VARS = frozenset({"HOSTNAME", "HOME", "PWD", "OLDPWD", "SHLVL", "USER", "LOGNAME", "SHELL", "MAIL", "TERM",
                           "DISPLAY", "LS_COLORS", "_", "TMUX", "TMUX_PANE", "PS1", "COLUMNS", "LINES", "MOTD_SHOWN"})
_SESSION_PREFIXES = ("SSH_", "XDG_", "BASH_FUNC_", "KRB5", "DBUS_")


def remote_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a worker's environment that is sent to a rank on another host.

    Everything but the launcher's login-session variables (``HOME``, ``SSH_*``, ...) and names
    that are not valid variable names.
    """
    return {name: value for name, value in env.items()
            if _VAR_NAME_RE.fullmatch(name) and name not in _SESSION_VARS and not name.startswith(_SESSION_PREFIXES)}


# -- what a scheduler or an MPI launcher sets (read by the launchers and the guard; the allocation's host
# lists, PBS_NODEFILE, COBALT_NODEFILE, SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE, are named in hosts.py, their
# one reader besides the Slurm rank below) -----------------------------------------------------------------
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_HOSTFILE = "SLURM_HOSTFILE"  # srun's host list for --distribution=arbitrary
PMI_FD = "PMI_FD"  # hydra's PMI connection, inherited by the rank through the guard
SSH_CONNECTION = "SSH_CONNECTION"  # sshd's "client_ip client_port server_ip server_port" (launch/remote/hostfacts.py)
# hosts hvdrun reaches itself over SSH; past that many, the host agents reach the others in a tree
# (launch/agent_forest.py)
SSH_FANOUT = "HVDRUN_SSH_FANOUT"
TASK = "HVDRUN_TASK"  # hvdrun.run(fn): the pickled call a rank runs (launch/remote/task.py)
PRELOAD = "HVDRUN_PRELOAD"  # modules each host's fork server imports once, comma-separated (launch/remote/preload.py)
PROC_ROOM = "HVDRUN_PROC_ROOM"  # blanks in the fork server's environment: room for a forked rank's (proctitle.py)
# a zygote's Unix socket: it forks the local fork server instead of a new interpreter (launch/remote/zygote.py;
# for test suites, never for a job a scheduler starts)
FORK_SERVER_FROM = "HVDRUN_FORK_SERVER_FROM"

# -- the worker side: who started us? -------------------------------------------------------

START_TIMEOUT = "HVDRUN_START_TIMEOUT"
DEFAULT_START_TIMEOUT_S = 60.0
TRANSPORT = "HVDRUN_TRANSPORT"
# flat: every rank joins rank 0 itself (default: a host's ranks join through its local rank 0, runtime/rendezvous/)
RENDEZVOUS = "HVDRUN_RENDEZVOUS"
# set by the launcher past RENDEZVOUS_FANOUT + 1 hosts: the rendezvous tree of hosts (hvdrun/protocol/tree.py)
RENDEZVOUS_TREE = "HVDRUN_RENDEZVOUS_TREE"
RENDEZVOUS_FANOUT = "HVDRUN_RENDEZVOUS_FANOUT"  # hosts each leader admits (the launcher's; default 32)
FUSION_THRESHOLD = ("HVDRUN_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD")
STALL_WARNING_S = ("HVDRUN_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_CHECK_TIME_SECONDS")
STALL_ERROR_S = ("HVDRUN_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
EAGER_BYTES = ("HVDRUN_EAGER_BYTES",)
CACHE_CAPACITY = ("HVDRUN_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY")
# across hosts: auto | flat | ring | doubling | halving (runtime/collectives/hierarchical.py), and the crossovers
ALGORITHM = ("HVDRUN_ALGORITHM",)
ALGORITHMS = ("auto", "flat", "ring", "doubling", "halving")
DOUBLING_MAX_BYTES = ("HVDRUN_DOUBLING_MAX_BYTES",)
HALVING_MAX_BYTES = ("HVDRUN_HALVING_MAX_BYTES",)
OVERLAP = "HVDRUN_OVERLAP"
# how a rank waits for a peer: active (spins a while, then sleeps), passive (sleeps at once, the core goes to whoever
# needs it), auto: active where a host's ranks do not outnumber its cores (as OMP_WAIT_POLICY; runtime/transport)
WAIT_POLICY = ("HVDRUN_WAIT_POLICY",)
WAIT_POLICIES = ("auto", "active", "passive")
# the compiled module (runtime/compiled): auto (used when built), off (pure Python), on (an error when not built)
COMPILED = ("HVDRUN_COMPILED",)
COMPILED_MODES = ("auto", "on", "off")
TIMELINE = ("HVDRUN_TIMELINE", "HOROVOD_TIMELINE")
TIMELINE_MARK_CYCLES = ("HVDRUN_TIMELINE_MARK_CYCLES", "HOROVOD_TIMELINE_MARK_CYCLES")
CYCLE_TIME_MS = ("HVDRUN_CYCLE_TIME", "HOROVOD_CYCLE_TIME")
STALL_CHECK_DISABLE = ("HVDRUN_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_DISABLE")
LOG_LEVEL = ("HVDRUN_LOG_LEVEL", "HOROVOD_LOG_LEVEL")
HOROVOD_COMPAT = "HVDRUN_HOROVOD_COMPAT"  # "1": the guard puts the 'horovod' shim package first on PYTHONPATH

# -- launcher-side names (hvdrun/horovodrun.py, hvdrun/jobs, `hvdrun --help`) -------------------------
# Horovod's spelling of the tuning variables above: horovodrun's options set these, as Horovod's launcher does
HOROVOD_FUSION_THRESHOLD = FUSION_THRESHOLD[1]
HOROVOD_CYCLE_TIME = CYCLE_TIME_MS[1]
HOROVOD_TIMELINE = TIMELINE[1]
HOROVOD_TIMELINE_MARK_CYCLES = TIMELINE_MARK_CYCLES[1]
HOROVOD_STALL_CHECK_DISABLE = STALL_CHECK_DISABLE[1]
HOROVOD_STALL_CHECK_TIME_SECONDS = STALL_WARNING_S[1]
HOROVOD_STALL_SHUTDOWN_TIME_SECONDS = STALL_ERROR_S[1]
HOROVOD_LOG_LEVEL = LOG_LEVEL[1]
HOROVOD_CACHE_CAPACITY = "HOROVOD_CACHE_CAPACITY"  # horovodrun --cache-capacity, passed on (hvdrun has no cache)
# seconds a console may take nothing while the ranks' output waits for it before that output stops waiting (0: for ever)
CONSOLE_STALL_S = "HVDRUN_CONSOLE_STALL_S"
DEFAULT_CONSOLE_STALL_S = 5.0
JOBS_DIR = "HVDRUN_JOBS_DIR"  # hvdrun's job records (default ~/.hvdrun/jobs): qsub's, and running/ for `stacks`
# jobs longer than a walltime (hvdrun/walltime.py, launch/warning.py): the allocation's end as seconds since the
# epoch, the warning's lead in seconds (--warn-before) and its signal's number (--warn-signal), set for the ranks
DEADLINE = "HVDRUN_DEADLINE"
WARN_BEFORE = "HVDRUN_WARN_BEFORE"
WARN_SIGNAL = "HVDRUN_WARN_SIGNAL"
STATE_DIR = "HVDRUN_STATE_DIR"  # --state-dir: where hvd.elastic state outlives the job (torch/lasting_state.py)
STATE_INTERVAL_S = "HVDRUN_STATE_INTERVAL_S"  # seconds between two saves of it at commits (default 300)
# a job of a chain (hvdrun qsub --chain): the file where the job's hvdrun notes that it warned the ranks, or that a
# stop signal ended it (jobs/chain.py reads it to decide whether the next job of the chain runs)
JOB_EVENTS = "HVDRUN_JOB_EVENTS"
LC_ALL = "LC_ALL"  # scheduler commands run with LC_ALL=C: their output is parsed


def warning_signal(environ: Mapping[str, str]) -> int | None:
    """The signal hvdrun warns the ranks with before the allocation ends (``--warn-signal``), None without a
    warning. A rank starts with it ignored (the guard, a forked rank), so that a warning that comes before the
    script's own handler, or to a script that has none, never ends the rank."""
    text = environ.get(WARN_SIGNAL, "")
    return int(text) if text.isdigit() and 0 < int(text) < 65 else None


def jobs_dir(environ: Mapping[str, str] | None = None) -> Path:
    """hvdrun's job records: ``$HVDRUN_JOBS_DIR``, default ``~/.hvdrun/jobs``."""
    value = (os.environ if environ is None else environ).get(JOBS_DIR)
    return Path(value) if value else Path.home() / ".hvdrun" / "jobs"


# the Environment section of `hvdrun --help`: (name, what it does)
HELP = (
    (HOROVOD_FUSION_THRESHOLD, "bytes fused into one allreduce (--fusion-threshold-mb)"),
    (HOROVOD_CYCLE_TIME, "ms between negotiation cycles of the mpi/gloo backends (--cycle-time-ms)"),
    (HOROVOD_STALL_CHECK_TIME_SECONDS, "warn about ops some ranks have not submitted after this long"),
    (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, "fail them after this long"),
    (HOROVOD_STALL_CHECK_DISABLE, "1: no stall warning or shutdown (--no-stall-check)"),
    (HOROVOD_TIMELINE, "Chrome-trace timeline file of rank 0, or DYNAMIC (--timeline-filename)"),
    (HOROVOD_LOG_LEVEL, "ERROR or FATAL silence the runtime's warnings (--log-level)"),
    (BACKEND, "ring (default), mpi (under mpiexec) or gloo (torch.distributed)"),
    (START_TIMEOUT, "seconds the ranks wait for each other in init() (--start-timeout)"),
    (MPIEXEC, "the mpiexec of --launcher mpiexec"),
    (SSH_FANOUT, "hosts hvdrun reaches over SSH itself (32); the agents on those reach the others, a tree"),
    (CONSOLE_STALL_S, "a console that takes nothing this long no longer holds the ranks' output (5; 0: never)"),
    (JOBS_DIR, "where hvdrun qsub records submitted jobs and running jobs are registered (~/.hvdrun/jobs)"),
    ("set for every rank", "HVDRUN_RANK/SIZE/LOCAL_RANK/..., HOROVOD_RANK/..., RANK, WORLD_SIZE, LOCAL_RANK, "
                           "MASTER_ADDR/PORT, GROUP_RANK, TORCHELASTIC_RUN_ID, CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS"),
)
# -- end of launcher-side names ---------------------------------------------------------------------

# (rank, size) variables of the launchers we recognise, in order of preference
_MPI_RANKS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"), ("PALS_RANKID", "PMI_SIZE"))
_SLURM_RANK = ("SLURM_PROCID", "SLURM_NTASKS")
_PMIX_RANK = "PMIX_RANK"


def mpi_rank(environ: Mapping[str, str]) -> int | None:
    """The rank an MPI launcher (Open MPI, MPICH/PMI, Cray PALS, PMIx) or srun gave this process, or None."""
    for name in (*(rank for rank, _ in _MPI_RANKS), _PMIX_RANK, _SLURM_RANK[0]):
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return None


@dataclass(frozen=True)
class LaunchInfo:
    """What a worker learns from its environment about the job it belongs to.

    Attributes:
        rank: global rank.
        size: number of ranks.
        launcher: "hvdrun", "mpi", "slurm" or "single" (no launcher: size 1).
        hostname: this host's name as the launcher knows it.
        rendezvous_addr: rank 0's control address (None for "mpi" and "single").
        rendezvous_port: rank 0's control port.
        secret: the job's secret, hex.
        job_id: names the job in shared-memory segments.
        master_addr: torch.distributed's store address (for gloo/nccl backends).
        master_port: torch.distributed's store port.
    """

    rank: int
    size: int
    launcher: str
    hostname: str
    rendezvous_addr: str | None = None
    rendezvous_port: int | None = None
    secret: str | None = None
    job_id: str = "single"
    master_addr: str | None = None
    master_port: int | None = None


def env_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    """An integer variable; raises UsageError naming the variable when it is not an integer."""
    value = environ.get(name)
    if value is None or value == "":
        if default is None:
            raise UsageError(f"{name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{name}={value!r} is not an integer") from None


def env_text(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    """The first of ``names`` that is set (hvdrun's name first, then Horovod's)."""
    return next((environ[name] for name in names if environ.get(name)), None)


def start_timeout_s(environ: Mapping[str, str]) -> float:
    """``HVDRUN_START_TIMEOUT`` (``--start-timeout``) or its default: how long the ranks wait for each other in
    ``init()``, and a launcher for a rank's start (a preload's import included)."""
    return env_number(environ, (START_TIMEOUT,), DEFAULT_START_TIMEOUT_S)


def env_number(environ: Mapping[str, str], names: tuple[str, ...], default: float) -> float:
    """The first of ``names`` that is set, as a finite, non-negative number (hvdrun's name first, then Horovod's).

    Raises:
        UsageError: the value is not such a number; names the variable.
    """
    for name in names:
        value = environ.get(name)
        if value:
            try:
                number = float(value)
            except ValueError:
                raise UsageError(f"{name}={value!r} is not a number") from None
            if not math.isfinite(number) or number < 0:
                raise UsageError(f"{name}={value!r}: expected a finite number of at least 0")
            return number
    return default


def check_tuning(environ: Mapping[str, str]) -> None:
    """Validate every tuning variable the runtime reads, so a bad value stops the launch, not each rank.

    Raises:
        UsageError: a variable's value is not a finite, non-negative number.
    """
    for names in ((START_TIMEOUT,), (CONSOLE_STALL_S,), FUSION_THRESHOLD, STALL_WARNING_S, STALL_ERROR_S,
                  EAGER_BYTES, CYCLE_TIME_MS, DOUBLING_MAX_BYTES, HALVING_MAX_BYTES, CACHE_CAPACITY):
        env_number(environ, names, 0.0)
    algorithm = env_text(environ, ALGORITHM)
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise UsageError(f"{ALGORITHM[0]}={algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    policy = wait_policy(environ)
    if policy not in WAIT_POLICIES:
        raise UsageError(f"{WAIT_POLICY[0]}={policy!r}; expected one of {', '.join(WAIT_POLICIES)}")
    mode = compiled_mode(environ)
    if mode not in COMPILED_MODES:
        raise UsageError(f"{COMPILED[0]}={mode!r}; expected one of {', '.join(COMPILED_MODES)}")


def wait_policy(environ: Mapping[str, str]) -> str:
    """``HVDRUN_WAIT_POLICY`` in lower case (``auto`` when unset); :func:`check_tuning` validates it."""
    return (env_text(environ, WAIT_POLICY) or "auto").lower()


def compiled_mode(environ: Mapping[str, str]) -> str:
    """``HVDRUN_COMPILED`` in lower case (``auto`` when unset); :func:`check_tuning` validates it."""
    return (env_text(environ, COMPILED) or "auto").lower()


def _hostname(environ: Mapping[str, str]) -> str:
    import socket

    return environ.get(HOSTNAME) or socket.gethostname()


def _slurm_rendezvous_addr(environ: Mapping[str, str]) -> str | None:
    if environ.get(TORCH_MASTER_ADDR):
        return environ[TORCH_MASTER_ADDR]
    from hvdrun.hosts import SLURM_JOB_NODELIST, expand_slurm_hostlist

    nodelist = environ.get(SLURM_JOB_NODELIST[0]) or environ.get(SLURM_JOB_NODELIST[1])
    return expand_slurm_hostlist(nodelist)[0] if nodelist else None


def read_launch_info(environ: Mapping[str, str]) -> LaunchInfo:
    """Find out who started this worker: hvdrun, an MPI launcher, srun, or nobody (size 1).

    Raises:
        UsageError: a variable is malformed, or a Slurm job lacks what the rendezvous needs.
    """
    master_port = env_int(environ, TORCH_MASTER_PORT, 0) or None
    common: dict[str, Any] = {"hostname": _hostname(environ), "master_addr": environ.get(TORCH_MASTER_ADDR),
                              "master_port": master_port}
    if RANK in environ:
        return LaunchInfo(rank=env_int(environ, RANK), size=env_int(environ, SIZE), launcher="hvdrun",
                          rendezvous_addr=environ.get(RENDEZVOUS_ADDR, "127.0.0.1"),
                          rendezvous_port=env_int(environ, RENDEZVOUS_PORT), secret=environ.get(SECRET),
                          job_id=environ.get(JOB_ID, "job"), **common)
    for rank_var, size_var in _MPI_RANKS:
        if rank_var in environ and size_var in environ:
            return LaunchInfo(rank=env_int(environ, rank_var), size=env_int(environ, size_var), launcher="mpi",
                              **common)
    if _SLURM_RANK[0] in environ and _SLURM_RANK[1] in environ:
        job = environ.get(SLURM_JOB_ID, "0")
        port = env_int(environ, RENDEZVOUS_PORT, 0) or 20000 + env_int(environ, SLURM_JOB_ID, 0) % 20000
        if not environ.get(SECRET):
            raise UsageError(f"running under srun without {SECRET}: export a per-job secret in the job script, "
                             f"e.g. export {SECRET}=$(python -c 'import secrets; print(secrets.token_hex(32))')")
        return LaunchInfo(rank=env_int(environ, _SLURM_RANK[0]), size=env_int(environ, _SLURM_RANK[1]),
                          launcher="slurm", rendezvous_addr=_slurm_rendezvous_addr(environ), rendezvous_port=port,
                          secret=environ[SECRET], job_id=f"slurm{job}", **common)
    return LaunchInfo(rank=0, size=1, launcher="single", **common)
