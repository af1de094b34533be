"""A host's post board: in each round, every rank of a host posts one message and reads every rank's.

The local half of the hierarchy's merged exchange (which carries every negotiation cycle of a job across
hosts, see :meth:`~hvdrun.runtime.collectives.hierarchical.Hierarchy.allgather_merged`): one post and one wait,
where the host's ring took L - 1 hops in a row (11 on a host of 12 ranks).

One file per host in ``/dev/shm``, created by the host's first rank before the set-up barrier, opened by
the others after it and unlinked once all have it (named after the first rank, whose guard removes it if
the job dies first). A slot per rank::

    word 0   round      the last round this rank posted (published after its message)
    word 1   length of its message in round parity 0  (TOO_LONG: it did not fit; that round takes the ring)
    word 2   length of its message in round parity 1
    word 3   sleeping   the owner sleeps in select(): posters ring its bell (a FIFO per rank)
    then two buffers of SLOT_BYTES, one per round parity

A rank posts round r + 1 only after it has read every post of round r, and every rank posted round r before
any rank can finish it, so a buffer is never written while a rank still reads it (round r + 1 writes the
other parity; round r + 2 waits for every rank's post of r + 1). Counters are 8-byte words written with
single stores, which x86-64 keeps in order (as the shared-memory rings, :mod:`.shm`).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from hvdrun.runtime.transport.channels import Doorbell, Message, fence
from hvdrun.runtime.transport.shmfile import map_shared, shm_file, unlink_names

SLOT_BYTES = 256 << 10  # one post; a longer message takes the host's ring in that round, on every rank
TOO_LONG = -1
_ROUND, _LENGTHS, _SLEEPING = 0, 1, 3  # word indices of a slot's header
_HEADER = 64  # bytes


def board_path(job_key: str, first_rank: int) -> Path:
    """``/dev/shm/hvdrun-JOB-GEN-FIRST.posts``, named after the host's first rank, which creates it."""
    return shm_file(job_key, first_rank, ".posts")


class PostBoard:
    """The post board of one host, as one of its ranks sees it.

    Args:
        job_key: the job and init() generation (``JOB-GEN``).
        first_rank: the host's first rank (creates the board and names it).
        members: ranks on the host.
        index: this rank's place among them (its local rank).
        create: make the board (the first rank, before the others open it).
    """

    def __init__(self, job_key: str, first_rank: int, members: int, index: int, create: bool) -> None:
        self.path, self.members, self.index = board_path(job_key, first_rank), members, index
        self.bell_paths = [self.path.with_name(f"{self.path.name}-bell{m}") for m in range(members)]
        stride = _HEADER + 2 * SLOT_BYTES
        self.map, self._bell_fds = map_shared(self.path, self.bell_paths, members * stride, create)
        view = memoryview(self.map)
        self.words = [view[m * stride:m * stride + _HEADER].cast("q") for m in range(members)]
        self.buffers = [[view[m * stride + _HEADER + p * SLOT_BYTES:m * stride + _HEADER + (p + 1) * SLOT_BYTES]
                         for p in (0, 1)] for m in range(members)]
        self.bells = [Doorbell(fd, words[_SLEEPING:_SLEEPING + 1]) for fd, words in zip(self._bell_fds, self.words,
                                                                                        strict=True)]
        self.round = 0
        self.too_long = 0  # rounds that took the ring (tests read it)
        self.complete = BoardWatch(self, ahead=False)  # every rank posted this rank's round
        self.arrivals = BoardWatch(self, ahead=True)  # a rank posted a round this rank has not

    @property
    def own_bell(self) -> Doorbell:
        """This rank's bell: its waiter sleeps on it, posters ring it."""
        return self.bells[self.index]

    def post(self, message: Message) -> None:
        """Post this rank's message of the next round (its length only, as TOO_LONG, when it does not fit) and
        wake the ranks that sleep."""
        self.round += 1
        me, parity = self.words[self.index], self.round & 1
        if len(message) <= SLOT_BYTES:
            self.buffers[self.index][parity][:len(message)] = message
            me[_LENGTHS + parity] = len(message)
        else:
            me[_LENGTHS + parity] = TOO_LONG
        fence()
        me[_ROUND] = self.round
        for member, bell in enumerate(self.bells):
            if member != self.index:
                bell.ring()

    def posted(self) -> bool:
        """Whether every rank has posted this rank's current round."""
        r = self.round
        return all(words[_ROUND] >= r for words in self.words)

    def all_fit(self) -> bool:
        """Whether every rank's message of the current round fitted its post (alike on every rank: each sees every
        length; a round that did not is counted in ``too_long``). Call once :meth:`posted` is true."""
        parity = self.round & 1
        if any(words[_LENGTHS + parity] == TOO_LONG for words in self.words):
            self.too_long += 1
            return False
        return True

    def messages(self, own: Message) -> list[Message] | None:
        """Every rank's message of the current round (copied, ``own`` as this rank's), by local rank; None when
        one did not fit (:meth:`all_fit`). Call once :meth:`posted` is true."""
        return self.copies(own) if self.all_fit() else None

    def copies(self, own: Message) -> list[Message]:
        """Every rank's message of the current round, copied (``own`` as this rank's), by local rank: a round where
        :meth:`all_fit`."""
        return [own if member == self.index else bytes(post) for member, post in enumerate(self.views())]

    def views(self) -> list[memoryview]:
        """Every rank's post of the current round, in place (no copy), by local rank: valid until this rank posts
        its next round (a rank overwrites a buffer two rounds on, after every rank posted the round between). Call
        once :meth:`posted` is true, in a round whose posts all fitted (a collective's data, of a size every rank
        of the host shares)."""
        parity = self.round & 1
        return [self.buffers[member][parity][:words[_LENGTHS + parity]] for member, words in enumerate(self.words)]

    def addresses(self) -> tuple[list[int], list[int]]:
        """Where the board lies in this process's memory, for the compiled module: each member's header words, and
        each member's post buffers (parity 0, then 1). Valid while the board is open."""
        anchor = ctypes.c_char.from_buffer(self.map)  # an export of the map, released as it goes
        base = ctypes.addressof(anchor)
        del anchor
        stride = _HEADER + 2 * SLOT_BYTES
        words = [base + member * stride for member in range(self.members)]
        return words, [address + _HEADER + parity * SLOT_BYTES for address in words for parity in (0, 1)]

    @property
    def bell_fds(self) -> list[int]:
        """Each member's bell (its FIFO), by local rank."""
        return list(self._bell_fds)

    def unlink(self) -> None:
        """Remove the names once every rank of the host has opened the board (mappings stay valid)."""
        unlink_names(self.path, *self.bell_paths)

    def close(self) -> None:
        """Release the views, close the bells and unmap (the map is left to the garbage collector while views
        remain)."""
        try:
            for bell in self.bells:
                bell.sleeping.release()  # type: ignore[attr-defined]
            for words in self.words:
                words.release()
            for pair in self.buffers:
                for buffer in pair:
                    buffer.release()
            self.map.close()
        except BufferError:
            pass
        for fd in self._bell_fds:
            os.close(fd)
        self._bell_fds = []


class BoardWatch:
    """What a waiter watches on a board (``ready()`` and the fds to sleep on, as a channel): every post of this
    rank's round (``ahead=False``), or a post of a round this rank has not started (``ahead=True``: a peer began a
    cycle, so the engine of this rank joins it)."""

    def __init__(self, board: PostBoard, ahead: bool) -> None:
        self.board, self.ahead = board, ahead

    def ready(self) -> bool:
        board = self.board
        if self.ahead:
            r = board.round
            return any(words[_ROUND] > r for words in board.words)
        return board.posted()

    def wait_fds(self) -> tuple[list[int], list[int]]:
        return [self.board.own_bell.fd], []
