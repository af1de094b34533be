"""The interface every backend implements, and the world it runs in."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hvdrun.ranks import Topology, topologies
from hvdrun.runtime.lane import FastLane
from hvdrun.runtime.reduce import ReduceFn
from hvdrun.runtime.transport.channels import MARSHAL, Codec, Message

if TYPE_CHECKING:
    from hvdrun.runtime.collectives.hierarchical import MergedPath


@dataclass(frozen=True)
class World(Topology):
    """This rank's place in the job, as the runtime established it, and every rank's host name."""

    hostnames: tuple[str, ...] = ()


def topology(rank: int, host_keys: Sequence[str], hostnames: Sequence[str]) -> World:
    """This rank's world, from the host every rank runs on."""
    return World(**vars(topologies(host_keys)[rank]), hostnames=tuple(hostnames))


class Backend(abc.ABC):
    """Executes collectives on numpy buffers among all ranks of the world.

    ``wakeable`` backends let an idle engine sleep until a peer starts a cycle; the others
    make every rank run a negotiation cycle every few milliseconds.
    """

    name: str = "?"
    wakeable: bool = False
    world: World
    lane: FastLane | None = None  # the fast lane of a one-host job (the native backend's)

    @abc.abstractmethod
    def allgather_messages(self, payload: Message) -> list[Message]:
        """Every rank's payload, indexed by rank."""

    merges = False  # allgather_merged is available (see hvdrun.runtime.announcements)

    def allgather_merged(self, value: Any, merge: Callable[[Any, Any], Any], codec: Codec = MARSHAL) -> Any:
        """Every rank's ``value`` (carried by ``codec``) merged in rank order by ``merge(lower, upper)``, the same on
        every rank (only where ``merges``)."""
        raise NotImplementedError(f"the {self.name} backend does not merge values")

    def merged_path(self) -> MergedPath | None:
        """How :meth:`allgather_merged` goes, for a caller that runs its steps itself (the compiled module); None:
        not known, or not a path it can run."""
        return None

    @abc.abstractmethod
    def allreduce(self, array: np.ndarray, reduce: ReduceFn) -> None:
        """Reduce a contiguous array in place."""

    @abc.abstractmethod
    def reducescatter(self, array: np.ndarray, reduce: ReduceFn, bounds: list[tuple[int, int]]) -> None:
        """Reduce in place; only this rank's chunk (element ``bounds[rank]``) must be valid afterwards."""

    @abc.abstractmethod
    def allgatherv(self, out: memoryview, sizes: Sequence[int]) -> None:
        """``out`` holds this rank's block at its offset; fill in the other ranks' blocks (byte sizes)."""

    @abc.abstractmethod
    def broadcast(self, buffer: memoryview, root: int) -> None:
        """Copy ``root``'s buffer to every rank."""

    @abc.abstractmethod
    def alltoallv(self, send: memoryview, send_sizes: Sequence[int], matrix: Sequence[Sequence[int]],
                  out: memoryview) -> None:
        """Send ``send_sizes[j]`` bytes to rank j; receive every block addressed to us into ``out`` in rank order."""

    def wait_for_peer(self, extra_fds: Sequence[int], timeout_s: float) -> None:
        """Sleep until a peer may have started a cycle, an fd in ``extra_fds`` is readable, or the timeout."""
        from hvdrun.runtime.readiness import readable

        readable(list(extra_fds), timeout_s)

    def idle_wait(self, extra_fds: Sequence[int]) -> None:
        """A short wait for a peer while a caller drives progress (spin first where that pays)."""
        self.wait_for_peer(extra_fds, 0.001)

    def progressed(self) -> None:  # noqa: B027 - optional hook
        """Tell the backend the caller made progress (restarts its spin phase)."""

    def peer_waiting(self) -> bool:
        """True when a peer has started a negotiation cycle we have not joined (wakeable backends)."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and memory."""

