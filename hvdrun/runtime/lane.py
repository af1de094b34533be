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

Board layout: one slot per rank (header words, then two data buffers used by attempt parity);
rank 0's header also holds the verdict count and a ring of the last verdicts. A buffer is reused
two attempts later, and only once every rank finished reading the attempt that used it last.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hvdrun import envvars
from hvdrun.errors import CollectiveError
from hvdrun.runtime.executors import scale
from hvdrun.runtime.negotiation import AVERAGE, GLOBAL_SET, MAX, MIN, PRODUCT, REDUCE_FNS, SUM, Request
from hvdrun.runtime.transport.base import AbortFlag, fence

CAPACITY = 64 << 10  # bytes of one post: larger allreduces are the ring's
_HEADER_WORDS = 128
_POST, _SIG, _WITHDRAW, _DONE = 0, 1, 2, 3  # header words of every slot
_COUNT, _ENGINE_WAIT = 4, 5  # rank 0's: verdicts issued; 1 while rank 0 waits in the engine's path
_VERDICTS, _HISTORY = 16, 64  # rank 0: verdicts[g % 64] at words 16..79
_GO, _ABORT = 1, 2
_SLOT_BYTES = _HEADER_WORDS * 8 + 2 * CAPACITY
_SPIN_BEFORE_YIELD = 200
# a rank that waits this long for the others leaves the lane (through the verdict): a late rank, a stall
# or a deadlock is then the engine's to handle, with its warnings, probes and errors
WITHDRAW_AFTER_S = 0.02
LANE_OPS = (SUM, AVERAGE, MIN, MAX, PRODUCT)


def lane_enabled() -> bool:
    """``HVDRUN_FAST_LANE=0`` keeps every op on the engine's path (for comparisons)."""
    return os.environ.get(envvars.FAST_LANE, "1") != "0"


def suits_lane(request: Request, array: np.ndarray | None) -> bool:
    """A dense CPU allreduce of the whole job, small enough for a post (what the op itself decides)."""
    return (array is not None and request.kind == "allreduce" and request.device == "cpu"
            and request.process_set == GLOBAL_SET and request.group_size == 0 and request.op in LANE_OPS
            and 0 < array.nbytes <= CAPACITY and array.flags.c_contiguous)


def board_path(job_key: str) -> Path:
    """``/dev/shm/hvdrun-JOB-GEN-0.lane``: a file of rank 0, which creates it, so rank 0's guard removes it
    even when the launcher is killed."""
    return Path(envvars.shm_segment_base(job_key, 0) + ".lane")


class Board:
    """The shared board of one job generation; rank 0 creates it, the others open it."""

    def __init__(self, job_key: str, size: int, create: bool) -> None:
        self.path, self.bell_path = board_path(job_key), board_path(job_key).with_suffix(".lanebell")
        length = size * _SLOT_BYTES
        if create:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, length)
            os.mkfifo(self.bell_path, 0o600)
        else:
            fd = os.open(self.path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, length)
        finally:
            os.close(fd)
        self.bell_fd = os.open(self.bell_path, os.O_RDWR | os.O_NONBLOCK)
        self.words = [memoryview(self.map)[r * _SLOT_BYTES:r * _SLOT_BYTES + _HEADER_WORDS * 8].cast("q")
                      for r in range(size)]
        self.buffers = [[np.frombuffer(self.map, np.uint8, CAPACITY, r * _SLOT_BYTES + _HEADER_WORDS * 8 + p * CAPACITY)
                         for p in (0, 1)] for r in range(size)]

    def unlink(self) -> None:
        """Remove the names once every rank has mapped the board."""
        self.path.unlink(missing_ok=True)
        self.bell_path.unlink(missing_ok=True)

    def close(self) -> None:
        """Unmap (left to the garbage collector while views remain)."""
        os.close(self.bell_fd)
        for words in self.words:
            words.release()
        self.words, self.buffers = [], []
        try:
            self.map.close()
        except BufferError:
            pass


def signature(request: Request, nbytes: int) -> int:
    """What every rank's post must agree on, as one number (never 0)."""
    text = f"{request.name}|{request.dtype}|{nbytes}|{request.op}|{request.prescale}|{request.postscale}"
    return zlib.crc32(text.encode()) + 1


class FastLane:
    """One rank's side of the board.

    Args:
        board: the mapped board.
        rank: this rank; rank 0 writes the verdicts.
        size: ranks in the job (all on this host).
        abort: the job's failure flag (a dead peer ends every wait).
    """

    def __init__(self, board: Board, rank: int, size: int, abort: AbortFlag) -> None:
        self.board, self.rank, self.size, self.abort = board, rank, size, abort
        self.me = board.words[rank]
        self.head = board.words[0]
        self._decide = threading.Lock()  # rank 0: one verdict at a time, from any thread
        self._signatures: dict[tuple[Request, int], int] = {}
        self._views: dict[tuple[int, str, int], list[np.ndarray]] = {}  # (parity, dtype, bytes) -> every post
        self._readers_done_to = 0  # every rank has finished reading attempts below this
        self.used = 0  # attempts that went through (tests read it)
        self.stall_warning_s, self.stall_error_s = math.inf, 0.0  # the engine's settings (configure())

    def configure(self, stall_warning_s: float, stall_error_s: float) -> None:
        """The engine's stall settings: a rank waiting on rank 0 that never comes warns, then fails."""
        self.stall_warning_s, self.stall_error_s = stall_warning_s, stall_error_s

    # -- a rank's attempt -----------------------------------------------------------------------
    def allreduce(self, request: Request, array: np.ndarray, engine_busy: Callable[[], bool]) -> bool:
        """Try ``request`` on the board; True when ``array`` holds the result, False: take the engine's path.

        ``engine_busy()`` says whether a peer used the engine since this attempt began.
        """
        g = self.head[_COUNT]
        parity = g % 2
        self._wait_buffer_free(g)
        flat = array.reshape(-1).view(np.uint8)
        mine = self.board.buffers[self.rank][parity][:flat.size]
        mine[:] = flat
        if request.prescale != 1.0:
            scale(mine.view(array.dtype), request.prescale)
        key = (request, flat.size)
        sig = self._signatures.get(key)
        if sig is None:
            sig = self._signatures[key] = signature(request, flat.size)
            if len(self._signatures) > 4096:
                self._signatures.clear()
        self.me[_SIG] = sig
        fence()
        self.me[_POST] = g + 1
        self._ring_coordinator()
        verdict = self._await_verdict(g, request.name, engine_busy)
        if verdict == _GO:
            self._reduce(request, array, parity, flat.size)
            self.used += 1
        fence()
        self.me[_DONE] = g + 1
        return verdict == _GO

    def _wait_buffer_free(self, g: int) -> None:
        """Attempt ``g`` reuses the buffers of attempt ``g - 2``: wait until every reader of it is done."""
        if g < 2 or self._readers_done_to >= g - 1 or self._verdict(g - 2) != _GO:
            return
        spins = 0
        while any(words[_DONE] < g - 1 for words in self.board.words):
            spins = self._pause(spins)
        self._readers_done_to = min(words[_DONE] for words in self.board.words)

    def _await_verdict(self, g: int, name: str, engine_busy: Callable[[], bool]) -> int:
        spins, withdrawn, warned = 0, False, False
        started = time.monotonic()
        while True:
            waited = time.monotonic() - started if spins % 64 == 63 else 0.0
            leave = engine_busy() or waited > WITHDRAW_AFTER_S
            if self.rank == 0:
                self._judge(g, own_post=True, engine_seen=leave)
            elif leave and not withdrawn:
                self.me[_WITHDRAW] = g + 1  # ask rank 0 to abort; the verdict still decides
                withdrawn = True
                self._ring_coordinator()
            if self.head[_COUNT] > g:
                return self._verdict(g)
            if waited > self.stall_warning_s and not warned:
                warned = True
                print(f"hvdrun: warning: '{name}' has waited more than {self.stall_warning_s:g} s for rank 0",
                      file=sys.stderr, flush=True)
            if self.stall_error_s and waited > self.stall_error_s:
                raise CollectiveError(f"stalled: '{name}' waited more than {self.stall_error_s:g} s for rank 0, "
                                      "which never reached it")
            spins = self._pause(spins)

    def _pause(self, spins: int) -> int:
        self.abort.check()
        if spins >= _SPIN_BEFORE_YIELD:
            os.sched_yield()
        return spins + 1

    def _reduce(self, request: Request, array: np.ndarray, parity: int, nbytes: int) -> None:
        """Everyone's posts, combined in rank order (identical bits on every rank), into ``array``."""
        dtype, out = array.dtype, array.reshape(-1)
        key = (parity, dtype.str, nbytes)
        posts = self._views.get(key)
        if posts is None:
            posts = self._views[key] = [self.board.buffers[r][parity][:nbytes].view(dtype) for r in range(self.size)]
        combine = REDUCE_FNS[request.op]
        combine(posts[0], posts[1], out)
        for post in posts[2:]:
            combine(out, post, out)
        factor = request.postscale / self.size if request.op == AVERAGE else request.postscale
        if factor != 1.0:
            scale(out, factor)

    # -- rank 0: verdicts -------------------------------------------------------------------------
    def service(self) -> None:
        """Rank 0 in the engine's path: abort any attempt a peer waits on (rank 0 will not post it)."""
        if self.rank != 0:
            return
        self._drain_bell()
        g = self.head[_COUNT]
        if any(words[_POST] == g + 1 for words in self.board.words[1:]):
            self._judge(g, own_post=False, engine_seen=True)

    @property
    def bell_fd(self) -> int:
        """Rank 0 sleeps on it in the engine's path; posters ring it."""
        return self.board.bell_fd

    def _judge(self, g: int, own_post: bool, engine_seen: bool) -> None:
        if own_post and not engine_seen:  # the common case, cheaply: wait until everyone posted
            tag = g + 1
            for words in self.board.words:
                if words[_POST] != tag and words[_WITHDRAW] != tag:
                    return
        with self._decide:
            if self.head[_COUNT] != g:
                return
            posts = [(words[_POST], words[_SIG], words[_WITHDRAW]) for words in self.board.words]
            mine = posts[0][1]
            current = [p for p in posts if p[0] == g + 1]
            clash = any(sig != mine for _, sig, _ in current) or any(w == g + 1 for _, _, w in posts)
            if not own_post or engine_seen or clash:
                verdict = _ABORT
            elif len(current) == self.size:
                verdict = _GO
            else:
                return
            self.head[_VERDICTS + g % _HISTORY] = (g + 1) * 4 + verdict
            fence()
            self.head[_COUNT] = g + 1

    def _verdict(self, g: int) -> int:
        value = self.head[_VERDICTS + g % _HISTORY]
        if value // 4 != g + 1:
            raise CollectiveError(f"fast lane: verdict {g} was overwritten before this rank read it")
        return value % 4

    def engine_wait(self, waiting: bool) -> None:
        """Rank 0 enters (True) or leaves the engine's path: while in it, posters ring its bell."""
        if self.rank == 0:
            self.head[_ENGINE_WAIT] = int(waiting)
            fence()

    def _ring_coordinator(self) -> None:
        fence()
        if self.rank != 0 and self.head[_ENGINE_WAIT]:
            try:
                os.write(self.board.bell_fd, b"\0")
            except (BlockingIOError, BrokenPipeError):
                pass

    def _drain_bell(self) -> None:
        try:
            while os.read(self.board.bell_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        """Unmap the board."""
        self.me = self.head = None  # type: ignore[assignment]
        self.board.close()

