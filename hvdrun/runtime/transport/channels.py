"""Channel interfaces and the waiter that parks a rank when no channel can move."""

from __future__ import annotations

import abc
import marshal
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from hvdrun import envvars
from hvdrun.errors import CollectiveError
from hvdrun.runtime.readiness import readable

# Spin (yielding the CPU) this long before sleeping in select(); 0 when ranks outnumber cores.
# Waking a sleeping thread costs up to ~100 us on virtual machines, so spinning pays up to about 1 ms.
DEFAULT_SPIN_S = 1e-3
# Longest sleep between checks of abort flags (and the bound on a lost doorbell).
MAX_SLEEP_S = 0.05
_FENCE = threading.Lock()
Message = bytes | memoryview  # what a message is sent from and received into: a view where a copy can be spared


# What a step of a recursive doubling of merged values does with the partner's value (MPICH's fold for a
# non-power-of-two group included): merge it, this rank's range above it or below; drop it (the member that folds
# out hands its value over); send this rank's final value and get nothing back (the fold-out's giver); send nothing
# and take the partner's final value (the fold-out's taker)
MERGE_UPPER, MERGE_LOWER, DISCARD, SEND_VALUE, TAKE_VALUE = range(5)


class DoublingStep(NamedTuple):
    """One step of a recursive doubling as a codec's own steps see it: the channels to and from the partner, and
    the step's mode (:data:`MERGE_UPPER` ...)."""

    tx: TxChannel
    rx: RxChannel
    mode: int


class StepsTaken(NamedTuple):
    """How far a codec's own steps went: the value after ``done`` steps; where they stopped inside the next step,
    this rank's frame not sent yet (``unsent``) and the partner's frame received so far (``received``, its length at
    least; empty: the step was not begun)."""

    value: Any
    done: int
    unsent: bytes
    received: bytes


class Codec(NamedTuple):
    """How a value travels as a message: ``dumps(value)`` to a message, ``loads(message)`` back; ``steps``, when
    given, runs a recursive doubling's steps for a value itself as far as it can (None: it does not take this
    value; :mod:`hvdrun.runtime.compiled`), on the wire format of ``dumps`` and the swaps."""

    dumps: Callable[[Any], Message]
    loads: Callable[[Message], Any]
    steps: Callable[[Any, Sequence[DoublingStep], Waiter], StepsTaken | None] | None = None


MARSHAL = Codec(marshal.dumps, marshal.loads)


def fence() -> None:
    """A full memory barrier: a lock's atomic read-modify-write orders earlier stores before later loads."""
    _FENCE.acquire()
    _FENCE.release()


class AbortFlag:
    """Set once, from any thread, when the job must stop; every wait loop checks it."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._listeners: list[Callable[[], None]] = []

    def set(self, reason: str) -> None:
        """Record the first reason (later ones are ignored) and tell the listeners, once."""
        if self.reason is None:
            self.reason = reason
            for listener in self._listeners:
                try:
                    listener()
                except Exception:  # noqa: BLE001 - a listener's failure must not hide the reason
                    pass

    def on_set(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (on the thread that sets the flag) when it is set: what cannot check the flag in a
        loop, as a NCCL communicator whose kernels wait on the device for a dead peer, is ended by it."""
        self._listeners.append(listener)

    def check(self) -> None:
        """Raise CollectiveError if the flag is set."""
        if self.reason is not None:
            raise CollectiveError(self.reason)


class TxChannel(abc.ABC):
    """Sends a byte stream to one peer."""

    bytes_sent: int = 0

    @abc.abstractmethod
    def send_some(self, data: memoryview) -> int:
        """Queue as much of ``data`` as fits now; return the number of bytes taken."""

    @abc.abstractmethod
    def wait_fds(self) -> tuple[list[int], list[int]]:
        """File descriptors to select() on (readable, writable) until sending can progress."""

    def ready(self) -> bool:
        """True when :meth:`send_some` would take bytes now (for channels select() cannot watch)."""
        return False

    def socket_fd(self) -> int | None:
        """The connected socket this channel sends on, for a caller that writes it itself (the compiled steps; it
        adds what it sent to :attr:`bytes_sent`); None (the default): not a socket."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the channel."""


class RxChannel(abc.ABC):
    """Receives a byte stream from one peer."""

    @abc.abstractmethod
    def peek(self, limit: int) -> memoryview:
        """Up to ``limit`` received bytes, without copying; empty when none arrived yet."""

    @abc.abstractmethod
    def consume(self, count: int) -> None:
        """Drop the first ``count`` bytes returned by :meth:`peek`."""

    @abc.abstractmethod
    def wait_fds(self) -> tuple[list[int], list[int]]:
        """File descriptors to select() on (readable, writable) until data may have arrived."""

    def read_into(self, dst: memoryview) -> int:
        """Move up to ``len(dst)`` received bytes into ``dst`` (channels that can, straight from the socket, without
        a staging copy); return how many."""
        view = self.peek(len(dst))
        count = len(view)
        if count:
            dst[:count] = view
            self.consume(count)
        return count

    def ready(self) -> bool:
        """True when :meth:`peek` would return bytes now. Must not change the channel: any thread may ask."""
        return False

    def socket_fd(self) -> int | None:
        """The connected socket this channel reads from, for a caller that reads it itself (the compiled steps),
        after taking what is :meth:`staged`; None (the default): not a socket."""
        return None

    def staged(self) -> int:
        """Bytes received from the socket and not consumed yet (they come before anything the socket holds)."""
        return 0

    def poll_fd(self) -> int | None:
        """A descriptor whose readability says all that :meth:`ready` would say now, so that one poll(2) asks many
        channels at once (:func:`any_ready`): a socket with nothing :meth:`staged`; None: ask :meth:`ready`."""
        return None if self.staged() else self.socket_fd()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the channel."""


class Watchable(Protocol):
    """What a waiter watches: a channel, or anything else that says when it can progress and what fds to sleep on."""

    def ready(self) -> bool:
        """True when the caller can progress now."""
        ...

    def wait_fds(self) -> tuple[list[int], list[int]]:
        """File descriptors to select() on (readable, writable) until it may progress."""
        ...


class Doorbell:
    """Wakes a sleeping rank: a FIFO it select()s on, and a 'sleeping' word its peers read.

    ``sleeping`` is a one-element array in shared memory (or a plain list for a rank with
    no shared-memory peers).
    """

    def __init__(self, fd: int, sleeping: list[int] | object) -> None:
        self.fd = fd
        self.sleeping = sleeping

    def ring(self) -> None:
        """Wake the owner if it sleeps; call after publishing what the owner waits for."""
        fence()
        if self.sleeping[0]:  # type: ignore[index]
            try:
                os.write(self.fd, b"\0")
            except (BlockingIOError, BrokenPipeError):
                pass

    def drain(self) -> None:
        """Empty the FIFO after waking up."""
        try:
            while os.read(self.fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass


def spin_seconds(policy: str, host_ranks: int, cores: int) -> float:
    """How long a wait for a peer spins before it sleeps, by ``HVDRUN_WAIT_POLICY``.

    ``active``: :data:`DEFAULT_SPIN_S` (a peer's message is seen within microseconds); ``passive``: 0, the wait sleeps
    at once and its core goes to whoever needs it (ranks, or other jobs, sharing the cores); ``auto``: active where the
    ``host_ranks`` of this host do not outnumber its ``cores``.
    """
    if policy not in envvars.WAIT_POLICIES:
        raise ValueError(f"wait policy {policy!r}: expected one of {', '.join(envvars.WAIT_POLICIES)}")
    if policy == "active" or (policy == "auto" and host_ranks <= cores):
        return DEFAULT_SPIN_S
    return 0.0


def any_ready(channels: Sequence[Watchable], poll: bool = True) -> bool:
    """Whether any of ``channels`` can progress now: those with a :meth:`RxChannel.poll_fd` (sockets with nothing
    staged) with one poll(2) for all of them (``poll=False``: not at all, the caller's own poll watches them), the
    others by their :meth:`~Watchable.ready`."""
    fds: list[int] = []
    for channel in channels:
        fd = channel.poll_fd() if isinstance(channel, RxChannel) else None
        if fd is None:
            if channel.ready():
                return True
        elif fd < 0:
            return True  # closed: the read that follows names the error
        else:
            fds.append(fd)
    if not (poll and fds):
        return False
    try:
        return bool(readable(fds, 0))
    except (OSError, ValueError):  # a socket closed meanwhile: the read that follows names the error
        return True


class Waiter:
    """Parks the calling thread until a channel may progress, the abort flag is set, or a timeout.

    Args:
        own_bell: this rank's doorbell (its FIFO and its sleeping word), or None.
        abort: the job's abort flag.
        spin_s: how long to spin with sched_yield before sleeping.
        link_bells: the doorbells of the rank's other receive segments (its links'): a sleeping rank raises
            the sleeping word of every segment it reads, so any writer rings.
    """

    def __init__(self, own_bell: Doorbell | None, abort: AbortFlag, spin_s: float = DEFAULT_SPIN_S,
                 link_bells: Sequence[Doorbell] = ()) -> None:
        self.abort, self.spin_s = abort, spin_s
        self.bells = ([own_bell] if own_bell is not None else []) + list(link_bells)  # every segment this rank reads
        self._idle_since: float | None = None
        self._count_lock = threading.Lock()  # two threads of a rank may sleep at once

    def progressed(self) -> None:
        """Tell the waiter that the caller made progress (resets the spin phase)."""
        self._idle_since = None

    def add_bell(self, bell: Doorbell) -> None:
        """Sleep on ``bell`` too (a board's, opened after the waiter was made): raise its sleeping word."""
        self.bells.append(bell)

    def idle(self, channels: Sequence[Watchable], max_sleep_s: float = MAX_SLEEP_S,
             extra_read_fds: Sequence[int] = ()) -> None:
        """Called when nothing moved: spin a little, then sleep until a channel is ready or woken."""
        self.abort.check()
        now = time.perf_counter()
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < self.spin_s:
            os.sched_yield()
            return
        self.sleep(channels, extra_read_fds, max_sleep_s)

    def sleep(self, channels: Sequence[Watchable], extra_read_fds: Sequence[int], timeout_s: float) -> None:
        """Sleep until a channel is ready, an fd in ``extra_read_fds`` is readable, we are woken, or timeout."""
        read_fds, write_fds = list(extra_read_fds), []
        for channel in channels:
            r, w = channel.wait_fds()
            read_fds += r
            write_fds += w
        bells = self.bells
        if bells:
            with self._count_lock:  # a count, and the lock's atomic operation is the fence
                for bell in bells:
                    bell.sleeping[0] += 1  # type: ignore[index]
        try:
            if not any_ready(channels, poll=False):  # the sockets among them: the poll below
                readable(read_fds, timeout_s, write_fds)
        finally:
            if bells:
                with self._count_lock:
                    for bell in bells:
                        bell.sleeping[0] -= 1  # type: ignore[index]
                for bell in bells:
                    bell.drain()
        self.abort.check()
