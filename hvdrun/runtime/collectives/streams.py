"""Byte streams between two ranks: what a transfer sends, the sinks that take what it receives, and the
progress loop that moves both directions at once.

Every algorithm in this package is a sequence of transfers: send some parts to one peer while a
sink consumes what another (or the same) peer sends. Transfers are padded to a multiple of 8 bytes
so elements never straddle a shared-memory ring's end.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from hvdrun.runtime.reduce import ReduceFn, padded
from hvdrun.runtime.transport.channels import Message, RxChannel, TxChannel, Waiter

SEGMENT_BYTES = 1 << 19
# larger messages go through move() into one buffer (swap_small() receives into one buffer too, allocated once the
# length is known: a 64 KiB eager allreduce across 2 hosts took 42 us through it, 70 us through move())
SMALL_MESSAGE_BYTES = 256 << 10
ZEROS = memoryview(bytes(8))
_WHOLE_PEEK = SMALL_MESSAGE_BYTES + 16  # a small message with its length and padding
_LENGTH = struct.Struct("<Q")


class Sink:
    """Consumes a received transfer of known padded length."""

    def __init__(self, length: int) -> None:
        self.length, self.total, self.received = length, padded(length), 0

    @property
    def done(self) -> bool:
        """True when the whole transfer, padding included, was consumed."""
        return self.received >= self.total

    def accept(self, view: memoryview) -> int:
        """Use some of ``view``; return how many bytes were consumed."""
        if self.received >= self.length:  # padding
            count = min(len(view), self.total - self.received)
        else:
            count = self._take(view[:self.length - self.received])
        self.received += count
        return count

    def _take(self, view: memoryview) -> int:
        raise NotImplementedError

    def pull(self, rx: RxChannel) -> int:
        """Take what ``rx`` has now; return how many bytes were consumed."""
        view = rx.peek(SEGMENT_BYTES)
        used = self.accept(view) if len(view) else 0
        if used:
            rx.consume(used)
        return used


class CopySink(Sink):
    """Copies the payload into ``dst``."""

    def __init__(self, dst: memoryview) -> None:
        super().__init__(len(dst))
        self.dst = dst

    def _take(self, view: memoryview) -> int:
        self.dst[self.received:self.received + len(view)] = view
        return len(view)

    def pull(self, rx: RxChannel) -> int:
        if self.received >= self.length:  # padding
            return super().pull(rx)
        count = rx.read_into(self.dst[self.received:])  # from the socket straight into place where it can
        self.received += count
        return count


class ReduceSink(Sink):
    """Reduces the payload element-wise into ``dst`` with ``reduce(dst, incoming, out=dst)``."""

    def __init__(self, dst: np.ndarray, reduce: ReduceFn) -> None:
        super().__init__(dst.nbytes)
        self.dst, self.reduce, self.itemsize = dst, reduce, dst.itemsize

    def _take(self, view: memoryview) -> int:
        count = len(view) - len(view) % self.itemsize
        if count:
            first = self.received // self.itemsize
            target = self.dst[first:first + count // self.itemsize]
            self.reduce(target, np.frombuffer(view[:count], dtype=self.dst.dtype), out=target)
        return count


class ChainSink(Sink):
    """Takes one transfer into several sinks in turn (their parts arrive back to back, unpadded)."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        super().__init__(sum(sink.length for sink in sinks))
        self.sinks, self.index = [sink for sink in sinks if sink.length], 0

    def _take(self, view: memoryview) -> int:
        used = 0
        while used < len(view) and self.index < len(self.sinks):
            sink = self.sinks[self.index]
            count = sink._take(view[used:used + sink.length - sink.received])
            if not count:
                break  # a partial element: wait for the rest of it
            sink.received += count
            used += count
            if sink.received == sink.length:
                self.index += 1
        return used


class MessageSink(Sink):
    """Receives ``length (8 bytes) + payload`` whose size is learnt from the header."""

    def __init__(self) -> None:
        super().__init__(_LENGTH.size)
        self.payload: bytearray | None = None

    def _take(self, view: memoryview) -> int:
        if self.payload is None:
            if len(view) < _LENGTH.size:
                return 0
            (size,) = _LENGTH.unpack(view[:_LENGTH.size])
            self.payload = bytearray(size)
            self.length, self.total = _LENGTH.size + size, padded(_LENGTH.size + size)
            return _LENGTH.size
        offset = self.received - _LENGTH.size
        self.payload[offset:offset + len(view)] = view
        return len(view)


def message_parts(payload: Message) -> list[memoryview]:
    """The parts that send ``payload`` as a message: its length, then the payload (small ones as one part)."""
    header = _LENGTH.pack(len(payload))
    if len(payload) <= SEGMENT_BYTES // 8:
        return [memoryview(header + bytes(payload))]
    return [memoryview(header), memoryview(payload)]


def move(tx: TxChannel, rx: RxChannel, waiter: Waiter, parts: Sequence[memoryview], sink: Sink | None) -> None:
    """Send ``parts`` (padded to 8 bytes) on ``tx`` while ``sink`` takes what arrives on ``rx``; one loop drives
    both directions in segments, so the receive of one segment overlaps the send of the next."""
    pad = padded(sum(len(p) for p in parts)) - sum(len(p) for p in parts)
    queue = [p for p in parts if len(p)] + ([ZEROS[:pad]] if pad else [])
    index, offset = 0, 0
    while index < len(queue) or (sink is not None and not sink.done):
        moved = False
        if index < len(queue):
            part = queue[index]
            sent = tx.send_some(part[offset:offset + SEGMENT_BYTES])
            if sent:
                moved, offset = True, offset + sent
                if offset == len(part):
                    index, offset = index + 1, 0
        if sink is not None and not sink.done and sink.pull(rx):
            moved = True
        if moved:
            waiter.progressed()
        else:  # wait only on the directions still in use
            sending, receiving = index < len(queue), sink is not None and not sink.done
            waiter.idle((tx, rx) if sending and receiving else (tx,) if sending else (rx,))


def swap_message(tx: TxChannel, rx: RxChannel, waiter: Waiter, payload: Message) -> memoryview:
    """Send ``payload`` on ``tx`` and receive the peer's message from ``rx`` (lengths may differ): small ones in
    :func:`swap_small`'s lean loop, larger ones through :func:`move` into one buffer. The message comes back as a
    view of a buffer of its own (no copy to bytes: marshal and numpy read views)."""
    if len(payload) <= SMALL_MESSAGE_BYTES:
        return swap_small(tx, rx, waiter, payload)
    sink = MessageSink()
    move(tx, rx, waiter, message_parts(payload), sink)
    assert sink.payload is not None
    return memoryview(sink.payload)


def swap_small(tx: TxChannel, rx: RxChannel, waiter: Waiter, payload: Message) -> memoryview:
    """Send a small message on ``tx`` and receive one from ``rx``: a lean loop for the latency-bound case."""
    length = len(payload)
    outgoing = memoryview(_LENGTH.pack(length) + payload + ZEROS[:padded(length) - length])
    sent = tx.send_some(outgoing)  # usually the whole message at once
    outgoing = outgoing[sent:]
    while True:  # usually the peer's whole message arrives in one piece: take it from the channel's view at once
        view = rx.peek(_WHOLE_PEEK)
        if len(view) >= 8:
            (size,) = _LENGTH.unpack_from(view)
            if len(view) < 8 + padded(size):
                break
            message = bytes(view[8:8 + size])
            rx.consume(8 + padded(size))
            waiter.progressed()
            while outgoing:
                outgoing = _push(tx, rx, waiter, outgoing, False)
            return memoryview(message)
        if len(view):
            break  # a part of the length: the loop below puts the pieces together
        outgoing = _push(tx, rx, waiter, outgoing, False)
    return _receive_rest(tx, rx, waiter, outgoing, bytearray(8), 0)


def finish_swap(tx: TxChannel, rx: RxChannel, waiter: Waiter, unsent: bytes, received: bytes) -> memoryview:
    """Finish a swap that another loop began (the compiled steps, :mod:`hvdrun.runtime.compiled`): send ``unsent``,
    the rest of this rank's frame, and receive the rest of the peer's, of which ``received`` came (its length at
    least); the peer's message."""
    return _receive_rest(tx, rx, waiter, memoryview(unsent), bytearray(received), len(received))


def _receive_rest(tx: TxChannel, rx: RxChannel, waiter: Waiter, outgoing: memoryview, received: bytearray,
                  have: int) -> memoryview:
    """Receive the peer's frame into ``received`` (its first ``have`` bytes there: the length first, then the whole
    padded message) while sending ``outgoing``; the message."""
    need, size = 8, -1
    while True:
        if size < 0 and have >= 8:  # the length came (before the call, or in the last turn): room for the frame
            (size,), need = _LENGTH.unpack_from(received), frame_length(received)
            received += bytes(need - len(received))
        if have >= need and not outgoing:
            return memoryview(received)[8:8 + size]
        got = 0
        if have < need:
            view = rx.peek(need - have)
            got = len(view)
            if got:
                received[have:have + got] = view
                rx.consume(got)
                have += got
        outgoing = _push(tx, rx, waiter, outgoing, bool(got))


def frame_length(start: Message | bytearray) -> int:
    """A frame's whole length (its 8-byte length, the message, the padding), read from its first 8 bytes or more."""
    return 8 + padded(_LENGTH.unpack_from(start)[0])


def _push(tx: TxChannel, rx: RxChannel, waiter: Waiter, outgoing: memoryview, received: bool) -> memoryview:
    """One turn of :func:`swap_small`'s loop after receiving (``received``: bytes came): send more, or wait."""
    if outgoing and (sent := tx.send_some(outgoing)):
        outgoing, received = outgoing[sent:], True
    if received:
        waiter.progressed()
    else:
        waiter.idle((tx, rx) if outgoing else (rx,))
    return outgoing
