"""Collective algorithms over channels between ranks.

The ring, over a pair of channels (``tx`` to the next rank, ``rx`` from the previous one): the
algorithm for large buffers, and the one every job has (its negotiation and alltoall run on it).

The ring's allreduce is a reduce-scatter followed by an all-gather. The buffer is cut into N chunks
(sizes differ by at most one element). Worked example with 4 ranks, chunks a b c d, and
``x+`` meaning "partially reduced"::

    reduce-scatter step s: rank r sends chunk (r - s), receives and reduces chunk (r - s - 1)
      step 0: r0 sends a, r1 sends b, r2 sends c, r3 sends d
      step 1: r0 sends d+ (got from r3), r1 sends a+, r2 sends b+, r3 sends c+
      step 2: r0 sends c+, r1 sends d+, r2 sends a+, r3 sends b+
      -> rank r owns the fully reduced chunk (r + 1): r0 b, r1 c, r2 d, r3 a
    all-gather step s: rank r sends chunk (r + 1 - s), receives chunk (r - s)
      -> after 3 steps every rank holds every reduced chunk.

Each rank sends 2 (N - 1) chunks, i.e. 2 (N - 1) / N of the buffer, and in every step it
sends and receives at the same time (one loop drives both directions, in segments, so the
receive of one segment overlaps the send of the next and no rank can block its neighbour).
Transfers are padded to a multiple of 8 bytes so elements never straddle a ring buffer's end.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hvdrun.runtime.collectives.streams import (
    SEGMENT_BYTES,
    ZEROS,
    ChainSink,
    CopySink,
    ReduceSink,
    Sink,
    move,
    swap_message,
)
from hvdrun.runtime.reduce import ReduceFn, as_bytes, chunk_bounds
from hvdrun.runtime.transport.channels import Message, RxChannel, TxChannel, Waiter


class Ring:
    """Collectives among ``size`` ranks connected in a ring.

    Args:
        rank: this rank's position.
        size: number of ranks.
        tx: channel to rank ``(rank + 1) % size``.
        rx: channel from rank ``(rank - 1) % size``.
        waiter: parks the thread when neither channel can move.
    """

    def __init__(self, rank: int, size: int, tx: TxChannel | None, rx: RxChannel | None, waiter: Waiter) -> None:
        self.rank, self.size, self.tx, self.rx, self.waiter = rank, size, tx, rx, waiter

    # -- the progress loop ---------------------------------------------------------------
    def transfer(self, parts: Sequence[memoryview], sink: Sink | None) -> None:
        """Send ``parts`` (padded to 8 bytes) to the next rank while ``sink`` takes what the previous sends."""
        assert self.tx is not None and self.rx is not None
        move(self.tx, self.rx, self.waiter, parts, sink)

    def _chunk(self, flat: np.ndarray, bounds: list[tuple[int, int]], index: int) -> np.ndarray:
        start, stop = bounds[index % self.size]
        return flat[start:stop]

    # -- collectives -----------------------------------------------------------------------
    def reduce_scatter(self, flat: np.ndarray, reduce: ReduceFn, bounds: list[tuple[int, int]], shift: int) -> None:
        """Ring reduce-scatter; afterwards rank r owns the reduced chunk ``r + 1 - shift``."""
        r = self.rank
        for step in range(self.size - 1):
            send = self._chunk(flat, bounds, r - step - shift)
            recv = self._chunk(flat, bounds, r - step - 1 - shift)
            self.transfer([as_bytes(send)], ReduceSink(recv, reduce))

    def all_gather_chunks(self, flat: np.ndarray, bounds: list[tuple[int, int]]) -> None:
        """Ring all-gather where rank r starts with chunk ``r + 1`` (the state after reduce_scatter)."""
        r = self.rank
        for step in range(self.size - 1):
            send = self._chunk(flat, bounds, r + 1 - step)
            recv = self._chunk(flat, bounds, r - step)
            self.transfer([as_bytes(send)], CopySink(as_bytes(recv)))

    def allreduce(self, array: np.ndarray, reduce: ReduceFn) -> None:
        """Reduce ``array`` (contiguous) in place across all ranks."""
        if self.size == 1 or array.size == 0:
            return
        flat = array.reshape(-1)
        bounds = chunk_bounds(flat.size, self.size)
        self.reduce_scatter(flat, reduce, bounds, shift=0)
        self.all_gather_chunks(flat, bounds)

    def reducescatter(self, array: np.ndarray, reduce: ReduceFn, bounds: list[tuple[int, int]]) -> None:
        """Reduce in place; afterwards only chunk ``rank`` (element ``bounds``) is valid on this rank."""
        if self.size > 1 and array.size:
            self.reduce_scatter(array.reshape(-1), reduce, bounds, shift=1)

    def allgatherv(self, out: memoryview, sizes: Sequence[int]) -> None:
        """``out`` holds this rank's block at its offset; fill in every other rank's block (byte sizes)."""
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
        self.allgather_blocks([[out[offsets[i]:offsets[i + 1]]] for i in range(self.size)])

    def allgather_blocks(self, blocks: Sequence[Sequence[memoryview]]) -> None:
        """``blocks[i]``: the parts that member i owns (this rank's are filled in); fill in everyone's."""
        for step in range(self.size - 1):
            send, receive = blocks[(self.rank - step) % self.size], blocks[(self.rank - step - 1) % self.size]
            self.transfer(send, ChainSink([CopySink(part) for part in receive]))

    def reduce_scatter_blocks(self, flat: np.ndarray, blocks: Sequence[Sequence[tuple[int, int]]],
                              reduce: ReduceFn) -> None:
        """Reduce in place; afterwards the element ranges ``blocks[rank]`` are reduced over every member."""
        for step in range(self.size - 1):
            send = blocks[(self.rank - step - 1) % self.size]
            receive = blocks[(self.rank - step - 2) % self.size]
            self.transfer([as_bytes(flat[a:b]) for a, b in send],
                          ChainSink([ReduceSink(flat[a:b], reduce) for a, b in receive]))

    def broadcast(self, buffer: memoryview, root: int) -> None:
        """Copy ``buffer`` of rank ``root`` to every rank, relayed around the ring in segments."""
        if self.size == 1 or not len(buffer):
            return
        last = (root - 1) % self.size  # the rank that does not forward
        if self.rank == root:
            self.transfer([buffer], None)
            return
        sink = CopySink(buffer)
        if self.rank == last:
            self.transfer([], sink)
            return
        self._relay(buffer, sink)

    def _relay(self, buffer: memoryview, sink: CopySink) -> None:
        """Receive into ``buffer`` and forward every byte already received, at the same time."""
        tx, rx, waiter = self.tx, self.rx, self.waiter
        assert tx is not None and rx is not None
        forwarded, total = 0, sink.total
        while forwarded < total:
            moved = not sink.done and sink.pull(rx) > 0
            available = min(sink.received, len(buffer))
            if forwarded < available:
                sent = tx.send_some(buffer[forwarded:min(available, forwarded + SEGMENT_BYTES)])
            elif forwarded < sink.received:  # padding
                sent = tx.send_some(ZEROS[:sink.received - forwarded])
            else:
                sent = 0
            forwarded += sent
            if moved or sent:
                waiter.progressed()
            else:
                waiter.idle((rx,) if forwarded >= sink.received and not sink.done else (tx, rx))

    def alltoallv(self, send: memoryview, send_sizes: Sequence[int], matrix: Sequence[Sequence[int]],
                  out: memoryview) -> None:
        """Every rank sends ``send_sizes[j]`` bytes to rank j; ``matrix[i][j]`` are all ranks' sizes.

        Blocks are relayed: in step s, rank r passes on the blocks that rank ``r - s + 1``
        sent to ranks ``r + 1 .. r - s``, keeping the first one (its own) as it arrives.
        ``out`` receives every block addressed to this rank, in source-rank order.
        """
        n, r = self.size, self.rank
        out_offsets = np.concatenate([[0], np.cumsum([matrix[i][r] for i in range(n)])]).astype(int).tolist()
        send_offsets = np.concatenate([[0], np.cumsum(send_sizes)]).astype(int).tolist()
        out[out_offsets[r]:out_offsets[r + 1]] = send[send_offsets[r]:send_offsets[r + 1]]
        carried = [send[send_offsets[(r + k) % n]:send_offsets[(r + k) % n + 1]] for k in range(1, n)]
        for step in range(1, n):
            origin = (r - step) % n  # the blocks arriving now were sent by this rank
            sizes = [matrix[origin][(r + k) % n] for k in range(n - step)]
            incoming = bytearray(sum(sizes))
            self.transfer(carried, CopySink(memoryview(incoming)))
            view = memoryview(incoming)
            out[out_offsets[origin]:out_offsets[origin + 1]] = view[:sizes[0]]
            carried, start = [], sizes[0]
            for size in sizes[1:]:
                carried.append(view[start:start + size])
                start += size

    def allgather_messages(self, payload: Message) -> list[Message]:
        """Every rank's ``payload``, indexed by rank."""
        messages: list[Message] = [b""] * self.size
        messages[self.rank] = payload
        tx, rx = self.tx, self.rx
        for step in range(self.size - 1):
            assert tx is not None and rx is not None
            outgoing = messages[(self.rank - step) % self.size]
            messages[(self.rank - step - 1) % self.size] = swap_message(tx, rx, self.waiter, outgoing)
        return messages
