"""The optional compiled module: the steady state's exchange across hosts in one call, with the GIL released.

In the steady state of training every rank announces the same cached small allreduce alone, and the announcements
merge across hosts as *uniform* values (:class:`hvdrun.runtime.announcements.Uniform`) by recursive doubling. In
Python each step of it costs encoding, a swap, decoding and a merge. :func:`uniform_steps.c <runner>` does every
step of one op in one call: it sends this rank's frame, receives the partner's straight from the socket, reduces
it into place and goes on, on the wire format of the Python path (a rank on either path is any rank's partner).
It stops, saying how far it got, where the Python path must take over (a partner's message that is not a uniform
value of the same number, size and an adjacent range), and every ``slice`` seconds of waiting, so that the caller
sees the job's abort flag and signals as a Python wait does.

``pip install`` builds it (the package's build hook, ``hatch_build.py``, with the system's C compiler: into the
wheel, or next to the source for an editable install; without a compiler the install goes on, with one note, and
hvdrun runs its pure-Python path). ``python -m hvdrun.runtime.compiled`` (``make compiled``) builds
``_uniform_steps.so`` again next to the source. ``HVDRUN_COMPILED`` chooses: ``auto`` (the default: used when
built), ``off`` (the pure-Python path), ``on`` (an error at start when not built). Its gain was measured
(``benchmarks/results/compiled-decision.md``): 43 to 49 % less time a step at 4 and 64 KB across hosts.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from hvdrun import envvars
from hvdrun.errors import CollectiveError, PeerLostError, UsageError
from hvdrun.runtime.compiled.toolchain import LIBRARY_NAME, SOURCE_NAME, compile_library
from hvdrun.runtime.reduce import AVERAGE, MAX, MIN, PRODUCT, REDUCE_FNS, SUM, ReduceFn, padded
from hvdrun.runtime.transport.channels import MAX_SLEEP_S, TAKE_VALUE, DoublingStep, Waiter
from hvdrun.runtime.transport.posts import SLOT_BYTES, PostBoard

SOURCE = Path(__file__).with_name(SOURCE_NAME)
LIBRARY = Path(__file__).with_name(LIBRARY_NAME)
ABI_VERSION = 7  # uniform_steps.c's: a library built from another version of the source is not used
_HEADER_BYTES = 32
DONE, SLICE, OTHER, CLOSED, FAILED, UNSUPPORTED, WHOLE, BOARD_WAIT, POSTS_DIFFER, RESULT_OTHER = range(10)
DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.int32): 2, np.dtype(np.int64): 3}
OPS = {AVERAGE: 0, SUM: 0, MIN: 1, MAX: 2, PRODUCT: 3}  # Horovod's op codes -> the library's (Average: a sum, scaled)
REDUCTIONS = {REDUCE_FNS[op]: code for op, code in OPS.items()}  # the reduce functions (numpy ufuncs) -> the library's
SAME = 4  # the library's op for data that must be equal on both sides (not reduced)


class CompiledError(UsageError):
    """The compiled module could not be built, or ``HVDRUN_COMPILED=on`` and it is not built (a rank says so in one
    line, as for any other setting that cannot work here)."""


class _Plan(ctypes.Structure):
    _fields_ = [("steps", ctypes.c_int32), ("dtype", ctypes.c_int32), ("op", ctypes.c_int32),
                ("tag", ctypes.c_int32), ("tx_fds", ctypes.c_void_p), ("rx_fds", ctypes.c_void_p),
                ("modes", ctypes.c_void_p), ("nbytes", ctypes.c_int64), ("spin_ns", ctypes.c_int64),
                ("slice_ns", ctypes.c_int64), ("key", ctypes.c_int64), ("data", ctypes.c_void_p),
                ("scratch", ctypes.c_void_p), ("step", ctypes.c_int64), ("lo", ctypes.c_int64),
                ("hi", ctypes.c_int64), ("sent", ctypes.c_int64), ("got", ctypes.c_int64),
                ("error", ctypes.c_int32), ("unused2", ctypes.c_int32), ("source", ctypes.c_void_p),
                ("target", ctypes.c_void_p), ("factor", ctypes.c_double), ("ranks", ctypes.c_int64),
                ("rank", ctypes.c_int64), ("members", ctypes.c_int64), ("member", ctypes.c_int64),
                ("first_rank", ctypes.c_int64), ("round", ctypes.c_int64), ("words", ctypes.c_void_p),
                ("posts", ctypes.c_void_p), ("bells", ctypes.c_void_p), ("post_bytes", ctypes.c_int64),
                ("phase", ctypes.c_int32), ("unused3", ctypes.c_int32)]


class Outcome(NamedTuple):
    """How far one op's steps got: ``done`` steps, this rank's range ``lo..hi`` and its data reduced over it; when
    ``done`` is short of every step, the next step's frame of this rank not sent yet (``unsent``) and the partner's
    frame received so far (``received``: at least its length)."""

    done: int
    lo: int
    hi: int
    data: bytes
    unsent: bytes
    received: bytes


def frame_of(tag: int, key: int, lo: int, hi: int, data: bytes, mode: int) -> bytes:
    """The frame a step of ``mode`` sends for the uniform value ``(key, lo, hi, data)`` (an empty message for
    TAKE_VALUE), as the library and the Python path write it."""
    if mode == TAKE_VALUE:
        return bytes(8)
    message = len(data) + _HEADER_BYTES
    return b"".join((np.array([message, tag, key, lo, hi], np.int64).tobytes(), data, bytes(-message % 8)))


def frame_bytes_of(nbytes: int, mode: int) -> int:
    """The length of :func:`frame_of`'s frame for ``nbytes`` of data."""
    return 8 if mode == TAKE_VALUE else 8 + padded(_HEADER_BYTES + nbytes)


def build(output: Path = LIBRARY, source: Path = SOURCE) -> Path:
    """Compile ``source`` with the system's C compiler (``$CC``, else cc); the path of the library.

    Raises:
        CompiledError: no compiler, or it failed (its message).
    """
    problem = compile_library(output, source)
    if problem is not None:
        raise CompiledError(f"{problem}: the pure-Python path needs none" if "no C compiler" in problem else problem)
    return output


def load(environ: Mapping[str, str] = os.environ, path: Path = LIBRARY) -> ctypes.CDLL | None:
    """The library built at ``path``, as ``HVDRUN_COMPILED`` asks: None for ``off``, or ``auto`` when it is not built.

    Raises:
        CompiledError: ``on`` and the library is not built, does not load, or was built from another version of
            the source (``auto`` takes the Python path then).
    """
    mode = envvars.compiled_mode(environ)
    if mode == "off":
        return None
    try:
        library = ctypes.CDLL(str(path))
        version = library.hvdrun_uniform_steps_abi()
    except (OSError, AttributeError) as e:
        problem = f"does not load ({e})"
    else:
        if version == ABI_VERSION:
            for function in (library.hvdrun_uniform_steps, library.hvdrun_raw_steps, library.hvdrun_whole_steps):
                function.argtypes = [ctypes.c_void_p]
                function.restype = ctypes.c_int
            return library
        problem = f"was built from another version of {SOURCE.name} (interface {version}, expected {ABI_VERSION})"
    if mode == "on":
        raise CompiledError(f"{envvars.COMPILED[0]}=on but {path} {problem}; build it with "
                            "'python -m hvdrun.runtime.compiled'")
    return None


class StepLink(NamedTuple):
    """One step of the doubling, as the compiled module takes it: the sockets to and from the partner, the step's
    mode (:data:`hvdrun.runtime.transport.channels.MERGE_UPPER` ...), and the partner's name (for errors)."""

    tx_fd: int
    rx_fd: int
    mode: int
    peer: str


def step_links(steps: Sequence[DoublingStep]) -> tuple[StepLink, ...] | None:
    """``steps``' sockets as the library takes them, or None when a channel is not a socket."""
    fds = [(step.tx.socket_fd(), step.rx.socket_fd()) for step in steps]
    if any(tx is None or rx is None for tx, rx in fds):
        return None
    return tuple(StepLink(tx, rx, step.mode, getattr(step.rx, "peer", "a peer"))  # type: ignore[arg-type]
                 for (tx, rx), step in zip(fds, steps, strict=True))


class UniformSteps:
    """Runs the steps of uniform values through the library: one plan (sockets, size, type, op) per layout, reused.

    Args:
        library: what :func:`load` returned.
        slice_s: the longest wait before the call returns to look at the abort flag and signals (a Python wait's).
    """

    def __init__(self, library: ctypes.CDLL, slice_s: float = MAX_SLEEP_S) -> None:
        self._function, self._raw_function = library.hvdrun_uniform_steps, library.hvdrun_raw_steps
        self._whole_function = library.hvdrun_whole_steps
        self.slice_ns = max(1, int(slice_s * 1e9))
        self.ran = self.handed_over = 0  # calls; calls that stopped inside a step for Python to finish (tests read)
        self.wholes = 0  # calls of whole ops (WholeSteps), of ``ran``
        self._plans: dict[tuple, tuple[_Plan, int, np.ndarray, np.ndarray, tuple]] = {}

    def run(self, tag: int, key: int, lo: int, hi: int, data: bytes | memoryview | np.ndarray, dtype_code: int,
            op_code: int, links: tuple[StepLink, ...], waiter: Waiter, begun: bytes = b"") -> Outcome:
        """Every step of ``links`` for the uniform value ``(key, lo, hi, data)`` whose header starts with ``tag``, as
        far as they go: ``data`` reduced by ``op_code`` as ``dtype_code`` (:data:`DTYPES`, :data:`OPS`), or required
        to be equal on both sides (:data:`SAME`). ``begun``: the start of the first step's frame from the partner,
        received already. Waits spin and sleep as ``waiter``'s do, and end when its abort flag is set.

        Raises:
            PeerLostError: a partner's connection failed or closed.
        """
        nbytes = len(data) if not isinstance(data, np.ndarray) else data.nbytes
        layout = (id(links), nbytes, tag, dtype_code, op_code)
        entry = self._plans.get(layout) or self._plan(layout, links)
        plan, address, accumulator, scratch, _ = entry
        accumulator[:] = np.frombuffer(data, np.uint8)
        plan.key, plan.lo, plan.hi, plan.step, plan.sent, plan.got = key, lo, hi, 0, 0, len(begun)
        plan.spin_ns = int(waiter.spin_s * 1e9)
        self.ran += 1
        if len(begun) > scratch.nbytes:  # longer than any frame a step takes: the partner's value is another kind
            status = OTHER
        else:
            scratch[:len(begun)] = np.frombuffer(begun, np.uint8)
            status = self._call(self._function, address, plan, links, waiter, (DONE, OTHER))
        return self._outcome(status, entry, links, tag, begun)

    def _outcome(self, status: int, entry: tuple, links: tuple[StepLink, ...], tag: int, begun: bytes) -> Outcome:
        """The Outcome of a plan's call that ended with ``status`` (DONE, or OTHER: handed over to Python)."""
        plan, _, accumulator, scratch, _ = entry
        done, result = plan.step, accumulator.tobytes()
        if status == DONE:
            return Outcome(done, plan.lo, plan.hi, result, b"", b"")
        self.handed_over += 1
        frame = frame_of(tag, plan.key, plan.lo, plan.hi, result, links[done].mode)
        received = begun if plan.got > scratch.nbytes else scratch[:plan.got].tobytes()
        return Outcome(done, plan.lo, plan.hi, result, frame[plan.sent:], received)

    def whole(self, tag: int, key: int, rank: int, ranks: int, nbytes: int, dtype_code: int, op_code: int,
              factor: float, links: tuple[StepLink, ...], waiter: Waiter,
              board: WholeBoard | None = None) -> WholeSteps:
        """A lone op's steps where the whole job's value goes straight into the caller's array, prepared once for
        the uniform value ``(key, rank, rank, nbytes of data)`` whose header starts with ``tag``, reduced by
        ``op_code`` as ``dtype_code`` over ``links`` (the steps across hosts) and multiplied by ``factor`` (1.0 for
        integer types); on a host of several ranks, their values meet on ``board`` first."""
        entry = self._plan((id(links), nbytes, tag, dtype_code, op_code), links, remember=False)
        plan, kept = entry[0], list(entry[4])
        plan.factor, plan.ranks, plan.rank, plan.key, plan.members = factor, ranks, rank, key, 1
        plan.spin_ns = int(waiter.spin_s * 1e9)
        if board is not None:
            words, posts = board.board.addresses()
            arrays = ((ctypes.c_void_p * len(words))(*words), (ctypes.c_void_p * len(posts))(*posts),
                      (ctypes.c_int32 * len(words))(*board.board.bell_fds))
            plan.words, plan.posts, plan.bells = (ctypes.cast(array, ctypes.c_void_p) for array in arrays)
            plan.members, plan.member, plan.first_rank = len(words), board.member, board.first_rank
            plan.post_bytes = SLOT_BYTES
            kept += arrays
        return WholeSteps(self, (*entry[:4], tuple(kept)), links, waiter, board)

    def run_whole(self, entry: tuple, links: tuple[StepLink, ...], waiter: Waiter,
                  board: WholeBoard | None) -> Outcome | int | None:
        """:class:`WholeSteps`' calls of the plan ``entry`` (its source and target set) until it ends: None when the
        whole value was written; POSTS_DIFFER (the board's posts of the op's round are not one uniform value) or
        RESULT_OTHER (the leader posted another value as the result); else how far the steps across hosts went."""
        self.ran += 1
        self.wholes += 1
        plan, address = entry[0], entry[1]
        expected = (WHOLE, DONE, OTHER, BOARD_WAIT, POSTS_DIFFER, RESULT_OTHER)
        while (status := self._call(self._whole_function, address, plan, links, waiter, expected)) == BOARD_WAIT:
            assert board is not None
            board.board.round = plan.round  # the round the library posted and waits for
            board.wait()
        if board is not None:
            board.board.round = plan.round
        if status == WHOLE:
            return None
        if status in (POSTS_DIFFER, RESULT_OTHER):
            self.handed_over += 1
            return status
        return self._outcome(status, entry, links, plan.tag, b"")

    @staticmethod
    def codes(dtype: np.dtype, reduce: ReduceFn) -> tuple[int, int] | None:
        """The library's codes of ``dtype`` and the reduction ``reduce``, or None where it has no such thing."""
        dtype_code, op_code = DTYPES.get(dtype), REDUCTIONS.get(reduce)  # type: ignore[call-overload]
        return None if dtype_code is None or op_code is None else (dtype_code, op_code)

    def reduce_in_place(self, flat: np.ndarray, dtype_code: int, op_code: int, links: tuple[StepLink, ...],
                        waiter: Waiter) -> None:
        """The core steps of a plain recursive doubling of ``flat`` (contiguous, reduced in place): each step swaps the
        whole buffer with the partner of ``links`` (padded to 8 bytes, no header) and reduces the partner's copy into
        this rank's, this rank's operand first, as :meth:`hvdrun.runtime.collectives.pairwise.Pairwise.
        allreduce_doubling` does in Python, on the same wire.

        Raises:
            PeerLostError: a partner's connection failed or closed.
        """
        layout = (id(links), flat.nbytes, -1, dtype_code, op_code)
        plan, address, _, _, _ = self._plans.get(layout) or self._plan(layout, links)
        plan.data, plan.step, plan.sent, plan.got = flat.ctypes.data, 0, 0, 0
        plan.spin_ns = int(waiter.spin_s * 1e9)
        self.ran += 1
        self._call(self._raw_function, address, plan, links, waiter, (DONE,))

    @staticmethod
    def frame_bytes(nbytes: int) -> int:
        """What a step of :meth:`reduce_in_place` sends for ``nbytes`` of data."""
        return padded(nbytes)

    def _plan(self, layout: tuple, links: tuple[StepLink, ...],
              remember: bool = True) -> tuple[_Plan, int, np.ndarray, np.ndarray, tuple]:
        _, nbytes, tag, dtype_code, op_code = layout
        tx = (ctypes.c_int32 * len(links))(*(link.tx_fd for link in links))
        rx = (ctypes.c_int32 * len(links))(*(link.rx_fd for link in links))
        modes = (ctypes.c_uint8 * len(links))(*(link.mode for link in links))
        accumulator = np.zeros(max(nbytes if tag >= 0 else 0, 8), np.uint8)[:nbytes]  # raw plans reduce in place
        scratch = np.zeros(8 + _HEADER_BYTES + nbytes + 8, np.uint8)
        plan = _Plan(steps=len(links), dtype=dtype_code, op=op_code, tag=tag, nbytes=nbytes, slice_ns=self.slice_ns,
                     data=accumulator.ctypes.data, scratch=scratch.ctypes.data)
        plan.tx_fds, plan.rx_fds, plan.modes = (ctypes.cast(array, ctypes.c_void_p) for array in (tx, rx, modes))
        entry = (plan, ctypes.addressof(plan), accumulator, scratch, (tx, rx, modes, links))
        if remember:
            if len(self._plans) >= 256:
                self._plans.clear()
            self._plans[layout] = entry
        return entry

    @staticmethod
    def _call(function: Callable[[int], int], address: int, plan: _Plan, links: tuple[StepLink, ...], waiter: Waiter,
              expected: tuple[int, ...]) -> int:
        """Call ``function`` on the plan at ``address`` until it stops waiting (between its slices, the abort flag and
        signals get their turn); its status, one of ``expected``.

        Raises:
            PeerLostError: a partner's connection failed or closed.
        """
        while (status := function(address)) == SLICE:
            waiter.abort.check()
        if status in (CLOSED, FAILED):
            link = links[plan.step]
            if plan.error:
                raise PeerLostError(f"lost the connection to {link.peer}: {os.strerror(plan.error)}")
            raise PeerLostError(f"{link.peer} closed its connection (did it exit or crash?)")
        if status not in expected:
            raise CollectiveError(f"the compiled steps returned {status} for type {plan.dtype} op {plan.op}")
        return status


class WholeBoard(NamedTuple):
    """A host's post board as :meth:`UniformSteps.whole` takes it: this rank's place on it (member 0 leads: it
    merges the host's posts, runs the steps across hosts and posts the result in the next round), the host's first
    rank (member m is rank ``first_rank + m``), and ``wait()``, which sleeps until every member posted this rank's
    round (the library spins a while, then hands the wait to Python, which sleeps as its waiters do)."""

    board: PostBoard
    member: int
    first_rank: int
    wait: Callable[[], None]


class WholeSteps:
    """:meth:`UniformSteps.whole`'s prepared steps: :meth:`run` per op."""

    __slots__ = ("_steps", "_entry", "_plan", "_links", "_waiter", "_board", "_writes")

    def __init__(self, steps: UniformSteps, entry: tuple, links: tuple[StepLink, ...], waiter: Waiter,
                 board: WholeBoard | None) -> None:
        self._steps, self._entry, self._links, self._waiter, self._board = steps, entry, links, waiter, board
        self._plan = entry[0]
        self._writes = self._plan.op != SAME  # a held range's numbers are only checked, written nowhere

    def run(self, address: int, key: int | None = None) -> Outcome | int | None:
        """One op of the contiguous data at ``address`` (``key``: the header's number, where it changes from op to
        op: a held range's cycle): None when the whole job's value was written there (a held range's: every rank
        holds the same numbers); else (the data there untouched) POSTS_DIFFER, where the host's posts of this op's
        board round are not one uniform value; RESULT_OTHER, where the host's leader posted another value as the
        result; or how far the steps across hosts went (the leader's, or one rank a host), as
        :meth:`UniformSteps.run` says it.

        Raises:
            PeerLostError: a partner's connection failed or closed.
        """
        plan, board = self._plan, self._board
        plan.source = address
        plan.target = address if self._writes else None
        if key is not None:
            plan.key = key
        if board is not None:
            board.board.round += 1
            plan.round = board.board.round
        return self._steps.run_whole(self._entry, self._links, self._waiter, board)


_runner: list[UniformSteps | None] = []


def runner() -> UniformSteps | None:
    """This process's runner of the library, as ``HVDRUN_COMPILED`` asks, loaded on first use (None: Python's path).

    Raises:
        CompiledError: as :func:`load`.
    """
    if not _runner:
        library = load()
        _runner.append(UniformSteps(library) if library is not None else None)
    return _runner[0]
