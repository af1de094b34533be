"""How a cycle's announcements travel between ranks: all-gathered whole, or merged on the way.

Every rank announces ``(items, waiting)``: its new requests (each its cached number or whole description, with
its data when eager) and the names it is blocked on. Backends that can only all-gather messages carry every
announcement whole to every rank. Across hosts (the native backend's hierarchy) the announcements are *merged*
instead, by recursive doubling: a rank's value is ``({rank: announcement without data}, lone)``, where ``lone``
is ``(request key, data)`` when the rank announced exactly one eager op and is blocked on nothing. Two values
merge by uniting their announcements and, when both carry a lone op with the same key, reducing its data (lower
ranks' first, so every rank ends with the same bits). So the steady state of training (every rank announcing
the same small allreduce) sends log2(hosts) messages of one tensor's size, as MPI's recursive doubling does,
instead of every rank's data to every rank. When the lone ops differ anywhere, the data is dropped and the ops
run as ordinary negotiated allreduces: eager data is used only when every rank announced the same op alone.

The steady state has a compact form of its own (:class:`Uniform`): "ranks lo..hi all announced cached request
number K alone, and here is their data reduced", which travels as a 32-byte header and the raw data (no marshal,
no per-rank entries) and merges with its neighbour range by one reduction. Anything else (another op, a rank
blocked on a name, a request not cached yet) travels in the general form, into which a uniform range expands. A
cycle without data has one too (:class:`HeldRange`): "ranks lo..hi hold exactly these numbers since cycle S, and say
nothing else" (a step's gradients held by every rank), a header and the numbers, which merges with its neighbour
range when the numbers and the cycle are the same. Where the compiled module is built
(:mod:`hvdrun.runtime.compiled`), the steps across hosts of either form run in one call of it, on the same wire.

**Held requests** (Horovod's response-cache bits, :class:`hvdrun.runtime.cycle.Cycle` decides which): a request
that every rank has agreed on before (a cached number) is not announced once into every rank's table but *held*
by the rank that submitted it, and every cycle says which numbers it holds. They merge as *tallies*, one per
number: how many ranks hold it, in which cycles they began to (a count per cycle), and the last of them (the
straggler watch's facts). A tally's size does not depend on the number of ranks, so a cycle in which every rank
announces only held requests costs the same bytes at 4 ranks as at 4,000; a number held by every rank is ready
(the cycle runs it), the others stay held. A rank that holds a number too long, or a cycle with anything in the
general form, has the numbers that are not held everywhere *flushed*: in the next cycle their holders announce
them in the general form, so that the table sees them (mismatches, stalls, deadlocks, joins keep their exact
verdicts and messages).
"""

from __future__ import annotations

import ctypes
import marshal
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from hvdrun.runtime.backends.backend import Backend
from hvdrun.runtime.collectives.hierarchical import MergedPath
from hvdrun.runtime.collectives.streams import frame_length
from hvdrun.runtime.compiled import (
    DTYPES,
    OPS,
    POSTS_DIFFER,
    RESULT_OTHER,
    SAME,
    Outcome,
    StepLink,
    UniformSteps,
    WholeBoard,
    WholeSteps,
    frame_bytes_of,
    step_links,
)
from hvdrun.runtime.negotiation import Request
from hvdrun.runtime.reduce import REDUCE_FNS
from hvdrun.runtime.transport.channels import (
    Codec,
    DoublingStep,
    Message,
    RxChannel,
    StepsTaken,
    TxChannel,
    Waiter,
)
from hvdrun.runtime.transport.posts import SLOT_BYTES

Announcement = tuple[list[tuple[Any, Message | None]], list[str]]  # (items, names blocked on)


class Agreement:
    """What a cycle's exchange gave every rank alike.

    ``decoded``: every rank's announcement, by rank (without data where they were merged; listed when first read:
    an express cycle that ran never reads them); ``total``: the reduced data of the op that every rank announced
    alone with its data, when announcements were merged; ``tallies``: every held number's :data:`Tally`;
    ``flush``: the numbers not held by every rank are to be flushed (see the module docstring); ``general``: some
    rank announced something in the general form (else ``decoded`` lists nothing).
    """

    __slots__ = ("_listing", "_listed", "total", "tallies", "flush", "general")

    def __init__(self, listing: Callable[[], list[Announcement]], total: Any = None,
                 tallies: dict[int, Tally] | None = None, flush: bool = False, general: bool = True) -> None:
        self._listing, self.total = listing, total
        self.tallies, self.flush, self.general = tallies or {}, flush, general
        self._listed: list[Announcement] | None = None

    @property
    def decoded(self) -> list[Announcement]:
        if self._listed is None:
            self._listed = self._listing()
        return self._listed


class Uniform(NamedTuple):
    """Ranks ``lo`` to ``hi`` each announced the cached request number ``key`` alone, with its data; ``data``: their
    data reduced (the steady state of training, see the module docstring)."""

    key: int
    lo: int
    hi: int
    data: Any  # a buffer


class HeldRange(NamedTuple):
    """Ranks ``lo`` to ``hi`` each hold exactly the cached request numbers ``keys`` (int64, ascending), all since
    cycle ``since``, and say nothing else: the steady state of a cycle without data (a step's gradients, held)."""

    keys: bytes
    since: int
    lo: int
    hi: int


# One held number's tally: ({cycle a rank began to hold it: how many ranks}, the last such cycle, the ranks that
# began then as ranges (lo, hi, lo, hi, ...), at most LAST_RANGES of them). Plain tuples and dicts: marshal carries
# them. Ranges keep the common cases small at any size: every rank began in the same cycle (one range), one rank
# or one host came last (one range).
Tally = tuple[dict[int, int], int, tuple[int, ...]]
LAST_RANGES = 16  # ranges of last ranks a tally keeps; ranks past them are counted, not named


def holders(tally: Tally) -> int:
    """How many ranks hold the number."""
    return sum(tally[0].values())


def last_ranks(tally: Tally) -> list[int]:
    """The ranks that began to hold the number last (those the tally names)."""
    ranges = tally[2]
    return [rank for lo, hi in zip(ranges[::2], ranges[1::2], strict=True) for rank in range(lo, hi + 1)]


def merge_tallies(lower: dict[int, Tally], upper: dict[int, Tally]) -> dict[int, Tally]:
    """Two ranges of ranks' tallies as one (``lower`` holds the lower ranks).

    Numbers whose tallies are the same object on both sides (ranks that began to hold them together, as a step's
    gradients) share one merged object: marshal writes a shared object once and a reference for each other
    number, so a cycle of k numbers held alike costs one tally and k small references."""
    if not lower:
        return upper
    merged, done = dict(lower), {}
    for key, theirs in upper.items():
        ours = merged.get(key)
        if ours is None:
            merged[key] = theirs
            continue
        pair = (id(ours), id(theirs))
        if pair not in done:
            done[pair] = _merge_tally(ours, theirs)
        merged[key] = done[pair]
    return merged


def _merge_tally(lower: Tally, upper: Tally) -> Tally:
    counts = dict(lower[0])
    for cycle, count in upper[0].items():
        counts[cycle] = counts.get(cycle, 0) + count
    if lower[1] != upper[1]:
        return (counts, *(lower[1:] if lower[1] > upper[1] else upper[1:]))  # type: ignore[return-value]
    below, above = lower[2], upper[2]
    if below and above and below[-1] + 1 == above[0]:  # adjacent ranges join
        ranges = below[:-1] + above[1:]
    else:
        ranges = below + above
    return counts, lower[1], ranges[:2 * LAST_RANGES]


# a tag (never marshal's first byte: its type codes are printable), key or since, lo, hi; the data follows, 8-aligned
_UNIFORM = struct.Struct("<B7xqqq")
UNIFORM_TAG, HELD_RANGE_TAG = 0, 2


def _dumps(value: Any) -> Message:
    if type(value) is Uniform:
        return b"".join((_UNIFORM.pack(UNIFORM_TAG, value.key, value.lo, value.hi), value.data))
    if type(value) is HeldRange:
        return _UNIFORM.pack(HELD_RANGE_TAG, value.since, value.lo, value.hi) + value.keys
    return marshal.dumps(value)


def _loads(message: Message) -> Any:
    tag = message[0]
    if tag == UNIFORM_TAG:
        _, key, lo, hi = _UNIFORM.unpack_from(message)
        return Uniform(key, lo, hi, memoryview(message)[_UNIFORM.size:])
    if tag == HELD_RANGE_TAG:
        _, since, lo, hi = _UNIFORM.unpack_from(message)
        return HeldRange(bytes(message[_UNIFORM.size:]), since, lo, hi)
    return marshal.loads(message)


CODEC = Codec(_dumps, _loads)
WHOLE = "whole"  # Announcements.exchange_whole's word for "the whole job's value is in the array"
_UNMADE: Any = object()  # a route not made yet (None: the compiled module never takes that op)


class _WholeRoute(NamedTuple):
    """A lone op's (or a held range's) way through the compiled module's whole ops: the steps, prepared; the merged path
    they run (Python goes on along it where they stop); the channels Python may have read ahead on; what each step
    across hosts sends, counted on its channel."""

    steps: WholeSteps
    path: MergedPath
    channels: tuple[RxChannel, ...]
    sent: tuple[tuple[TxChannel, int], ...]


def _count_sent(steps: Sequence[DoublingStep], nbytes: int, done: int, unsent: bytes, received: bytes) -> None:
    """Count on each channel what the compiled module sent for a uniform value of ``nbytes``: ``done`` whole steps,
    and of the next one (begun when ``received``) its frame but ``unsent``."""
    for step in steps[:done]:
        step.tx.bytes_sent += frame_bytes_of(nbytes, step.mode)
    if received:
        step = steps[done]
        step.tx.bytes_sent += frame_bytes_of(nbytes, step.mode) - len(unsent)


class Announcements:
    """Exchanges one rank's announcements with every rank (see the module docstring).

    Args:
        backend: carries them; merged when it can (``backend.merges``).
        rank: this rank.
        size: ranks in the job.
        request_of: the request a key stands for (the response cache's decoding).
    """

    def __init__(self, backend: Backend, rank: int, size: int, request_of: Callable[[Any], tuple],
                 compiled: UniformSteps | None = None) -> None:
        self.backend, self.rank, self.size, self._request_of = backend, rank, size, request_of
        self._cycle = 0  # the cycle being exchanged (a uniform range's ranks began to hold its number in it)
        self._layouts: dict[Any, tuple[np.dtype, Callable[..., Any], int]] = {}
        self._compiled = compiled
        self._step_links: dict[int, tuple[StepLink, ...]] = {}  # by id() of the doubling's steps (fixed per group)
        self.codec = Codec(_dumps, _loads, self._compiled_steps if compiled is not None else None)
        # where the backend says how its values merge, the compiled module may run a lone op whole (exchange_whole)
        self._path = backend.merged_path() if compiled is not None and backend.merges else None
        self._routes: dict[int, _WholeRoute | None] = {}  # exchange_whole's, by request number (None: never)
        self._held_routes: dict[int, _WholeRoute | None] = {}  # _held_whole's, by the size of the numbers
        self._address: tuple[np.ndarray | None, int] = (None, 0)  # the last array exchange_whole wrote, its address

    def exchange(self, announcement: Announcement, held: Mapping[int, int] | None = None, cycle: int = 0,
                 flush: bool = False, lone: tuple[int, Message] | None = None) -> Agreement:
        """Every rank's announcement (and the merged data of a lone op every rank announced).

        Args:
            announcement: this rank's requests in the general form, and the names it is blocked on.
            held: the numbers this rank holds, each with the cycle it began to hold it (merging backends only).
            cycle: this cycle's number (the same on every rank).
            flush: this rank asks for the numbers not held everywhere to be flushed.
            lone: the one number this rank holds, with its data, when it has nothing else to say.
        """
        if not self.backend.merges:
            decoded = [marshal.loads(m) for m in self.backend.allgather_messages(marshal.dumps(announcement))]
            return Agreement(lambda: decoded)
        self._cycle = cycle
        items, waiting = announcement
        held = held or {}
        quiet = not items and not waiting and not flush
        if lone is not None and quiet and len(held) == 1:
            value: Any = Uniform(lone[0], self.rank, self.rank, lone[1])
        elif quiet and held and len(set(held.values())) == 1:
            value = HeldRange(np.array(sorted(held), np.int64).tobytes(), next(iter(held.values())), self.rank,
                              self.rank)
        else:
            alone = items[0] if len(items) == 1 and items[0][1] is not None and not waiting and not held else None
            announced = {self.rank: ([(key, None) for key, _ in items], waiting)} if items or waiting else {}
            began: dict[int, Tally] = {}  # numbers held since the same cycle share one tally (see merge_tallies)
            tallies = {key: began.setdefault(since, ({since: 1}, since, (self.rank, self.rank)))
                       for key, since in held.items()}
            value = (announced, alone, tallies, flush)
        if type(value) is HeldRange and (merged := self._held_whole(value)) is not None:
            return self.agreement(merged)
        return self.agreement(self.backend.allgather_merged(value, self._merge, self.codec))

    def exchange_lone(self, key: int, data: Message, cycle: int) -> Any:
        """The steady state's exchange (merging backends): this rank holds only the number ``key``, with its data,
        since this cycle, and says nothing else; what :meth:`exchange` would send for it. The merged value comes
        back as it is: a :class:`Uniform` of every rank when they all did the same, else anything that
        :meth:`agreement` turns into the cycle's agreement."""
        self._cycle = cycle
        return self.backend.allgather_merged(Uniform(key, self.rank, self.rank, data), self._merge, self.codec)

    def exchange_whole(self, key: int, data: Message, cycle: int, array: np.ndarray, factor: float) -> Any:
        """:meth:`exchange_lone` of ``array`` (contiguous; ``data`` is its bytes), where the compiled module runs the
        whole exchange (the host's board, the steps across hosts, the leader's result) and, when every rank sent the
        same, writes the job's value into ``array`` multiplied by ``factor``: :data:`WHOLE` then. Else what
        :meth:`exchange_lone` gives, ``array`` untouched (Python goes on from where the module stopped, on the same
        wire)."""
        route = self._route(key, array.nbytes, factor)
        if route is None:
            return self.exchange_lone(key, data, cycle)
        self._cycle = cycle
        cached, address = self._address
        if cached is not array:
            address = array.ctypes.data  # a microsecond: remembered for the array that comes back each step
            self._address = (array, address)
        outcome = self._run_route(route, address)
        if outcome is None:
            return WHOLE
        return self._after_whole(route, outcome, Uniform(key, self.rank, self.rank, data))

    def _held_whole(self, value: HeldRange) -> Any:
        """A held range's cycle (this rank's ``value``) run whole by the compiled module, as :meth:`exchange_whole`
        runs a lone op: every rank's merged value; None where the module does not take it."""
        route = self._route(0, len(value.keys), 1.0, HELD_RANGE_TAG)
        if route is None:
            return None
        address = ctypes.cast(ctypes.c_char_p(value.keys), ctypes.c_void_p).value or 0  # the bytes' own buffer
        outcome = self._run_route(route, address, value.since)
        if outcome is None:
            return HeldRange(value.keys, value.since, 0, self.size - 1)
        return self._after_whole(route, outcome, value)

    @staticmethod
    def _run_route(route: _WholeRoute, address: int, key: int | None = None) -> Outcome | int | None:
        """One op along ``route`` (its data at ``address``; ``key``: the header's number, where it changes): as
        :meth:`WholeSteps.run` says, what each step across hosts sent counted when it went through."""
        outcome = route.steps.run(address, key)
        route.path.cross.waiter.progressed()  # the next wait in Python spins first, as after any progress
        if outcome is None:
            for channel, sent in route.sent:
                channel.bytes_sent += sent
        return outcome

    def _after_whole(self, route: _WholeRoute, outcome: Outcome | int, value: Uniform | HeldRange) -> Any:
        """The merged value of an exchange of this rank's ``value`` where the compiled call stopped short
        (``outcome``): Python goes on along the route's path from there."""
        path = route.path
        hierarchy = path.hierarchy
        if outcome == POSTS_DIFFER:  # the host's posts of this round: Python merges them and goes on
            assert hierarchy is not None
            return hierarchy.merge_posted(value, _dumps(value), self._merge, self.codec)
        if outcome == RESULT_OTHER:  # the leader's result, posted in the round the module waited for
            assert hierarchy is not None
            return hierarchy.posted_result(self.codec)
        assert isinstance(outcome, Outcome)
        _count_sent(path.cross.doubling_steps, len(outcome.data), outcome.done, outcome.unsent, outcome.received)
        if isinstance(value, Uniform):
            value = Uniform(value.key, outcome.lo, outcome.hi, outcome.data)
        else:
            value = HeldRange(value.keys, value.since, outcome.lo, outcome.hi)
        merged = path.cross.resume_merged(StepsTaken(value, outcome.done, outcome.unsent, outcome.received),
                                          self._merge, self.codec)
        return hierarchy.shared_result(merged, self.codec) if path.board is not None and hierarchy else merged

    def _route(self, key: int, nbytes: int, factor: float, tag: int = UNIFORM_TAG) -> _WholeRoute | None:
        """The compiled module's way for a lone op of the request ``key`` (every op of it has ``nbytes`` and
        ``factor``), or (``tag`` HELD_RANGE_TAG) for held ranges of ``nbytes`` of numbers, made once and
        remembered. None where the module does not take it: never (a type or op it does not reduce, an integer type
        to scale, a channel that is not a socket, a value too long for the host's board: remembered too), or not
        now (Python read ahead on a channel: its turn)."""
        routes, name = (self._held_routes, nbytes) if tag == HELD_RANGE_TAG else (self._routes, key)
        route = routes.get(name, _UNMADE)
        if route is _UNMADE:
            route = self._new_route(key, nbytes, factor, tag)
            if len(routes) >= 4096:
                routes.clear()
            routes[name] = route
        if route is None or any(rx.staged() for rx in route.channels):
            return None
        return route

    def _new_route(self, key: int, nbytes: int, factor: float, tag: int) -> _WholeRoute | None:
        """:meth:`_route`'s way, made."""
        path, compiled = self._path, self._compiled
        if path is None or compiled is None or (path.board is not None and _UNIFORM.size + nbytes > SLOT_BYTES):
            return None
        steps = path.cross.doubling_steps
        links = self._socket_links(steps) if steps else ()
        if links is None:
            return None
        if tag == HELD_RANGE_TAG:
            dtype_code, op_code = 0, SAME
        else:
            dtype, _, op = self._layout(key)
            found_dtype, found_op = DTYPES.get(dtype), OPS.get(op)
            if found_dtype is None or found_op is None or (factor != 1.0 and dtype.kind != "f"):
                return None
            dtype_code, op_code = found_dtype, found_op
        board = None
        if path.board is not None:
            assert path.hierarchy is not None
            board = WholeBoard(path.board, path.member, path.first_rank, path.hierarchy.wait_posted)
        whole = compiled.whole(tag, key, self.rank, self.size, nbytes, dtype_code, op_code, factor, links,
                               path.cross.waiter, board)
        if path.board is not None and path.member != 0:  # only a host's leader crosses: nothing to watch or count
            return _WholeRoute(whole, path, (), ())
        channels = tuple({id(step.rx): step.rx for step in steps}.values())
        return _WholeRoute(whole, path, channels, tuple((step.tx, frame_bytes_of(nbytes, step.mode)) for step in steps))

    def agreement(self, merged: Any) -> Agreement:
        """The agreement of a cycle whose values merged into ``merged``."""
        announced, total, tallies, flush = self._general(merged)
        nothing: Announcement = ([], [])
        return Agreement(lambda: [announced.get(rank, nothing) for rank in range(self.size)],
                         total[1] if total else None, tallies, flush, bool(announced))

    def _merge(self, lower: Any, upper: Any) -> Any:
        """Two ranges of ranks' values as one (``lower`` holds the lower ranks)."""
        kind = type(lower)
        if kind is type(upper) and kind is not tuple and lower.hi + 1 == upper.lo:
            if kind is Uniform and lower.key == upper.key:
                dtype, combine, _ = self._layout(lower.key)
                return Uniform(lower.key, lower.lo, upper.hi,
                               combine(np.frombuffer(lower.data, dtype), np.frombuffer(upper.data, dtype)))
            if kind is HeldRange and lower.keys == upper.keys and lower.since == upper.since:
                return HeldRange(lower.keys, lower.since, lower.lo, upper.hi)
        lower, upper = self._general(lower), self._general(upper)
        announced = {**lower[0], **upper[0]} if upper[0] else lower[0]
        tallies, flush = merge_tallies(lower[2], upper[2]), lower[3] or upper[3]
        a, b = lower[1], upper[1]
        if a is None or b is None or a[0] != b[0]:
            return announced, None, tallies, flush
        dtype, combine, _ = self._layout(a[0])
        return (announced, (a[0], combine(np.frombuffer(a[1], dtype), np.frombuffer(b[1], dtype))),  # marshal: bytes
                tallies, flush)

    def _general(self, value: Any) -> tuple:
        """``value`` in the general form: ({rank: announcement without data}, lone op or None, {number: tally},
        flush). A uniform range's ranks hold its number (they began to in this cycle)."""
        kind = type(value)
        if kind is Uniform:
            tally = ({self._cycle: value.hi - value.lo + 1}, self._cycle, (value.lo, value.hi))
            return {}, (value.key, value.data), {value.key: tally}, False
        if kind is HeldRange:  # one tally object for every number (marshal writes it once, see merge_tallies)
            tally = ({value.since: value.hi - value.lo + 1}, value.since, (value.lo, value.hi))
            return {}, None, dict.fromkeys(np.frombuffer(value.keys, np.int64).tolist(), tally), False
        return value

    def _layout(self, key: Any) -> tuple[np.dtype, Callable[..., Any], int]:
        """The dtype, reduction and op code of the request ``key`` stands for, remembered per key."""
        layout = self._layouts.get(key)
        if layout is None:
            request = Request.from_wire(self._request_of(key))
            layout = np.dtype(request.dtype), REDUCE_FNS[request.op], request.op
            if len(self._layouts) >= 4096:
                self._layouts.clear()
            self._layouts[key] = layout
        return layout

    def _compiled_steps(self, value: Any, steps: Sequence[DoublingStep], waiter: Waiter) -> StepsTaken | None:
        """The doubling's steps of a uniform value in one call of the compiled module (:attr:`codec`'s ``steps``);
        None where it does not take them: another value, a type or op it does not reduce, a channel that is not a
        socket or has bytes staged."""
        compiled, kind = self._compiled, type(value)
        if compiled is None or (kind is not Uniform and kind is not HeldRange):
            return None
        links = self._links(steps)
        if links is None:
            return None
        if kind is Uniform:
            dtype, _, op = self._layout(value.key)
            dtype_code, op_code = DTYPES.get(dtype), OPS.get(op)
            if dtype_code is None or op_code is None or (begun := self._staged_frame(steps[0].rx)) is None:
                return None  # (the staged frame is taken last: once taken, the compiled steps must run)
            outcome = compiled.run(UNIFORM_TAG, value.key, value.lo, value.hi, value.data, dtype_code, op_code, links,
                                   waiter, begun)
            result: Any = Uniform(value.key, outcome.lo, outcome.hi, outcome.data)
        else:
            if (begun := self._staged_frame(steps[0].rx)) is None:
                return None
            outcome = compiled.run(HELD_RANGE_TAG, value.since, value.lo, value.hi, value.keys, 0, SAME, links, waiter,
                                   begun)
            result = HeldRange(value.keys, value.since, outcome.lo, outcome.hi)
        waiter.progressed()  # the next wait in Python spins first, as after any progress
        _count_sent(steps, len(outcome.data), outcome.done, outcome.unsent, outcome.received)
        return StepsTaken(result, outcome.done, outcome.unsent, outcome.received)

    @staticmethod
    def _staged_frame(rx: RxChannel) -> bytes | None:
        """What the first step's channel staged (the Python path read ahead), taken out of it: the start of the
        partner's frame of that step; None when it holds more than that frame (a later one too: Python's turn)."""
        staged = rx.staged()
        if not staged:
            return b""
        view = rx.peek(staged)  # no more than is staged: nothing is read from the socket
        if len(view) >= 8 and staged > frame_length(view):
            return None
        begun = bytes(view)
        rx.consume(staged)
        return begun

    def _links(self, steps: Sequence[DoublingStep]) -> tuple[StepLink, ...] | None:
        """The steps' sockets, or None when one is not a socket, or a step's after the first has bytes staged (the
        first one's are taken over, :meth:`_staged_frame`)."""
        if not steps or any(step.rx.staged() for step in steps[1:] if step.rx is not steps[0].rx):
            return None
        return self._socket_links(steps)

    def _socket_links(self, steps: Sequence[DoublingStep]) -> tuple[StepLink, ...] | None:
        """The steps' sockets (remembered: a group's steps never change), or None when one is not a socket."""
        links = self._step_links.get(id(steps))
        if links is None:
            links = step_links(steps)
            if links is None:
                return None
            self._step_links[id(steps)] = links
        return links
