"""hvdrun's console: writes that a reader who stopped reading (``hvdrun ... | less`` left paused, a pipe into
a process that hangs) can hold up only for a bounded time.

While a job runs, the ranks' output waits for the console as it would for any pipe (a slow reader slows the ranks;
nothing is lost), as long as the console takes something: one that took nothing for ``HVDRUN_CONSOLE_STALL_S``
(5 s; 0: never) while output waited for it is *stalled*, and the ranks' output no longer waits for it until it
takes bytes again (a rank that prints and exits while nobody reads must still end: its end is what the job's
supervision waits for). hvdrun's own lines wait at most a few seconds (:data:`SAY_WAIT_S`), and once the job
ends the console gets a last short while (:meth:`ConsoleStream.give_up_at`). What a console did not take
(stalled, or at the end) is dropped, counted, and said in one line (``--output-dir`` files still get every byte).
The control path (failure handling, signals, the end-of-job message) never waits on the console longer than that.

Writes go to the file descriptor itself, polled for room and cut into pieces of at most ``PIPE_BUF`` bytes (which a
pipe with room takes whole), never through Python's buffered stream: a thread stuck in a buffered write holds the
buffer's lock, and the interpreter's exit would wait on it for ever. Streams without a descriptor (``io.StringIO``)
are written as they are.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import stat
import sys
import threading
import time
from typing import TextIO

from hvdrun.envvars import CONSOLE_STALL_S, DEFAULT_CONSOLE_STALL_S, env_number

SAY_WAIT_S = 2.0  # the most one of hvdrun's own lines waits for the console
_POLL_S = 0.1  # how often a waiting write looks at its deadline again
_LOCKS: dict[tuple[int, int] | int, threading.Lock] = {}  # one per file open on the console (stdout 2>&1: one)
_LOCKS_LOCK = threading.Lock()


class ConsoleStream:
    """One of hvdrun's console streams (its stdout or stderr, or a stand-in) written with bounded waits.

    Args:
        stream: where the bytes go.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.stall_s = env_number(os.environ, (CONSOLE_STALL_S,), DEFAULT_CONSOLE_STALL_S)  # checked at the launch
        self._fd = _fd_of(stream)
        self._lock = _lock_for(stream, self._fd)
        self._pipe_like = self._fd is not None and not stat.S_ISREG(os.fstat(self._fd).st_mode)
        self._end: float | None = None  # after it, no write waits (the job ended)
        self._cut = False  # a write was given up within a line: start the next one on a new line
        self._closed = False  # the reader is gone (EPIPE): everything is dropped, silently (piped into head)
        self._flushed = False
        self._progress = 0.0  # when the console last took bytes (monotonic)
        self.stalled = False  # it took nothing for STALL_S: writes do not wait for it until it takes bytes again
        self.dropped_bytes = 0
        self.dropped_lines = 0

    def give_up_at(self, when: float) -> None:
        """From ``when`` (a :func:`time.monotonic` time) on, no write waits: what the console does not take at
        once is dropped and counted."""
        self._end = when if self._end is None else min(self._end, when)

    def write(self, data: bytes, wait_s: float | None = None) -> bool:
        """Write ``data``, waiting at most ``wait_s`` seconds (None: until :meth:`give_up_at`'s time, or for
        ever); returns whether all of it was written. What was not is counted in ``dropped_bytes``."""
        began = time.monotonic()
        mine = None if wait_s is None else began + wait_s
        deadline = self._deadline(mine)
        left = -1.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not self._lock.acquire(timeout=left):  # the holder gives up when the console stalls: so does this wait
            self._drop(data)
            return False
        try:
            written = self._write(data, mine, began)
        finally:
            self._lock.release()
        if written < len(data):
            self._drop(data[written:])
            self._cut = self._cut or written > 0
        return written == len(data)

    def dropped(self) -> str | None:
        """``1.2 MB (345 lines)`` of output dropped so far, or None when nothing was."""
        if not self.dropped_bytes or self._closed:
            return None
        lines = f"{self.dropped_lines} line{'s' if self.dropped_lines != 1 else ''}"
        return f"{_size(self.dropped_bytes)} ({lines})"

    def _deadline(self, mine: float | None) -> float | None:
        """The sooner of a write's own deadline and the end set by :meth:`give_up_at` (None: neither)."""
        if self._end is None:
            return mine
        return self._end if mine is None else min(mine, self._end)

    def _drop(self, data: bytes) -> None:
        if not self._closed:
            self.dropped_bytes += len(data)
            self.dropped_lines += data.count(b"\n")

    def _stall_deadline(self, began: float) -> float:
        """When a write that began at ``began`` stops waiting for a console that takes nothing (at once while it
        is stalled)."""
        if not self.stall_s:
            return math.inf
        return began if self.stalled else max(self._progress, began) + self.stall_s

    def _write(self, data: bytes, until: float | None, began: float) -> int:
        """Bytes of ``data`` written (with the lock held)."""
        if self._closed:
            return 0
        try:
            if self._fd is None:
                return _write_stream(self.stream, data)
            if not self._flushed:  # whatever Python's own stream still holds goes first, once
                self._flushed = True
                self.stream.flush()
            if self._cut and self._write_fd(self._fd, b"\n", until, began) == 1:
                self._cut = False
            return self._write_fd(self._fd, data, until, began) if not self._cut else 0
        except (BrokenPipeError, ValueError):  # console closed (e.g. piped into head): keep the logs
            self._closed = True
            return 0

    def _write_fd(self, fd: int, data: bytes, until: float | None, began: float) -> int:
        if not self._pipe_like:  # a regular file always has room
            return _write_all(fd, data)
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        view, done = memoryview(data), 0
        while done < len(data):
            own = self._deadline(until)
            deadline = min(own, self._stall_deadline(began)) if own is not None else self._stall_deadline(began)
            events = poller.poll(min(max(deadline - time.monotonic(), 0.0), _POLL_S) * 1000)
            if any(event & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, event in events):
                raise BrokenPipeError
            if events:
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    done += os.write(fd, view[done:done + select.PIPE_BUF])
                    self._progress, self.stalled = time.monotonic(), False
            elif time.monotonic() >= deadline:
                self.stalled = self.stalled or own is None or deadline < own
                break
        return done


def write_bounded(stream: TextIO, text: str, wait_s: float = SAY_WAIT_S) -> bool:
    """Write ``text`` to ``stream`` (hvdrun's stderr), waiting at most ``wait_s`` seconds; whether it went out."""
    return ConsoleStream(stream).write(text.encode(errors="replace"), wait_s)


def _fd_of(stream: TextIO) -> int | None:
    try:
        fd = stream.fileno()
        os.fstat(fd)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None
    return fd


def _lock_for(stream: TextIO, fd: int | None) -> threading.Lock:
    """The lock shared by every writer of the same open file (stdout and stderr both on one pipe: one lock)."""
    key: tuple[int, int] | int = id(stream)
    if fd is not None:
        info = os.fstat(fd)
        key = (info.st_dev, info.st_ino)
    with _LOCKS_LOCK:
        return _LOCKS.setdefault(key, threading.Lock())


def _write_all(fd: int, data: bytes) -> int:
    view, done = memoryview(data), 0
    while done < len(data):
        done += os.write(fd, view[done:])
    return done


def _write_stream(stream: TextIO, data: bytes) -> int:
    binary = getattr(stream, "buffer", None)
    if binary is not None:
        stream.flush()
        binary.write(data)
        binary.flush()
    else:
        stream.write(data.decode(errors="replace"))
        stream.flush()
    return len(data)


def _size(count: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


def standard_streams() -> dict[str, TextIO]:
    """hvdrun's own stdout and stderr, by stream name."""
    return {"stdout": sys.stdout, "stderr": sys.stderr}
