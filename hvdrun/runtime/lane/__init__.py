"""The fast lane: a blocking small allreduce of a one-host job, exchanged on one shared board.

The engine's path costs a negotiation cycle of Python per op (tens of µs). When every rank of a
job on one host calls the same small blocking allreduce with nothing else in flight, the ranks
can simply post their data on a board in ``/dev/shm`` and reduce everyone's posts in rank order.

What makes it safe is that one rank decides. "Nothing else in flight" is a local fact: a rank
with an async op still pending takes the engine's path while its peers post. So every attempt
``g`` ends with a *verdict* that only rank 0 writes:

* GO when every rank posted attempt ``g`` with the same signature (name, dtype, size, op, scales);
* ABORT when a signature differs, a rank asked to withdraw (it saw engine traffic while it waited),
  rank 0 itself saw engine traffic, or rank 0 is in the engine's path (it then never posts ``g``).

Every poster waits for the verdict and obeys it: on ABORT it takes the engine's path, where names
are matched, mismatches are named and deadlocks reported as always. Nobody withdraws on its own, so
no rank can reduce an attempt that another abandoned. Verdicts are numbered; a rank posts with the
number of the next verdict, so ranks that skipped attempts stay in step.

A buffer is reused two attempts later, and only once every rank finished reading the attempt that
used it last.

The lane's whole life is in this package: the board (:mod:`.board`), a rank's attempt and rank 0's
verdicts (:mod:`.attempt`), and here, its set-up (:func:`create_board` before the rendezvous
exchange, :func:`open_lane` after it, both called by the native backend) and its entry
(:func:`try_allreduce`, called by the blocking allreduce and the barrier of ``hvdrun.torch``).
The engine's own part is a predicate (:meth:`LaneHost.quiet`) and, while a caller drives it,
:meth:`FastLane.engine_path`.
"""


from __future__ import annotations

import os
from typing import Protocol

import numpy as np

from hvdrun import envvars
from hvdrun.errors import CollectiveError
from hvdrun.runtime.forensics import FlightRecorder
from hvdrun.runtime.lane.attempt import LANE_OPS, SPINS_BEFORE_YIELD, FastLane
from hvdrun.runtime.lane.board import CAPACITY, Board
from hvdrun.runtime.transport.channels import AbortFlag

__all__ = ["CAPACITY", "LANE_OPS", "Board", "FastLane", "LaneHost", "create_board", "lane_enabled", "open_lane",
           "try_allreduce"]


def lane_enabled() -> bool:
    """``HVDRUN_FAST_LANE=0`` keeps every op on the engine's path (for comparisons)."""
    return os.environ.get(envvars.FAST_LANE, "1") != "0"


def create_board(job_key: str, rank: int, size: int, shared_memory: bool) -> Board | None:
    """Rank 0 of a job with shared memory creates the board before the exchange (whether every rank is on
    this host is known only after it); the caller unlinks it once every peer has opened it."""
    if shared_memory and rank == 0 and size > 1 and lane_enabled():
        return Board(job_key, size, create=True)
    return None


def open_lane(board: Board | None, job_key: str, rank: int, size: int, local_size: int, abort: AbortFlag,
              shared_memory: bool, own_core: bool) -> FastLane | None:
    """This rank's lane when every rank of the job is on this host, else None (rank 0's board is closed).

    Args:
        board: what :func:`create_board` returned on this rank.
        own_core: every rank has a core: waits spin a while before yielding (else they yield at once).
    """
    if local_size == size and size > 1 and (board is not None or (rank != 0 and shared_memory and lane_enabled())):
        return FastLane(board or Board(job_key, size, create=False), rank, size, abort,
                        SPINS_BEFORE_YIELD if own_core else 0)
    if board is not None:
        board.close()
    return None


class LaneHost(Protocol):
    """What the lane's entry needs of the engine."""

    lane: FastLane | None
    recorder: FlightRecorder  # this rank's collectives (hvdrun.runtime.forensics)

    @property
    def cycles(self) -> int:
        """Negotiation cycles run on this rank: a change means a peer used the engine."""
        ...

    def quiet(self) -> bool:
        """Nothing of this rank in flight or unsynchronized, nothing held, no failure, no timeline, no join."""
        ...

    def fail(self, reason: str) -> None:
        """Fail every op of this rank and tell the other ranks."""
        ...


def try_allreduce(host: LaneHost, array: np.ndarray, name: str, op: int, prescale: float, postscale: float) -> bool:
    """A blocking allreduce of the whole job on the fast lane, in place.

    Returns False when it did not happen there (no lane, too big, an op the lane does not reduce, something
    else in flight on this rank, another thread of this rank in the lane, or the ranks did not all come): the
    caller then takes the engine's path under the same ``name``.
    """
    lane = host.lane
    # read without the engine's lock: the lane's verdict, not this check, keeps ranks in step
    if (lane is None or not 0 < array.nbytes <= CAPACITY or op not in LANE_OPS or not host.quiet()
            or not lane.enter()):
        return False
    cycles = host.cycles
    flight = host.recorder.take_off(name, "allreduce", array.nbytes)
    done = False
    try:
        done = lane.allreduce(array, name, op, float(prescale), float(postscale), lambda: host.cycles != cycles)
        return done
    except CollectiveError as e:  # a dead peer or a stall: every rank hears of it, as in the engine
        done = True
        host.fail(str(e))
        raise
    finally:
        lane.leave()
        if done:
            flight.land()
            host.recorder.waited(flight.ended - flight.started)  # the caller waited all along; no clock read
        else:
            host.recorder.scrub(flight)  # the engine's path takes the op and records it itself
