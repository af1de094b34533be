"""Negotiation: which collectives are ready on every rank, in one order that all ranks agree on.

Each engine cycle, every rank announces the requests submitted since its last cycle
(:meth:`Request.wire`), and all announcements are all-gathered. Every rank feeds them, in
rank order, into its own :class:`Table`; the tables are therefore identical, and so is the
list of ready entries they yield, without a coordinator. A name is ready when all ranks
requested it; its requests are then checked against each other (kind, dtype, shape, op,
root, scale factors) and consecutive compatible allreduces are fused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hvdrun.envvars import EAGER_BYTES
from hvdrun.errors import CollectiveError
from hvdrun.runtime.reduce import OP_NAMES, SUM

GLOBAL_SET = 0
DEVICE_SET_KINDS = ("allreduce", "broadcast")  # what the device path runs within a process set
MIXED_DEVICES = "mixed: "  # the device of a grouped op's requests whose tensors are on several devices
_DEVICE_ITEMSIZES = {"bfloat16": 2}  # device tensors' dtypes that numpy lacks
JOIN = "__join__"  # the name of hvd.join()'s request
DEFAULT_CACHE_CAPACITY = 1024  # Horovod's default HOROVOD_CACHE_CAPACITY


class Request(NamedTuple):
    """One rank's description of a collective; what the ranks compare."""

    name: str
    kind: str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    op: int = SUM
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] = ()
    group: int = 0
    device: str = "cpu"  # "cpu": numpy buffers on hvdrun's backends; "torch:cuda" etc.: the device path
    process_set: int = GLOBAL_SET
    group_size: int = 0  # tensors of the grouped op this request belongs to (named BASE.0 .. BASE.n-1)
    source: str = ""  # the caller's dtype where it travels as another (float16 reduced as float32, bfloat16 bits)

    def wire(self) -> tuple:
        """A plain tuple for marshal."""
        return tuple(self)

    @classmethod
    def from_wire(cls, values: tuple) -> Request:
        """Inverse of :meth:`wire`."""
        return cls._make(values)

    @property
    def nbytes(self) -> int:
        """Size of the tensor in bytes."""
        if not self.dtype:
            return 0
        return math.prod(self.shape) * (_DEVICE_ITEMSIZES.get(self.dtype) or np.dtype(self.dtype).itemsize)


@dataclass
class Entry:
    """A name some ranks have requested, with each rank's request."""

    name: str
    requests: dict[int, Request] = field(default_factory=dict)
    payloads: dict[int, bytes] = field(default_factory=dict)
    first_seen: float = field(default_factory=time.monotonic)
    warned: bool = False
    error: str | None = None
    arrived: dict[int, float] = field(default_factory=dict)  # rank -> when its request's cycle ran here, in order
    members: tuple[int, ...] = ()  # the ranks of the op's process set (set when ready)
    absent: frozenset[int] = frozenset()  # ranks that take part without a request: joined or not in the set
    everyone: bool = False  # every rank held this cached request (Table.add_everyone): ready, checked before

    @property
    def order(self) -> list[int]:
        """The ranks in the order their requests arrived."""
        return list(self.arrived)

    @property
    def first_arrival(self) -> float:
        """When the first request arrived (the cycle's time, as :attr:`arrived` records it)."""
        return next(iter(self.arrived.values()))

    @property
    def first(self) -> Request:
        """The request of the lowest rank that made one (the reference for checks and execution)."""
        return self.requests[0] if self.everyone else self.requests[min(self.requests)]

    def missing(self, size: int) -> list[int]:
        """Ranks that have not requested this name yet."""
        return [rank for rank in range(size) if rank not in self.requests]


def _differs(entry: Entry, what: str, value_of) -> str | None:
    values: dict[object, list[int]] = {}
    for rank, request in sorted(entry.requests.items()):
        values.setdefault(value_of(request), []).append(rank)
    if len(values) == 1:
        return None
    kind = entry.requests[min(entry.requests)].kind
    parts = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v}" for v, r in values.items())
    return f"{kind} '{entry.name}': {what} differs across ranks ({parts})"


def validate(entry: Entry, size: int) -> str | None:
    """The mismatch error of a complete entry, or None when every rank asked for the same thing."""
    first = entry.first
    outsiders = sorted(set(entry.requests) - set(entry.members))
    if outsiders:
        return (f"{first.kind} '{entry.name}': rank(s) {', '.join(map(str, outsiders))} are not in process set "
                f"{first.process_set} {list(entry.members)}")
    mixed = {rank: r.device for rank, r in sorted(entry.requests.items()) if r.device.startswith(MIXED_DEVICES)}
    if mixed:
        where = "; ".join(f"rank {rank}: {devices.removeprefix(MIXED_DEVICES)}" for rank, devices in mixed.items())
        return (f"{first.kind} '{entry.name}': a grouped op holds tensors on several devices ({where}); the tensors "
                "of one grouped op must share one device")
    if first.device != "cpu" and first.process_set != GLOBAL_SET and first.kind not in DEVICE_SET_KINDS:
        return (f"{first.kind} '{entry.name}': process sets are not supported with device tensors for this op "
                f"(device tensors reduce and broadcast within a process set: {', '.join(DEVICE_SET_KINDS)})")
    joined = sorted(set(entry.members) & entry.absent)
    if joined and (first.kind != "allreduce" or first.device != "cpu"):
        ranks = ", ".join(map(str, joined))
        return (f"{first.kind} '{entry.name}': rank(s) {ranks} already called join(); only CPU allreduces continue "
                "with joined ranks (they contribute zeros)")
    if first.kind != "broadcast" and all(request == first for request in entry.requests.values()):
        return None
    checks = [("operation", lambda r: r.kind), ("number of tensors in the group", lambda r: r.group_size),
              ("dtype", lambda r: r.source or r.dtype), ("device", lambda r: r.device),
              ("process set", lambda r: r.process_set)]
    kind = entry.first.kind
    if kind in ("allreduce", "reducescatter", "broadcast"):
        checks.append(("shape", lambda r: r.shape))
    if kind in ("allgather", "alltoall"):
        checks.append(("shape after the first dimension", lambda r: r.shape[1:]))
    if kind in ("allreduce", "reducescatter"):
        checks += [("reduction op", lambda r: OP_NAMES.get(r.op, r.op)),
                   ("scaling (prescale, postscale)", lambda r: (r.prescale, r.postscale))]
    if kind == "broadcast":
        checks.append(("root rank", lambda r: r.root))
    if kind in ("add_set", "remove_set"):
        checks.append(("process set", lambda r: (r.splits, r.root)))
    for what, value_of in checks:
        error = _differs(entry, what, value_of)
        if error:
            return error

    if kind == "broadcast" and entry.first.root not in entry.members:
        return f"broadcast '{entry.name}': root rank {entry.first.root} is not one of the ranks {list(entry.members)}"
    return None


class ResponseCache:
    """Requests agreed before, numbered alike on every rank (Horovod's response cache): a repeated request
    travels in the negotiation as its number, a few bytes instead of its whole description.

    Every rank remembers the same requests at the same point of the same cycle (those of entries that became
    ready without an error), so the numbers agree without a message; the oldest is forgotten first.

    Args:
        capacity: requests remembered (0: none, every request travels whole).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._numbers: dict[tuple, int] = {}
        self._wires: dict[int, tuple] = {}
        self._next = 0

    def encode(self, wire: tuple) -> tuple | int:
        """What travels for ``wire``: its number when remembered."""
        return self._numbers.get(wire, wire)

    def decode(self, value: tuple | int) -> tuple:
        """The request a received value stands for.

        Raises:
            CollectiveError: a number this rank never assigned (the ranks' cache capacities differ).
        """
        if not isinstance(value, int):
            return value
        wire = self._wires.get(value)
        if wire is None:
            raise CollectiveError(f"a rank sent cached request #{value}, which this rank does not have: "
                                  "HVDRUN_CACHE_CAPACITY (HOROVOD_CACHE_CAPACITY) must be the same on every rank")
        return wire

    def remember(self, entries: list[Entry]) -> None:
        """Number the requests of ``entries`` (ready, in the order every rank saw them) not numbered yet."""
        if not self.capacity:
            return
        for entry in entries:
            if entry.error or entry.everyone:  # a held request was numbered before
                continue
            if ".noname." in entry.name:
                continue  # an automatic name never comes back: it would only push out ops that do
            for request in entry.requests.values():
                self.remember_wire(request.wire())

    def remember_wire(self, wire: tuple) -> None:
        """Number one request every rank agreed on now (the eager fast path's)."""
        if wire in self._numbers or not self.capacity:
            return
        if len(self._wires) >= self.capacity:
            del self._numbers[self._wires.pop(next(iter(self._wires)))]
        self._numbers[wire], self._wires[self._next] = self._next, wire
        self._next += 1


class Table:
    """Every name requested and not yet executed; identical on all ranks."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: dict[str, Entry] = {}
        self.sets: dict[int, tuple[int, ...]] = {GLOBAL_SET: tuple(range(size))}  # process set id -> ranks
        self.now = 0.0  # when the cycle whose announcements are being added ran (monotonic seconds)

    def add(self, rank: int, request: Request, payload: bytes | None = None) -> None:
        """Record ``rank``'s request and, for eager ops, its data."""
        entry = self.entries.setdefault(request.name, Entry(request.name))
        if rank not in entry.requests:
            entry.arrived[rank] = self.now
        entry.requests[rank] = request
        if payload is not None:
            entry.payloads[rank] = payload

    def add_everyone(self, request: Request) -> None:
        """Every rank requested ``request``: one of the held requests that every rank held in this cycle (numbered
        alike, so identical on every rank and checked when they were first agreed on)."""
        entry = self.entries.get(request.name)
        if entry is not None:  # never while a rank holds it (its name would be in the table): the ordinary way
            for rank in range(self.size):
                self.add(rank, request)
            return
        self.entries[request.name] = Entry(request.name, dict.fromkeys(range(self.size), request), everyone=True)

    def joined(self) -> frozenset[int]:
        """Ranks that called join() and wait for the others: they take part in allreduces with zeros."""
        entry = self.entries.get(JOIN)
        return frozenset(entry.requests) if entry is not None else frozenset()

    def _ready(self, entry: Entry, joined: frozenset[int]) -> bool:
        members = self.sets.get(entry.first.process_set)
        if members is None:
            return True  # unknown set: validation reports it
        present = set(entry.requests) | (joined if entry.first.process_set == GLOBAL_SET and entry.name != JOIN
                                         else frozenset())
        return present.issuperset(members)

    def pop_ready(self) -> list[Entry]:
        """Remove and return the entries whose set's ranks all requested (or joined), in first-seen order."""
        joined = self.joined()
        ready = [entry for entry in self.entries.values() if entry.everyone or self._ready(entry, joined)]
        for entry in ready:
            del self.entries[entry.name]
            if entry.everyone:
                entry.members = self.sets[GLOBAL_SET]
                continue
            entry.members = self.sets.get(entry.first.process_set, ())
            entry.absent = frozenset(range(self.size)) - set(entry.requests)
            if not entry.members:
                entry.error = f"'{entry.name}': process set {entry.first.process_set} is not registered"
                continue
            entry.error = validate(entry, self.size)
            if not entry.error and 0 < len(entry.payloads) < len(entry.requests):
                entry.error = (f"'{entry.name}': ranks disagree on sending its data eagerly "
                               f"({EAGER_BYTES[0]} differs)")
        return ready + self._pop_siblings_of_failed_groups(ready)

    def _pop_siblings_of_failed_groups(self, ready: list[Entry]) -> list[Entry]:
        """The other tensors of a grouped op that failed (e.g. ranks grouped different numbers of tensors):
        they fail with it, on every rank, instead of waiting for ranks that will never submit them."""
        siblings = []
        for entry in ready:
            if not entry.error:
                continue
            sizes = {request.group_size for request in entry.requests.values()}
            if not max(sizes):
                continue
            base = entry.name.rpartition(".")[0]
            for index in range(max(sizes)):
                sibling = self.entries.pop(f"{base}.{index}", None)
                if sibling is not None:
                    sibling.absent = frozenset(range(self.size)) - set(sibling.requests)
                    sibling.error = f"{entry.error} (so '{sibling.name}' of the same group fails too)"
                    siblings.append(sibling)
        return siblings

    def awaited_ranks(self, entry: Entry) -> frozenset[int]:
        """The ranks ``entry`` still needs a request from (members of its set that neither requested it
        nor joined)."""
        members = self.sets.get(entry.first.process_set, ())
        joined = self.joined() if entry.first.process_set == GLOBAL_SET and entry.name != JOIN else frozenset()
        return frozenset(members) - set(entry.requests) - joined

    def deadlocked(self, waiting: dict[int, list[str]]) -> dict[int, list[Entry]]:
        """The ranks that can never go on, with the entries they wait for.

        ``waiting`` maps each rank blocked in a synchronous wait to the names it waits for. A blocked
        rank is stuck when each entry it waits for still needs a request from some rank that is
        itself stuck; the stuck ranks are the largest set closed under that rule (a rank that is
        computing, not waiting, may still submit, so it frees every rank that waits for it).
        """
        blocked = {rank: [self.entries[name] for name in names if name in self.entries]
                   for rank, names in waiting.items()}
        stuck = {rank for rank, entries in blocked.items() if entries and len(entries) == len(waiting[rank])}
        changed = True
        while changed:
            changed = False
            for rank in sorted(stuck):
                if any(not self.awaited_ranks(entry) or not self.awaited_ranks(entry) <= stuck
                       for entry in blocked[rank]):
                    stuck.discard(rank)
                    changed = True
        return {rank: blocked[rank] for rank in sorted(stuck)}

    def stalled(self, older_than_s: float) -> list[Entry]:
        """Incomplete entries waiting for longer than ``older_than_s``."""
        now = time.monotonic()
        return [entry for entry in self.entries.values() if now - entry.first_seen > older_than_s]


def fusable(entry: Entry) -> tuple | None:
    """The key shared by ops that may run as one fused buffer, or None: allreduces of one dtype, device, op,
    scaling and process set; on the device path also broadcasts of one root and allgathers (moved as bytes, any
    dtypes and shapes)."""
    request = entry.first
    if entry.error or entry.payloads:
        return None
    if request.kind == "allreduce":
        return (request.kind, request.dtype, request.device, request.op, request.prescale, request.postscale,
                request.process_set)
    if request.kind == "broadcast" and request.device != "cpu":
        return (request.kind, request.device, request.root, request.process_set)
    if request.kind == "allgather" and request.device != "cpu":
        return (request.kind, request.device, request.process_set)
    return None


def plan(ready: list[Entry], threshold_bytes: int) -> Iterator[list[Entry]]:
    """Group consecutive compatible ops (:func:`fusable`) up to ``threshold_bytes`` (grouped ops always together)."""
    batch: list[Entry] = []
    batch_bytes = 0
    if len(ready) == 1:
        yield ready
        return
    for entry in ready:
        key = fusable(entry)
        size = entry.first.nbytes
        same_group = bool(batch) and entry.first.group != 0 and entry.first.group == batch[-1].first.group
        fits = batch_bytes + size <= threshold_bytes or same_group
        if batch and key is not None and key == fusable(batch[0]) and fits:
            batch.append(entry)
            batch_bytes += size
            continue
        if batch:
            yield batch
        batch, batch_bytes = [entry], size
        if key is None:
            yield batch
            batch, batch_bytes = [], 0
    if batch:
        yield batch
