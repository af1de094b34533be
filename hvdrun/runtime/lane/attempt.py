"""One rank's side of the fast lane: posting an allreduce on the board, and rank 0's verdicts.

See :mod:`hvdrun.runtime.lane` for why one rank decides; :mod:`hvdrun.runtime.lane.board` for the layout.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from hvdrun.errors import CollectiveError
from hvdrun.runtime.lane.board import (
    ABORT,
    COUNT,
    DONE,
    ENGINE_WAIT,
    GO,
    HISTORY,
    POST,
    VERDICTS,
    WITHDRAW,
    Board,
    signature,
)
from hvdrun.runtime.reduce import AVERAGE, MAX, MIN, PRODUCT, REDUCE_FNS, SUM, final_factor, scale
from hvdrun.runtime.transport.channels import AbortFlag, fence

SPINS_BEFORE_YIELD = 200
_MAX_PLANS = 4096  # layouts (and names per layout) remembered
# a rank that waits this long for the others leaves the lane (through the verdict): a late rank, a stall
# or a deadlock is then the engine's to handle, with its warnings, probes and errors
WITHDRAW_AFTER_S = 0.02
# past this wait a rank polls the board between sleeps instead of spinning: a late peer (a slow data loader,
# rank 0 in user code) then costs no core; each sleep is at most a twentieth of the wait so far, up to MAX_NAP_S
NAP_AFTER_S = WITHDRAW_AFTER_S
MAX_NAP_S = 2e-3
LANE_OPS = frozenset((SUM, AVERAGE, MIN, MAX, PRODUCT))  # what the lane reduces


_Layout = tuple[np.dtype, tuple[int, ...], int, float, float]  # dtype, shape, op, prescale, postscale


def rest(waited_s: float) -> None:
    """Between two polls of a wait of ``waited_s`` so far: yield the core, or past NAP_AFTER_S sleep a twentieth
    of the wait (at most MAX_NAP_S), so that a long wait polls rarely and a short one stays quick."""
    if waited_s > NAP_AFTER_S:
        time.sleep(min(waited_s / 20, MAX_NAP_S))
    else:
        os.sched_yield()


class _Plan:
    """Everything an allreduce of one layout needs, made once: the board's buffers viewed as the tensor, the
    combining function, the final factor, and the signatures of the names seen with it."""

    __slots__ = ("layout", "mine", "posts", "combine", "factor", "signatures")

    def __init__(self, board: Board, rank: int, size: int, layout: _Layout) -> None:
        dtype, shape, op, _, postscale = self.layout = layout
        nbytes = math.prod(shape) * dtype.itemsize
        self.posts = [[board.buffers[r][parity][:nbytes].view(dtype).reshape(shape) for r in range(size)]
                      for parity in (0, 1)]
        self.mine = [self.posts[parity][rank] for parity in (0, 1)]
        self.combine = REDUCE_FNS[op]
        self.factor = final_factor(op, postscale, size)
        self.signatures: dict[str, int] = {}

    def sign(self, name: str) -> int:
        """The signature of ``name`` with this layout, remembered."""
        if len(self.signatures) >= _MAX_PLANS:
            self.signatures.clear()
        sig = self.signatures[name] = signature(name, *self.layout)
        return sig


class FastLane:
    """One rank's side of the board.

    Args:
        board: the mapped board.
        rank: this rank; rank 0 writes the verdicts.
        size: ranks in the job (all on this host).
        abort: the job's failure flag (a dead peer ends every wait).
        spins_before_yield: busy polls before each wait also yields the core (0 where ranks share cores).
    """

    def __init__(self, board: Board, rank: int, size: int, abort: AbortFlag,
                 spins_before_yield: int = SPINS_BEFORE_YIELD) -> None:
        self.board, self.rank, self.size, self.abort = board, rank, size, abort
        self.spins_before_yield = spins_before_yield
        self.me = board.words[rank]
        self.head = board.words[0]
        self._decide = threading.Lock()  # rank 0: one verdict at a time, from any thread
        self._slot = threading.Lock()  # one thread of this rank in the lane at a time
        self._plans: dict[_Layout, _Plan] = {}
        self._readers_done_to = 0  # every rank has finished reading attempts below this
        self._last_go = -1  # this rank's last attempt that went through: every rank posted it, so none still
        # reads the attempt before it (whose buffers the next attempt reuses)
        self.used = 0  # attempts that went through (tests read it)
        self.stall_warning_s, self.stall_error_s = math.inf, 0.0  # the engine's settings (configure())

    def enter(self) -> bool:
        """Claim this rank's slot for one attempt (False: another thread of this rank is in the lane)."""
        return self._slot.acquire(blocking=False)

    def leave(self) -> None:
        """Release the slot claimed by :meth:`enter`."""
        self._slot.release()

    def configure(self, stall_warning_s: float, stall_error_s: float) -> None:
        """The engine's stall settings: a rank waiting on rank 0 that never comes warns, then fails."""
        self.stall_warning_s, self.stall_error_s = stall_warning_s, stall_error_s

    # -- a rank's attempt -----------------------------------------------------------------------
    def allreduce(self, array: np.ndarray, name: str, op: int, prescale: float, postscale: float,
                  engine_busy: Callable[[], bool]) -> bool:
        """Try an allreduce of ``array`` (up to CAPACITY bytes, an op of LANE_OPS) on the board; True when
        ``array`` holds the result, False: take the engine's path. ``engine_busy()`` says whether a peer used
        the engine since this attempt began."""
        layout = (array.dtype, array.shape, op, prescale, postscale)
        plan = self._plans.get(layout) or self._plan(layout)
        sig = plan.signatures.get(name) or plan.sign(name)
        head, me = self.head, self.me
        g = head[COUNT]
        parity = g & 1
        if g >= 2 and self._last_go != g - 1 and self._readers_done_to < g - 1:
            self._wait_buffer_free(g)
        mine = plan.mine[parity]
        np.copyto(mine, array)
        if prescale != 1.0:
            scale(mine, prescale)
        me[POST] = (g + 1) << 32 | sig  # one store: the attempt and what it is
        if self.rank:
            self._ring_coordinator()
        verdict = self._await_verdict(g, name, engine_busy)
        if verdict == GO:
            posts, combine = plan.posts[parity], plan.combine
            combine(posts[0], posts[1], out=array)
            for post in posts[2:]:
                combine(array, post, out=array)
            if plan.factor != 1.0:
                scale(array, plan.factor)
            self.used += 1
            self._last_go = g
        fence()
        me[DONE] = g + 1
        return verdict == GO

    def _plan(self, layout: _Layout) -> _Plan:
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        plan = self._plans[layout] = _Plan(self.board, self.rank, self.size, layout)
        return plan

    def _wait_buffer_free(self, g: int) -> None:
        """Attempt ``g`` reuses the buffers of attempt ``g - 2``: wait until every reader of it is done."""
        if self._verdict(g - 2) != GO:
            return
        spins, started = 0, time.monotonic()
        while any(words[DONE] < g - 1 for words in self.board.words):
            spins = self._pause(spins, started)
        self._readers_done_to = min(words[DONE] for words in self.board.words)

    def _await_verdict(self, g: int, name: str, engine_busy: Callable[[], bool]) -> int:
        head, judge = self.head, self.rank == 0
        spins, withdrawn, warned, napping = 0, False, False, False
        started = time.monotonic()
        while head[COUNT] <= g:
            if judge:
                self._judge(g, own_post=True, engine_seen=False)
            spins += 1
            if spins & 63 and not napping:
                if spins > self.spins_before_yield:
                    os.sched_yield()
                continue
            # every 64 polls, and every poll once napping: the abort flag, the engine, the clock
            self.abort.check()
            waited = time.monotonic() - started
            if (engine_busy() or waited > WITHDRAW_AFTER_S) and not withdrawn:
                withdrawn = True
                if judge:
                    self._judge(g, own_post=True, engine_seen=True)
                else:
                    self.me[WITHDRAW] = g + 1  # ask rank 0 to abort; the verdict still decides
                    self._ring_coordinator()
            if waited > self.stall_warning_s and not warned:
                warned = True
                print(f"hvdrun: warning: '{name}' has waited more than {self.stall_warning_s:g} s for rank 0",
                      file=sys.stderr, flush=True)
            if self.stall_error_s and waited > self.stall_error_s:
                raise CollectiveError(f"stalled: '{name}' waited more than {self.stall_error_s:g} s for rank 0, "
                                      "which never reached it")
            napping = waited > NAP_AFTER_S
            rest(waited)
        return self._verdict(g)

    def _pause(self, spins: int, started: float) -> int:
        self.abort.check()
        if spins >= self.spins_before_yield:
            rest(time.monotonic() - started)
        return spins + 1

    # -- rank 0: verdicts -------------------------------------------------------------------------
    def service(self) -> None:
        """Rank 0 in the engine's path: abort any attempt a peer waits on (rank 0 will not post it)."""
        if self.rank != 0:
            return
        self._drain_bell()
        g = self.head[COUNT]
        if any(words[POST] >> 32 == g + 1 for words in self.board.words[1:]):
            self._judge(g, own_post=False, engine_seen=True)

    @property
    def bell_fd(self) -> int:
        """Rank 0 sleeps on it in the engine's path; posters ring it."""
        return self.board.bell_fd

    def _judge(self, g: int, own_post: bool, engine_seen: bool) -> None:
        """Issue attempt ``g``'s verdict when it is due: GO once every rank posted the same op as rank 0
        (a rank that asked to withdraw meanwhile still obeys it); ABORT on a different op, a withdrawal of a
        rank that did not post, engine traffic, or rank 0 not posting at all."""
        tag, mine = g + 1, self.head[POST]
        everyone, clash = True, not own_post or engine_seen
        for words in self.board.words:
            post = words[POST]
            if post != mine:
                everyone = False
                clash = clash or post >> 32 == tag or words[WITHDRAW] == tag
        if everyone and not clash:
            self._issue(g, GO)
        elif clash:
            self._issue(g, ABORT)

    def _issue(self, g: int, verdict: int) -> None:
        with self._decide:
            if self.head[COUNT] != g:
                return  # another thread of rank 0 decided it
            self.head[VERDICTS + g % HISTORY] = (g + 1) * 4 + verdict
            fence()
            self.head[COUNT] = g + 1

    def _verdict(self, g: int) -> int:
        value = self.head[VERDICTS + g % HISTORY]
        if value // 4 != g + 1:
            raise CollectiveError(f"fast lane: verdict {g} was overwritten before this rank read it")
        return value % 4

    @contextlib.contextmanager
    def engine_path(self) -> Iterator[None]:
        """A caller drives the engine: while rank 0 is in this path, posters ring its bell."""
        if self.rank == 0:
            self.head[ENGINE_WAIT] = 1
            fence()
        try:
            yield
        finally:
            if self.rank == 0:
                self.head[ENGINE_WAIT] = 0
                fence()

    def _ring_coordinator(self) -> None:
        fence()
        if self.rank != 0 and self.head[ENGINE_WAIT]:
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

