"""Latency-optimal collectives: each step pairs a member with one partner, log2(size) steps in all.

Members are numbered 0..size-1 (a group: the ranks of one local rank across hosts, say). With
``pof2`` the largest power of two not above ``size`` and ``rem = size - pof2``, the first ``2 rem``
members fold in pairs before the steps (MPICH's rule): an even one hands its data to the odd one
after it and sits out; the odd one and every member from ``2 rem`` on form the *core* of ``pof2``
members, whose core index is ``member // 2`` or ``member - rem``. Core members pair by XOR of their
core index (distance 1, 2, 4, ...); at the end each odd member hands the result back. So every
member talks to at most log2(size) + 1 partners, which :func:`partners` names (the links to open).

- Recursive doubling (:meth:`Pairwise.allreduce_doubling`): in each step partners swap their whole
  buffers and reduce; log2(size) steps of the full buffer, for small buffers.
- Recursive halving and doubling, Rabenseifner's (:meth:`Pairwise.allreduce_halving`): a reduce-scatter
  that halves the range each step, then an all-gather that doubles it back; 2 log2(size) steps carrying
  2 (pof2 - 1) / pof2 of the buffer, for medium buffers.
- Binomial broadcast and an all-gather of messages (each step swaps everything known so far).

Every reduction here is of two operands, a op b on one partner and b op a on the other, and the ops
are commutative, so every member ends with the same bits.
"""

from __future__ import annotations

import marshal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdrun.runtime.collectives.streams import (
    CopySink,
    ReduceSink,
    Sink,
    finish_swap,
    move,
    swap_message,
)
from hvdrun.runtime.compiled import StepLink, UniformSteps, step_links
from hvdrun.runtime.reduce import ReduceFn, as_bytes, chunk_bounds
from hvdrun.runtime.transport.channels import (
    DISCARD,
    MARSHAL,
    MERGE_LOWER,
    MERGE_UPPER,
    SEND_VALUE,
    TAKE_VALUE,
    Codec,
    DoublingStep,
    Message,
    RxChannel,
    StepsTaken,
    TxChannel,
    Waiter,
)


@dataclass(frozen=True)
class Link:
    """Both directions between this rank and one partner."""

    tx: TxChannel
    rx: RxChannel


def _fold(size: int) -> tuple[int, int]:
    pof2 = 1 << (size.bit_length() - 1)
    return pof2, size - pof2


def core_index(member: int, size: int) -> int | None:
    """``member``'s index in the core of a power of two, or None for an even member that folds out."""
    _, rem = _fold(size)
    if member < 2 * rem:
        return member // 2 if member % 2 else None
    return member - rem


def core_member(core: int, size: int) -> int:
    """The member whose core index is ``core``."""
    _, rem = _fold(size)
    return 2 * core + 1 if core < rem else core + rem


def partners(member: int, size: int) -> set[int]:
    """The members that ``member`` exchanges with in any algorithm of this module."""
    pof2, rem = _fold(size)
    found = {member ^ 1} if member < 2 * rem else set()
    core = core_index(member, size)
    if core is not None:
        mask = 1
        while mask < pof2:
            found.add(core_member(core ^ mask, size))
            mask <<= 1
    return found


class Pairwise:
    """Recursive doubling, Rabenseifner and binomial collectives among ``size`` members.

    Args:
        member: this rank's member index.
        size: number of members.
        links: member index -> the link to it, for every member of :func:`partners`.
        waiter: parks the thread when no link can move.
    """

    def __init__(self, member: int, size: int, links: Mapping[int, Link], waiter: Waiter,
                 compiled: UniformSteps | None = None) -> None:
        self.member, self.size, self.links, self.waiter = member, size, links, waiter
        self.compiled = compiled  # runs recursive doubling's core steps in one call (None: Python's loop)
        self.pof2, self.rem = _fold(size)
        self.core = core_index(member, size)
        self._nearest_first = self._core_partners() if self.core is not None else []
        self._merge_plan = self._plan_merge()
        self._doubling_steps = [DoublingStep(links[peer].tx, links[peer].rx, mode) for peer, mode in self._merge_plan]
        self._scratch = np.empty(0, np.uint8)  # reused: a fresh large buffer per op costs its page faults
        self._core_steps = [DoublingStep(links[peer].tx, links[peer].rx, MERGE_LOWER) for peer in self._nearest_first]
        self._core_links: tuple[StepLink, ...] | None = None  # their sockets, for the compiled doubling

    def _incoming(self, like: np.ndarray) -> np.ndarray:
        """A scratch array shaped like ``like`` (contents undefined), reused across collectives."""
        if self._scratch.nbytes < like.nbytes:
            self._scratch = np.empty(like.nbytes, np.uint8)
        return self._scratch[:like.nbytes].view(like.dtype)

    # -- point to point -----------------------------------------------------------------------------
    def _exchange(self, peer: int, send: np.ndarray | memoryview | None, sink: Sink | None) -> None:
        link = self.links[peer]
        parts = [] if send is None else [send if isinstance(send, memoryview) else as_bytes(send)]
        move(link.tx, link.rx, self.waiter, parts, sink)

    def _swap_message(self, peer: int, payload: Message) -> Message:
        link = self.links[peer]
        return swap_message(link.tx, link.rx, self.waiter, payload)

    def _core_partners(self, descending: bool = False) -> list[int]:
        """This core member's partner in each step (members), nearest first (or farthest first)."""
        assert self.core is not None
        masks = [1 << bit for bit in range(self.pof2.bit_length() - 1)]
        return [core_member(self.core ^ mask, self.size) for mask in (masks[::-1] if descending else masks)]

    def _fold_in(self, flat: np.ndarray, reduce: ReduceFn) -> None:
        if self.member < 2 * self.rem:
            if self.core is None:
                self._exchange(self.member + 1, flat, None)
            else:
                self._exchange(self.member - 1, None, ReduceSink(flat, reduce))

    def _fold_out(self, flat: np.ndarray) -> None:
        if self.member < 2 * self.rem:
            if self.core is None:
                self._exchange(self.member + 1, None, CopySink(as_bytes(flat)))
            else:
                self._exchange(self.member - 1, flat, None)

    # -- collectives --------------------------------------------------------------------------------
    def allreduce_doubling(self, flat: np.ndarray, reduce: ReduceFn) -> None:
        """Reduce the contiguous 1-D ``flat`` in place: every core step swaps the whole buffer."""
        if self.size == 1 or not flat.size:
            return
        self._fold_in(flat, reduce)
        if self.core is not None and not self._compiled_doubling(flat, reduce):
            incoming = self._incoming(flat)
            for peer in self._nearest_first:
                self._exchange(peer, flat, CopySink(as_bytes(incoming)))
                reduce(flat, incoming, out=flat)
        self._fold_out(flat)

    def _compiled_doubling(self, flat: np.ndarray, reduce: ReduceFn) -> bool:
        """The core steps of :meth:`allreduce_doubling` in one call of the compiled module, on the same wire; False
        where it cannot take them (not built, a type or reduction it has not, a link that is not a socket or has
        bytes staged): the Python loop runs them."""
        runner = self.compiled
        codes = runner.codes(flat.dtype, reduce) if runner is not None and self._nearest_first else None
        if codes is None or not flat.flags.c_contiguous:
            return False
        if any(step.rx.staged() for step in self._core_steps):
            return False
        self._core_links = self._core_links or step_links(self._core_steps)
        if self._core_links is None:
            return False
        assert runner is not None
        runner.reduce_in_place(flat, *codes, self._core_links, self.waiter)
        for step in self._core_steps:
            step.tx.bytes_sent += runner.frame_bytes(flat.nbytes)
        self.waiter.progressed()
        return True

    def allreduce_halving(self, flat: np.ndarray, reduce: ReduceFn) -> None:
        """Reduce the contiguous 1-D ``flat`` in place: recursive halving, then recursive doubling."""
        if self.size == 1 or not flat.size:
            return
        self._fold_in(flat, reduce)
        if self.core is not None:
            bounds = chunk_bounds(flat.size, self.pof2)
            incoming = self._incoming(flat)
            low, high, steps = 0, self.pof2, []
            for peer in self._core_partners(descending=True):
                middle = (low + high) // 2
                keep, give = ((low, middle), (middle, high)) if self.core < self._core_of(peer) \
                    else ((middle, high), (low, middle))
                (k0, k1), (g0, g1) = _elements(bounds, keep), _elements(bounds, give)
                self._exchange(peer, flat[g0:g1], CopySink(as_bytes(incoming[:k1 - k0])))
                reduce(flat[k0:k1], incoming[:k1 - k0], out=flat[k0:k1])
                steps.append((peer, (k0, k1), (g0, g1)))
                low, high = keep
            for peer, (k0, k1), (g0, g1) in reversed(steps):  # each step's kept range is reduced: swap them back
                self._exchange(peer, flat[k0:k1], CopySink(as_bytes(flat[g0:g1])))
        self._fold_out(flat)

    def _plan_merge(self) -> list[tuple[int, int]]:
        """:meth:`allgather_merged`'s steps: (partner, mode), MPICH's fold included (see the module docstring)."""
        folds = self.member < 2 * self.rem
        steps = [(self.member ^ 1, DISCARD if self.core is None else MERGE_UPPER)] if folds else []
        steps += [(peer, MERGE_LOWER if self.member < peer else MERGE_UPPER) for peer in self._nearest_first]
        if folds:
            steps.append((self.member + 1, TAKE_VALUE) if self.core is None else (self.member - 1, SEND_VALUE))
        return steps

    def _core_of(self, member: int) -> int:
        core = core_index(member, self.size)
        assert core is not None
        return core

    def broadcast(self, buffer: memoryview, root: int) -> None:
        """Copy member ``root``'s ``buffer`` to every member along a binomial tree (for small buffers)."""
        if self.size == 1 or not len(buffer):
            return
        root_core = core_index(root, self.size)
        served = {root}  # members that hold the data before the fold-out
        if root_core is None:  # a folded-out root hands its data to its core partner first
            served.add(root + 1)
            if self.member == root:
                self._exchange(root + 1, buffer, None)
            elif self.member == root + 1:
                self._exchange(root, None, CopySink(buffer))
            root_core = core_index(root + 1, self.size)
        assert root_core is not None
        if self.core is not None:
            relative = self.core ^ root_core
            for bit in range(self.pof2.bit_length() - 1):
                mask = 1 << bit
                peer = core_member(self.core ^ mask, self.size)
                if relative < mask:
                    self._exchange(peer, buffer, None)
                elif relative < 2 * mask:
                    self._exchange(peer, None, CopySink(buffer))
        if self.member < 2 * self.rem and not {self.member, self.member ^ 1} <= served:
            if self.core is None:
                self._exchange(self.member + 1, None, CopySink(buffer))
            else:
                self._exchange(self.member - 1, buffer, None)

    def allgather_messages(self, payload: Message) -> list[Message]:
        """Every member's ``payload``, by member index; each step swaps everything known so far.

        The fold is a swap too, so a member that folds out hears from its partner at once (a sleeping
        rank wakes on the first bytes of a cycle).
        """
        if self.size == 2:  # one swap, nothing to merge
            other = self._swap_message(1 - self.member, payload)
            return [payload, other] if self.member == 0 else [other, payload]
        known = {self.member: payload}
        if self.member < 2 * self.rem:
            known.update(marshal.loads(self._swap_message(self.member ^ 1, marshal.dumps(known))))
        for peer in self._nearest_first:
            known.update(marshal.loads(self._swap_message(peer, marshal.dumps(known))))
        if self.member < 2 * self.rem:
            if self.core is None:
                known = marshal.loads(self._swap_message(self.member + 1, b""))
            else:
                self._swap_message(self.member - 1, marshal.dumps(known))
        return [known[member] for member in range(self.size)]

    def allgather_merged(self, value: Any, merge: Callable[[Any, Any], Any], codec: Codec = MARSHAL) -> Any:
        """Every member's ``value`` merged in member order, ``merge(lower, upper)`` (values ``codec`` carries): each
        step swaps what a member holds, so a merge that keeps a value's size (a reduction) sends log2(size) messages
        of that size. Partners merge the same two values in the same order, so every member ends with the same bits.
        """
        if self.size == 1:
            return value
        taken = codec.steps(value, self._doubling_steps, self.waiter) if codec.steps is not None else None
        return self.resume_merged(taken or StepsTaken(value, 0, b"", b""), merge, codec)

    @property
    def doubling_steps(self) -> Sequence[DoublingStep]:
        """The steps of :meth:`allgather_merged`, for a codec (or a caller) that runs some of them itself."""
        return self._doubling_steps

    def resume_merged(self, taken: StepsTaken, merge: Callable[[Any, Any], Any], codec: Codec = MARSHAL) -> Any:
        """:meth:`allgather_merged` from where ``taken`` says another loop stopped: after ``taken.done`` steps (inside
        the next one when ``taken.received``, which this loop finishes)."""
        value, start = taken.value, taken.done
        if taken.received:
            value = self._merge_step(start, value, merge, codec, (taken.unsent, taken.received))
            start += 1
        for index in range(start, len(self._merge_plan)):
            value = self._merge_step(index, value, merge, codec)
        return value

    def _merge_step(self, index: int, value: Any, merge: Callable[[Any, Any], Any], codec: Codec,
                    begun: tuple[bytes, bytes] | None = None) -> Any:
        """Step ``index`` of :meth:`allgather_merged` (the fold's swaps too: a folded-out member's partner wakes at
        once); ``begun``: the step's frame left to send and the partner's received so far, where another loop began
        it."""
        peer, mode = self._merge_plan[index]
        message: Message
        if begun is not None:
            link = self.links[peer]
            message = finish_swap(link.tx, link.rx, self.waiter, *begun)
        else:
            message = self._swap_message(peer, b"" if mode == TAKE_VALUE else codec.dumps(value))
        if mode == MERGE_LOWER:
            return merge(value, codec.loads(message))
        if mode == MERGE_UPPER:
            return merge(codec.loads(message), value)
        return codec.loads(message) if mode == TAKE_VALUE else value  # DISCARD, SEND_VALUE: nothing comes back


def _elements(bounds: list[tuple[int, int]], chunks: tuple[int, int]) -> tuple[int, int]:
    """The element range of chunks ``chunks[0]`` up to ``chunks[1]`` (exclusive)."""
    return bounds[chunks[0]][0], bounds[chunks[1] - 1][1]
