"""One negotiation cycle of a rank: announce, agree, execute.

Every rank announces the requests submitted since its last cycle and the names its threads are
blocked on; the announcements are all-gathered and fed, in rank order, into each rank's identical
:class:`~hvdrun.runtime.negotiation.Table`. The ready entries are planned into batches (small
allreduces fused) and executed; ops that can never complete get their verdict
(:mod:`hvdrun.runtime.verdicts`). The engine's progress loop (:mod:`hvdrun.runtime.progress`) decides
*when* a cycle runs and on which thread; this module is *what* a cycle does.

Requests every rank agreed on before (cached numbers) are *held* instead where the backend merges announcements
(:mod:`hvdrun.runtime.held`): each cycle says only which numbers the rank holds, the ones held by every rank run,
and the cycle's coordination costs the same bytes at any number of ranks.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol

import numpy as np

from hvdrun.errors import CollectiveError
from hvdrun.runtime import compiled, verdicts
from hvdrun.runtime.announcements import WHOLE, Agreement, Announcements, Tally, Uniform, last_ranks
from hvdrun.runtime.backends.backend import Backend
from hvdrun.runtime.device import DeviceCollectives
from hvdrun.runtime.executors import EXECUTORS, allreduce_flat, reduce_contributions, stand_in
from hvdrun.runtime.handles import LocalOp
from hvdrun.runtime.held import HeldRequests
from hvdrun.runtime.negotiation import (
    DEFAULT_CACHE_CAPACITY,
    GLOBAL_SET,
    JOIN,
    Entry,
    Request,
    ResponseCache,
    Table,
    plan,
)
from hvdrun.runtime.reduce import final_factor, scale
from hvdrun.runtime.stragglers import Arrival, StragglerWatch, tally_arrival
from hvdrun.runtime.timeline import Timeline
from hvdrun.runtime.transport.channels import Message

_HELD_KINDS = ("allreduce", "broadcast")  # identical on every rank by construction: held alike, ready alike


class Ledger(Protocol):
    """What a cycle needs of this rank's submissions (the engine keeps them)."""

    failure: str | None

    def take_inflight(self, names: list[str]) -> list[LocalOp | None]:
        """Remove and return the ops of ``names`` (None for a name no longer in flight)."""
        ...

    def finish_local(self, name: str, error: BaseException) -> str:
        """Fail this rank's op ``name``, if it is still in flight; ``absent``, ``waited`` or ``unwaited``."""
        ...

    def give_back_auto_name(self, name: str) -> None:
        """An unnamed op failed before the other ranks used its number: reuse it next."""
        ...

    def catch_up_auto_name(self, name: str) -> None:
        """The others used the unnamed op's number while this rank had joined: take the next one."""
        ...

    def mark_stopped(self) -> None:
        """The job's shutdown completed on every rank."""
        ...


class Cycle:
    """Runs negotiation cycles for one rank.

    Args:
        backend: carries the announcements and executes CPU collectives.
        ledger: this rank's ops in flight.
        fusion_threshold: largest fused allreduce buffer, in bytes.
        device: executes ops on device tensors (None: no device path).
    """

    def __init__(self, backend: Backend, ledger: Ledger, fusion_threshold: int,
                 device: DeviceCollectives | None = None, cache_capacity: int = DEFAULT_CACHE_CAPACITY) -> None:
        self.backend, self.world, self.device, self.ledger = backend, backend.world, device, ledger
        self.fusion_threshold = fusion_threshold
        self.table = Table(self.world.size)
        self.cache = ResponseCache(cache_capacity)
        # the steady state's steps across hosts in one call (None: the pure-Python path; HVDRUN_COMPILED)
        self.compiled = compiled.runner() if backend.merges else None
        self._announcements = Announcements(backend, self.world.rank, self.world.size, self.cache.decode,
                                            self.compiled)
        self.timeline: Timeline | None = None
        self._fusion: dict[str, np.ndarray] = {}
        # rank 0 names the rank or host the others keep waiting for (every rank's table sees the same arrivals)
        hostnames = self.world.hostnames or tuple("?" for _ in range(self.world.size))
        self.stragglers = StragglerWatch(hostnames) if self.world.rank == 0 and self.world.size > 1 else None
        self.held = HeldRequests()

    @property
    def holding(self) -> bool:
        """This rank holds requests that have not run (see the module docstring)."""
        return bool(self.held)

    def flush_due(self) -> bool:
        """A cycle is due for the held requests (:meth:`HeldRequests.flush_due`)."""
        return self.held.flush_due()

    def run(self, new: list[LocalOp], waiting: list[str]) -> None:
        """One round: every rank's new requests and the names it is blocked on, then whatever became ready."""
        cache = self.cache
        keys = [cache.encode(op.request.wire()) for op in new]
        agreed = self._exchange([(op.request, key, op.payload) for op, key in zip(new, keys, strict=True)], waiting)
        if len(new) == 1 and new[0].payload is not None and self._run_alone(new[0].request, keys[0], new[0].payload,
                                                                            agreed, new[0].array):
            self.ledger.take_inflight([new[0].request.name])
            new[0].handle.finish(new[0].array)
            return
        self.apply(agreed)

    def express(self, request: Request, payload: Message | None, array: np.ndarray) -> Agreement | None:
        """A cycle that announces one allreduce (with its data when eager) of a rank with nothing else in flight,
        run without the ledger: None when it went through (``array`` holds the result), else the agreement, which
        the caller hands to :meth:`apply` once it has put the op in the ledger (the same protocol as :meth:`run`)."""
        mine = self.cache.encode(request.wire())
        if payload is not None and isinstance(mine, int) and self._steady(request, mine):
            return self._express_steady(request, mine, payload, array)
        agreed = self._exchange([(request, mine, payload)], [])
        return None if self._run_alone(request, mine, payload, agreed, array) else agreed

    def _steady(self, request: Request, key: Any) -> bool:
        """The steady state of training: :meth:`_exchange` would announce ``request`` alone as a uniform value (it is
        held, nothing else is held or flushed) and :meth:`_run_alone` could run it (nothing in the table, no
        timeline)."""
        held = self.held
        return (not held and not held.flushing and self.timeline is None and not self.table.entries
                and self._may_hold(request, key))

    def _express_steady(self, request: Request, key: int, payload: Message, array: np.ndarray) -> Agreement | None:
        """:meth:`express` in the steady state, without the general form's bookkeeping: the same cycle to every rank
        (held from this cycle on and dropped once run, as :meth:`_exchange` and :meth:`_run_alone` do it); where
        the ranks did not all do the same, this rank holds ``key`` as the general path would, and the agreement is
        theirs."""
        held = self.held
        since = time.monotonic()
        cycle, _ = held.begin_cycle()
        size = self.world.size
        if request.prescale == 1.0:  # the payload is the array's own bytes: the whole value may go straight there
            merged = self._announcements.exchange_whole(key, payload, cycle, array,
                                                        final_factor(request.op, request.postscale, size))
            if merged is WHOLE:
                return None
        else:
            merged = self._announcements.exchange_lone(key, payload, cycle)
        if type(merged) is Uniform and merged.key == key and merged.lo == 0 and merged.hi == size - 1:
            flat = array.reshape(-1)
            flat[...] = np.frombuffer(merged.data, array.dtype)
            scale(flat, final_factor(request.op, request.postscale, size))
            return None
        held.hold(key, since)
        agreed = self._announcements.agreement(merged)
        return None if self._run_alone(request, key, payload, agreed, array) else agreed

    def _exchange(self, requests: list[tuple[Request, Any, Message | None]], waiting: list[str]) -> Agreement:
        """Announce ``requests`` (each with its cached number or description, and its data when eager): held
        where they may be, the others in the general form with the flushed ones."""
        held = self.held
        cycle, flushed = held.begin_cycle()
        items: list[tuple[Any, Message | None]] = [(key, None) for key in flushed]
        lone = None
        for request, key, payload in requests:
            if self._may_hold(request, key):
                held.hold(key)
                lone = (key, payload) if payload is not None and len(requests) == 1 else None
            else:
                items.append((key, payload))
        numbers, stale = held.announced()
        agreed = self._announcements.exchange((items, waiting), numbers, cycle, stale, lone)
        held.end_exchange()
        if self.timeline is not None:
            self.timeline.cycle()
        return agreed

    def _may_hold(self, request: Request, key: Any) -> bool:
        """Whether ``request`` (announced as ``key``) is held rather than announced into the table."""
        return (type(key) is int and self.backend.merges and request.kind in _HELD_KINDS
                and request.process_set == GLOBAL_SET and key not in self.held.flushing
                and request.name not in self.table.entries and JOIN not in self.table.entries)

    def _run_alone(self, request: Request, mine: Any, payload: Message | None, agreed: Agreement,
                   array: np.ndarray) -> bool:
        """Run ``request`` (announced as ``mine``: its cached number or description) into ``array`` when every rank
        announced it alone in this cycle (all with data, or none; or all began to hold it now, and nothing else is
        held or said) and nothing else is pending: True when it ran.

        The condition depends only on data every rank has (identical tables and messages), so
        all ranks take this path together; the result is the same as through the table.
        """
        if self.table.entries or (request.device != "cpu" and self.device is None):
            return False
        eager = payload is not None
        held_now = self.held.began_alone_now(mine, agreed.tallies, agreed.general, self.world.size)
        if agreed.total is None and not held_now and (agreed.tallies or not all(
                len(items) == 1 and items[0][0] == mine and (items[0][1] is not None) == eager
                for items, _ in agreed.decoded)):
            return False
        self.held.drop(mine)
        if not isinstance(mine, int) and ".noname." not in request.name:  # numbered as ResponseCache.remember does
            self.cache.remember_wire(request.wire())
        timeline = self.timeline
        if timeline is not None:
            timeline.execute_start(request.name, "allreduce")
        flat, size = array.reshape(-1), self.world.size  # a device tensor reshapes alike
        if agreed.total is not None:  # every rank's data, reduced on the way
            flat[...] = np.frombuffer(agreed.total, array.dtype)
            scale(flat, final_factor(request.op, request.postscale, size))
        elif eager and not held_now:
            reduce_contributions(size, request, [items[0][1] or b"" for items, _ in agreed.decoded], array)
        elif request.device != "cpu":  # a device tensor (never eager), on the device's process group
            assert self.device is not None
            self.device.allreduce(request, array)
        else:  # what the table would plan: a batch of this one op, run by the backend's algorithm
            allreduce_flat(self.backend, request, flat, size)
        if timeline is not None:
            timeline.execute_end(request.name, "allreduce")
        return True

    def apply(self, agreed: Agreement) -> None:
        """The rest of a cycle: the held requests every rank holds and every rank's announcement into the table,
        then whatever became ready."""
        cache, table = self.cache, self.table
        table.now = now = time.monotonic()
        arrivals = self._add_held_everywhere(agreed.tallies, now, agreed.general or agreed.flush)
        decoded: list[Any] = agreed.decoded if agreed.general else []
        for rank, (items, _) in enumerate(decoded):
            for values, payload in items:
                table.add(rank, Request.from_wire(cache.decode(values)), payload)
        for entry, error in verdicts.departed(table):
            self._fail_departed(entry, error)
        ready = table.pop_ready()
        if self.stragglers is not None and ready:
            # requests that all arrived in this cycle had no one last: only counted
            late = [entry.arrived for entry in ready if not entry.error and not entry.everyone
                    and entry.first_arrival != now]
            self.stragglers.observe(late, even=len(ready) - len(late) - len(arrivals), now=now, arrivals=arrivals)
        cache.remember(ready)
        self._catch_up_names_others_took(ready)  # before any op completes: a joined caller may name its next one
        for batch in plan(ready, self.fusion_threshold):
            self._execute(batch)
        blocked = {rank: names for rank, (_, names) in enumerate(decoded) if names}
        if blocked:
            self._fail_deadlock(blocked)

    def _fail_departed(self, entry: Entry, error: CollectiveError) -> None:
        """Fail an op that ranks which shut down never submitted; one of this rank that nothing waits on (a stray
        op: a test that failed on this rank only left it) is said on stderr, since no caller will raise it."""
        if self.ledger.finish_local(entry.name, error) == "unwaited":
            kind = entry.requests[self.world.rank].kind if self.world.rank in entry.requests else "collective"
            sys.stderr.write(f"hvdrun: warning: rank {self.world.rank}: {kind} {error} (submitted here and not "
                             "waited on yet: a stray op, cleared)\n")

    def _add_held_everywhere(self, tallies: dict[int, Tally], now: float, flush: bool) -> list[Arrival]:
        """Put the held requests that every rank holds into the table (:meth:`HeldRequests.settle`); the arrivals
        (rank 0's straggler watch) of those that did not all begin in one cycle."""
        arrivals = []
        for key in self.held.settle(tallies, self.world.size, flush, now):
            self.table.add_everyone(Request.from_wire(self.cache.decode(key)))
            tally = tallies[key]
            if self.stragglers is not None and len(tally[0]) > 1:
                arrivals.append(tally_arrival(tally[0], tally[1], last_ranks(tally), self.held.times, now))
        return arrivals

    def _fail_deadlock(self, blocked: dict[int, list[str]]) -> None:
        """Fail, on every rank alike, the ops that ranks wait for in a wait-for cycle; the next collective
        works again."""
        verdict = verdicts.deadlock(self.table, blocked)
        if verdict is None:
            return
        error, entries = verdict
        for entry in entries:
            if self.world.rank in entry.requests:
                self.ledger.finish_local(entry.name, error)
                self.ledger.give_back_auto_name(entry.name)

    def _ops_of(self, batch: list[Entry]) -> list[LocalOp]:
        """This rank's op of every entry; a rank that joined takes part in others' allreduces with zeros."""
        rank = self.world.rank
        taken = iter(self.ledger.take_inflight([e.name for e in batch if rank not in e.absent]))
        found = [stand_in(entry, rank) if rank in entry.absent else next(taken) for entry in batch]
        if any(op is None for op in found):  # fail() ran on another thread meanwhile: its reason stands
            raise CollectiveError(self.ledger.failure or f"'{batch[0].name}' was cancelled on rank {rank}")
        return [op for op in found if op is not None]

    def _execute(self, batch: list[Entry]) -> None:
        ops = self._ops_of(batch)
        if batch[0].error:
            for op in ops:
                op.handle.finish(error=CollectiveError(batch[0].error))
            return
        kind = batch[0].first.kind
        timeline = self.timeline if kind != "shutdown" else None
        if timeline is not None:
            for entry in batch:
                timeline.execute_start(entry.name, kind)
        try:
            results = self._run_executor(kind, batch, ops)
        except BaseException as e:  # the ops left the ledger: finish them here, then fail the engine
            error = e if isinstance(e, CollectiveError) else CollectiveError(f"{kind} '{batch[0].name}' failed: {e!r}")
            for op in ops:
                op.handle.finish(error=error)
            raise error from e
        for op, result in zip(ops, results, strict=True):
            op.handle.finish(result)
            if timeline is not None:
                timeline.execute_end(op.request.name, kind)
        if kind == "shutdown":
            self.ledger.mark_stopped()

    def _catch_up_names_others_took(self, batch: list[Entry]) -> None:
        """Ops that this rank took part in without a request (it joined): their automatic numbers were used by
        the ranks that submitted them, so this rank's next unnamed op of that kind takes the one after, as
        theirs does. (Giving the number back on the submitting ranks instead raced with their next
        submissions: two unnamed allgathers in flight when a peer joined got different numbers on different
        ranks.)"""
        for entry in batch:
            if self.world.rank in entry.absent and self.world.rank in entry.members:
                self.ledger.catch_up_auto_name(entry.name)

    def _run_executor(self, kind: str, batch: list[Entry], ops: list[LocalOp]) -> list[Any]:
        if batch[0].first.device == "cpu":
            return EXECUTORS[kind](self, batch, ops)
        if self.device is None:
            raise CollectiveError(f"'{batch[0].name}' is on {batch[0].first.device} but this job has no "
                                  "device backend (torch.distributed nccl)")
        return self.device.execute(kind, batch, [op.array for op in ops])

    def fusion_buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A reusable flat buffer of at least ``count`` elements of ``dtype``."""
        buffer = self._fusion.get(dtype.str)
        if buffer is None or buffer.size < count:
            buffer = self._fusion[dtype.str] = np.empty(count, dtype)
        return buffer[:count]
