"""The launcher -> worker environment contract. The ONLY module that spells these names.

Every worker, however it was started, receives its place in the job three times over:
as ``HVDRUN_*``, as Horovod's ``HOROVOD_*`` and as torchrun's ``RANK``/``WORLD_SIZE``/...
so hvdrun, Horovod and torch.distributed ``env://`` scripts all run unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
JOB_ID = "HVDRUN_JOB_ID"
BACKEND = "HVDRUN_BACKEND"

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
TORCH_MASTER_ADDR = "MASTER_ADDR"
TORCH_MASTER_PORT = "MASTER_PORT"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"

_VAR_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0 serves the job's rendezvous, and the secret that authenticates it.

    Attributes:
        addr: address every worker can reach.
        port: hvdrun's runtime store.
        master_port: torch.distributed's store for ``env://`` scripts.
        secret: per-job secret (hex); runtime connections without it are refused.
        job_id: a short id naming the job in logs and shared-memory segments.
    """

    addr: str
    port: int
    master_port: int
    secret: str
    job_id: str


def worker_env(slot: Slot, rendezvous: Rendezvous) -> dict[str, str]:
    """The variables one rank gets on top of the forwarded environment."""
    env: dict[str, str] = {}
    for attr, names in _TOPOLOGY.items():
        for name in names:
            env[name] = str(getattr(slot, attr))
    env.update({
        HOSTNAME: slot.hostname, HOROVOD_HOSTNAME: slot.hostname,
        RENDEZVOUS_ADDR: rendezvous.addr, RENDEZVOUS_PORT: str(rendezvous.port),
        SECRET: rendezvous.secret, JOB_ID: rendezvous.job_id,
        TORCH_RANK: str(slot.rank), TORCH_WORLD_SIZE: str(slot.size),
        TORCH_LOCAL_RANK: str(slot.local_rank), TORCH_LOCAL_WORLD_SIZE: str(slot.local_size),
        TORCH_GROUP_RANK: str(slot.host_index),
        TORCH_MASTER_ADDR: rendezvous.addr, TORCH_MASTER_PORT: str(rendezvous.master_port),
        PYTHONUNBUFFERED: "1",
    })
    if slot.devices:
        env[CUDA_VISIBLE_DEVICES] = ",".join(slot.devices)
    return env


def forwarded_env(specs: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """Resolve ``-x VAR`` (value from ``environ``) and ``-x VAR=value`` options.

    Raises:
        UsageError: a name is not a valid variable name, or ``VAR`` is not set.
    """
    result: dict[str, str] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not _VAR_NAME_RE.match(name):
            raise UsageError(f"-x {spec}: '{name}' is not a valid environment variable name; "
                             "expected -x NAME or -x NAME=value")
        if not sep:
            if name not in environ:
                raise UsageError(f"-x {name}: {name} is not set in hvdrun's environment; "
                                 f"set it or give -x {name}=value")
            value = environ[name]
        result[name] = value
    return result
