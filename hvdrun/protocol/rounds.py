"""An elastic job's membership messages: what its workers and the launcher's membership service send each other.

The workers' side is :mod:`hvdrun.runtime.membership`, the launcher's :mod:`hvdrun.launch.elastic.membership_service`;
every frame (:mod:`hvdrun.protocol.wire`) is a tuple whose first item is its kind::

    worker -> service   (MEMBERSHIP_JOIN, worker number, rendezvous address, rendezvous port, pid)
    service -> worker   (MEMBERSHIP_ASSIGN, {round, rank, size, rendezvous_addr, rendezvous_port, updates})
                        or (MEMBERSHIP_LEAVE, why the worker is no longer part of the job)
    worker -> service   (MEMBERSHIP_UPDATES,)
    service -> worker   (MEMBERSHIP_UPDATES, the launcher's host-update count)

The body of ``MEMBERSHIP_ASSIGN`` is an :class:`Assignment` as a dict.
"""

from __future__ import annotations

from dataclasses import dataclass

MEMBERSHIP_JOIN = "join"
MEMBERSHIP_ASSIGN = "assign"
MEMBERSHIP_LEAVE = "leave"
MEMBERSHIP_UPDATES = "updates"


@dataclass(frozen=True)
class Assignment:
    """This worker's place in one round of an elastic job."""

    round: int
    rank: int
    size: int
    rendezvous_addr: str
    rendezvous_port: int
    updates: int  # the launcher's host-update count when the round formed
