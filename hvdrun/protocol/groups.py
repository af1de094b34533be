"""Rendezvous groups: where each host of a large job joins the rendezvous (the launcher decides, the runtime reads).

Past ``HVDRUN_RENDEZVOUS_GROUP_HOSTS`` hosts (:data:`DEFAULT_GROUP_HOSTS`) the launcher cuts the job's hosts, in
host order, into groups of that many, reserves a port on the first host of every group but the first, and gives
every rank the endpoints in ``HVDRUN_RENDEZVOUS_GROUPS`` (``HOSTS;ADDR:PORT,ADDR:PORT,...``: hosts per group, then
the endpoints of groups 1, 2, ...). Group 0 joins rank 0, which runs there; the leader of a later group's first host
listens on the group's endpoint and joins rank 0 for the group
(:mod:`hvdrun.runtime.rendezvous.children`), so rank 0 admits about H / G + G connections instead of H.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hvdrun import envvars
from hvdrun.errors import UsageError

DEFAULT_GROUP_HOSTS = 32  # as the launch tree's fan-out: rank 0 and every group leader admit at most about 32 hosts

T = TypeVar("T")


@dataclass(frozen=True)
class GroupPlace:
    """Where a rank's host joins the rendezvous in a grouped job: its group leader's endpoint, and whether this
    host leads the group (its leader listens there)."""

    addr: str
    port: int
    leads: bool


def group_hosts(environ: Mapping[str, str]) -> int:
    """Hosts per rendezvous group (``HVDRUN_RENDEZVOUS_GROUP_HOSTS``, the launcher's environment).

    Raises:
        UsageError: the value is not a whole number of at least 1.
    """
    text = environ.get(envvars.RENDEZVOUS_GROUP_HOSTS, "").strip()
    if not text:
        return DEFAULT_GROUP_HOSTS
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"{envvars.RENDEZVOUS_GROUP_HOSTS}={text!r}: expected a whole number of hosts, at least 1")
    return value


def leading_hosts(hosts: Sequence[T], per_group: int) -> list[T]:
    """The first host of every group after the first (none while the job has at most ``per_group`` hosts)."""
    if len(hosts) <= per_group:
        return []
    return [hosts[start] for start in range(per_group, len(hosts), per_group)]


def groups_value(per_group: int, endpoints: Sequence[tuple[str, int]]) -> str:
    """The value of ``HVDRUN_RENDEZVOUS_GROUPS`` (the endpoints of groups 1, 2, ...); empty without groups."""
    if not endpoints:
        return ""
    return f"{per_group};" + ",".join(f"{addr}:{port}" for addr, port in endpoints)


def group_place(environ: Mapping[str, str]) -> GroupPlace | None:
    """This rank's :class:`GroupPlace`, from ``HVDRUN_RENDEZVOUS_GROUPS`` and its host's index (``GROUP_RANK``);
    None in group 0 (it joins rank 0), without groups, or when a value cannot be read (the rank then joins rank 0,
    as every rank of an ungrouped job does)."""
    text = environ.get(envvars.RENDEZVOUS_GROUPS, "")
    try:
        per_group_text, _, endpoints = text.partition(";")
        per_group, host = int(per_group_text), int(environ[envvars.TORCH_GROUP_RANK])
        group = host // per_group
        if group == 0:
            return None
        addr, _, port = endpoints.split(",")[group - 1].rpartition(":")
        return GroupPlace(addr, int(port), leads=host == group * per_group)
    except (KeyError, ValueError, IndexError, ZeroDivisionError):
        return None
