"""This rank's collectives from submission until they finish.

The ledger the engine and its cycles share: the names taken on this rank, the automatic names (``allreduce.noname.7``,
the same on ranks that submit in the same order), the queue of requests not yet announced, the ops in
flight, the names threads of this rank are blocked on, and the rank's failure. One lock guards all of
it, and the engine's sleep flags too, so a submission knows whether to wake a sleeping engine.

A name is taken from submission until the op finished *and* this rank has seen an end past it: its own handle
synchronized, waited or polled done, or an op this rank submitted after it finished too. Horovod frees a name
when its op finishes in the background, which in Horovod comes a cycle (milliseconds) after the submitting call
returns; here the op may finish between two statements of the caller, so "finished" alone would make Horovod's
own duplicate-name test (two ``allreduce_async`` of one name in a row) pass or fail by a race, and a second op
that did not raise would wait for a partner that never comes. A handle nobody synchronizes (a metric left
behind) keeps no name once a later collective of the rank finished (the next step's gradients, a barrier): a
loop whose only collective is that one unsynchronized op must ``poll`` or ``synchronize`` it to reuse its name.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from hvdrun.errors import CollectiveError
from hvdrun.runtime.handles import EngineLike, Handle, LocalOp
from hvdrun.runtime.negotiation import Request
from hvdrun.runtime.reduce import as_bytes, scale
from hvdrun.runtime.transport.channels import Message

_NO_DATA = np.empty(0, np.uint8)
# eager ops carry at most this much data from all the ranks whose data every rank receives whole (the job's, or with
# announcements merged across hosts, a host's: 64 KiB each up to 2 ranks, 32 KiB at 4, 16 KiB at 8): recursive
# doubling's last message (half of it) past 64 KiB cost 2x doubling's time at 8 hosts
EAGER_JOB_BYTES = 128 << 10


def _auto_number(name: str) -> tuple[str, int] | None:
    """(kind, number) of an automatic name: ``allreduce.noname.7``, or ``grouped_allreduce.noname.7.2`` (a
    grouped op's third tensor); None for a name the user gave."""
    kind, sep, rest = name.rpartition(".noname.")
    number = rest.split(".", 1)[0]
    return (kind, int(number)) if sep and number.isdigit() else None


class Submissions:
    """The ops of one rank (see the module docstring).

    Args:
        engine: what the handles drive while a caller waits on them.
        world_size: ranks in the job (a job of one rank sends no data eagerly).
        eager_bytes: allreduces up to this size travel inside the negotiation message (at most
            ``EAGER_JOB_BYTES`` / ``whole_from``).
        whole_from: the ranks whose eager data every rank receives whole (default: the job's).
    """

    def __init__(self, engine: EngineLike, world_size: int, eager_bytes: int, whole_from: int = 0) -> None:
        # the total that every rank receives, not each op's, is what must stay small
        self.engine, self.world_size = engine, world_size
        self.eager_bytes = min(eager_bytes, EAGER_JOB_BYTES // max(whole_from or world_size, 1))
        self.lock = threading.Lock()
        self.new: list[LocalOp] = []  # submitted, not yet announced
        self.inflight: dict[str, LocalOp] = {}
        self.taken: set[str] = set()  # names submitted and not yet finished (a superset of inflight's)
        # names of ops that finished with no end seen past them yet (module docstring) -> their submission's number
        self.unseen: dict[str, int] = {}
        self._numbers: dict[str, int] = {}  # taken name -> its submission's number on this rank (1, 2, ...)
        self._submitted = 0
        self._last_finished = 0  # the highest submission number whose op finished
        self.waiting: list[tuple[str, float]] = []  # (name, since) that threads of this rank are blocked on
        self.async_new = False  # something was submitted for the background thread to announce
        self.sleeping = False  # the background thread sleeps on the wake pipe (set by the progress loop)
        self.failure: str | None = None
        self.stopped = False
        self._counters: defaultdict[str, int] = defaultdict(int)
        self._given_back: defaultdict[str, set[int]] = defaultdict(set)  # waiting for those above them to come back

    def auto_name(self, kind: str) -> str:
        """``allreduce.noname.7``: ranks that submit unnamed ops in the same order agree on names."""
        with self.lock:
            self._counters[kind] += 1
            return f"{kind}.noname.{self._counters[kind]}"

    def give_back_auto_name(self, name: str) -> None:
        """An unnamed op that the other ranks never submitted fails: its number was never used by them, so
        this rank's next unnamed op of that kind takes it again and the ranks' names stay in step. Numbers come
        off the top of the count only: one given back below a number still in use waits until that one comes
        back too (two unnamed ops of a deadlock fail in either order)."""
        parsed = _auto_number(name)
        if parsed is None:
            return
        kind, number = parsed
        with self.lock:
            returned = self._given_back[kind]
            returned.add(number)
            while self._counters[kind] in returned:
                returned.discard(self._counters[kind])
                self._counters[kind] -= 1

    def catch_up_auto_name(self, name: str) -> None:
        """The other ranks ran (or failed) the unnamed op ``name`` while this rank had joined: its number is
        used, so this rank's next unnamed op of that kind takes the one after it, as theirs does."""
        parsed = _auto_number(name)
        if parsed is not None:
            with self.lock:
                self._counters[parsed[0]] = max(self._counters[parsed[0]], parsed[1])

    def add(self, items: Sequence[tuple[Request, np.ndarray | None]], wake: bool,
            on_queued: Callable[[LocalOp], None] | None = None) -> tuple[list[LocalOp], bool]:
        """Queue ops (all or none); return them and whether the sleeping engine must be woken.

        ``on_queued(op)`` runs under the lock just before ``op`` becomes visible to a cycle (the timeline's start).

        Raises:
            CollectiveError: this rank failed or shut down.
            ValueError: a name is already taken on this rank (or given twice).
        """
        ops = [self._local_op(request, _NO_DATA if array is None else array) for request, array in items]
        with self.lock:
            if self.failure is not None:
                raise CollectiveError(self.failure)
            if self.stopped:
                raise CollectiveError("hvdrun has been shut down on this rank")
            self._check_names([op.request.name for op in ops])
            for op in ops:
                if on_queued is not None:
                    on_queued(op)
                self.inflight[op.request.name] = op
                op.handle.number = self._take(op.request.name)
                self.new.append(op)
            self.async_new = self.async_new or wake
            return ops, wake and self.sleeping

    def claim(self, name: str) -> bool:
        """Take ``name`` for an op that runs without the queue (the engine's express cycle): False when this rank
        failed, stopped, or has the name in flight or finished and not yet seen (module docstring)."""
        with self.lock:
            if self.failure is not None or self.stopped or name in self.taken or name in self.unseen:
                return False
            self._take(name)
            return True

    def _take(self, name: str) -> int:
        """``name`` is taken by a new submission (with the lock held); its number."""
        self._submitted += 1
        self.taken.add(name)
        self._numbers[name] = self._submitted
        return self._submitted

    def adopt(self, request: Request, array: np.ndarray, payload: Message | None) -> LocalOp:
        """An op already announced by an express cycle that did not go through at once: in flight from now on,
        finished by the cycles that follow (its name stays taken until then)."""
        op = LocalOp(request, array, Handle(self.engine, request.name), payload)
        with self.lock:
            op.handle.number = self._numbers.get(request.name, 0)
            failure = self.failure
            if failure is None:
                self.inflight[request.name] = op
        if failure is not None:
            op.handle.finish(error=CollectiveError(failure))
        return op

    def _check_names(self, names: list[str]) -> None:
        taken = next((name for name in names if name in self.taken or name in self.unseen), None)
        if taken is not None or len(set(names)) < len(names):
            taken = taken or next(name for name in names if names.count(name) > 1)
            unsynchronized = " (its handle not yet synchronized)" if taken in self.unseen else ""
            raise ValueError(f"a collective named '{taken}' is already in progress on this rank{unsynchronized}; "
                             "names must be unique among collectives in flight")

    def _local_op(self, request: Request, array: np.ndarray) -> LocalOp:
        return LocalOp(request, array, Handle(self.engine, request.name), self.eager_payload(request, array))

    def eager_payload(self, request: Request, array: np.ndarray) -> Message | None:
        """The prescaled data of a small allreduce, sent with its announcement (a view of ``array`` when there is
        nothing to scale: the announcement is made before the op writes its result there)."""
        if (request.kind != "allreduce" or request.device != "cpu" or array.nbytes > self.eager_bytes
                or self.world_size == 1 or request.group_size > 1):  # a group goes fused through the ring
            return None
        if request.prescale == 1.0:
            return as_bytes(array)
        copy = array.reshape(-1).copy()
        scale(copy, request.prescale)
        return copy.tobytes()

    def release_name(self, name: str, seen: bool = False) -> None:
        """The op ``name`` finished on this rank: its name is free once an end past it is seen (at once when the
        caller has ``seen`` it finish, a blocking op, or an op submitted after it finished already); the names of
        earlier ops that finished are free now."""
        with self.lock:
            if name not in self.taken:
                return
            self.taken.discard(name)
            number = self._numbers.pop(name)
            if not seen and number > self._last_finished:
                self.unseen[name] = number
            if number > self._last_finished:
                self._last_finished = number
                self.unseen = {other: earlier for other, earlier in self.unseen.items() if earlier >= number}

    def seen(self, name: str, number: int) -> None:
        """The caller took up the end of the op ``name``, this rank's submission ``number`` (synchronized, waited
        or polled it): the name is free (unless a newer op of that name holds it: an old handle polled late)."""
        with self.lock:
            if self.unseen.get(name) == number:
                del self.unseen[name]

    def take_new(self, confirm_age_s: float) -> tuple[list[LocalOp], list[str]]:
        """The ops to announce in the next cycle, and the names blocked on for at least ``confirm_age_s``."""
        with self.lock:
            new, self.new, self.async_new = self.new, [], False
            now = time.monotonic()
            return new, [name for name, since in self.waiting if now - since >= confirm_age_s]

    def take_inflight(self, names: list[str]) -> list[LocalOp | None]:
        """Remove and return this rank's ops of ``names`` (None for a name no longer in flight)."""
        with self.lock:
            return [self.inflight.pop(name, None) for name in names]

    def finish_local(self, name: str, error: BaseException) -> str:
        """Fail this rank's op ``name``, if it is still in flight; ``absent`` (it was not), ``waited`` (a thread of
        this rank is blocked on it) or ``unwaited``."""
        with self.lock:
            op = self.inflight.pop(name, None)
            waited = any(awaited == name for awaited, _ in self.waiting)
        if op is None:
            return "absent"
        op.handle.finish(error=error)
        return "waited" if waited else "unwaited"

    def fail_all(self, reason: str) -> None:
        """Record this rank's failure and fail every op in flight with it."""
        with self.lock:
            self.failure = reason
            ops, self.inflight, self.new = list(self.inflight.values()), {}, []
        for op in ops:
            op.handle.finish(error=CollectiveError(reason))

    def mark_stopped(self) -> None:
        """The negotiated shutdown completed: no more cycles."""
        self.stopped = True
