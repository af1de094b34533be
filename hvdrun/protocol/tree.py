"""The rendezvous tree: where each host of a large job joins the rendezvous (the launcher decides, the runtime reads).

Past ``HVDRUN_RENDEZVOUS_FANOUT`` + 1 hosts (:data:`DEFAULT_FANOUT`, F) the hosts form a tree in host order, as
a binary heap with F children a node: host 0 (rank 0's) admits hosts 1..F, host p admits hosts p F + 1 ..
p F + F. Every host with children (an inner host) listens on a port the launcher found free there; the launcher
gives every rank the inner hosts' endpoints in ``HVDRUN_RENDEZVOUS_TREE`` (``F;ADDR:PORT,ADDR:PORT,...``: the
fan-out, then the endpoints of hosts 1, 2, ... K, the inner hosts). A host's leader joins its parent's leader
(rank 0 for hosts 1..F) and, where the host is inner, admits its children
(:mod:`hvdrun.runtime.rendezvous.children`). Rank 0 admits at most F hosts, every leader at most F more, and a
message between rank 0 and any host passes ceil(log_F H) leaders: 2 levels for up to 1,057 hosts at F = 32, 3 for
33,825.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hvdrun import envvars
from hvdrun.errors import UsageError

DEFAULT_FANOUT = 32  # as the launch tree's: no machine admits more than about 32 hosts

T = TypeVar("T")


@dataclass(frozen=True)
class TreePlace:
    """Where a rank's host sits in the rendezvous tree.

    Attributes:
        parent: the endpoint of its parent host's leader (None: rank 0 is its parent).
        listen: its own endpoint, where its leader admits the host's children (None: it has none).
    """

    parent: tuple[str, int] | None
    listen: tuple[str, int] | None


def fanout(environ: Mapping[str, str]) -> int:
    """Hosts each leader admits (``HVDRUN_RENDEZVOUS_FANOUT``, the launcher's environment).

    Raises:
        UsageError: the value is not a whole number of at least 2.
    """
    text = environ.get(envvars.RENDEZVOUS_FANOUT, "").strip()
    if not text:
        return DEFAULT_FANOUT
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 2:
        raise UsageError(f"{envvars.RENDEZVOUS_FANOUT}={text!r}: expected a whole number of hosts, at least 2")
    return value


def parent_of(host: int, per_leader: int) -> int:
    """The host whose leader admits ``host`` (> 0)."""
    return (host - 1) // per_leader


def inner_hosts(hosts: Sequence[T], per_leader: int) -> list[T]:
    """The hosts other than rank 0's that admit children (none while rank 0 admits every host)."""
    return [hosts[p] for p in range(1, len(hosts)) if p * per_leader + 1 < len(hosts)]


def tree_value(per_leader: int, endpoints: Sequence[tuple[str, int]]) -> str:
    """The value of ``HVDRUN_RENDEZVOUS_TREE`` (the endpoints of inner hosts 1, 2, ...); empty without any."""
    if not endpoints:
        return ""
    return f"{per_leader};" + ",".join(f"{addr}:{port}" for addr, port in endpoints)


def tree_place(environ: Mapping[str, str]) -> TreePlace | None:
    """This rank's :class:`TreePlace`, from ``HVDRUN_RENDEZVOUS_TREE`` and its host's index (``GROUP_RANK``); None
    without a tree, on rank 0's host, or when a value cannot be read (the rank then joins rank 0, as every rank of
    a smaller job does)."""
    text = environ.get(envvars.RENDEZVOUS_TREE, "")
    try:
        per_leader_text, _, listed = text.partition(";")
        per_leader, host = int(per_leader_text), int(environ[envvars.TORCH_GROUP_RANK])
        endpoints = [_endpoint(item) for item in listed.split(",")]
        if host <= 0 or per_leader < 2:
            return None
        parent = parent_of(host, per_leader)
        return TreePlace(endpoints[parent - 1] if parent else None,
                         endpoints[host - 1] if host <= len(endpoints) else None)
    except (KeyError, ValueError, IndexError):
        return None


def _endpoint(item: str) -> tuple[str, int]:
    addr, _, port = item.rpartition(":")
    if not addr:
        raise ValueError(item)
    return addr, int(port)
