"""hvdrun's own signals, from its first instruction: a stop signal is never a silent death or a traceback.

:func:`own_signals` runs before anything else is imported (``python -m hvdrun``, the ``hvdrun`` script). From
then on SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread wherever hvdrun is (importing,
planning, staging, between two attempts), so every ``finally`` runs (staging's children are killed, a launcher is
closed) and the command line ends with one line and exit code 128 + N. The phases that supervise workers put their
own handlers over these while they run (every rank gets SIGTERM). SIGUSR1 and SIGUSR2, the schedulers' "preemption
soon" warnings, are passed to the ranks while they run (``--forward-signals``); one that is not passed on (none is
running, or ``--forward-signals none``) is noted in one line and ignored: a warning never kills the job. SIGQUIT
(Ctrl-\\) prints every rank's stacks while a job runs (``hvdrun.launch.stacks``); outside of that it is noted and
ignored, so a Ctrl-\\ that comes as the job ends never costs the job's exit code.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
from collections.abc import Iterator
from types import FrameType

from hvdrun.errors import JobInterrupted

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
NOTED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
_NOT_PASSED = "not passed to the ranks (not in --forward-signals, or none running); ignored, the job goes on"
_NOTES: dict[int, str] = {signal.SIGUSR1: _NOT_PASSED, signal.SIGUSR2: _NOT_PASSED,
                          signal.SIGQUIT: "no rank is running to print the stacks of; ignored"}


class Interrupted(KeyboardInterrupt):
    """A stop signal reached hvdrun where no phase handles it; a KeyboardInterrupt, so ``except Exception`` lets it
    through."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        """``SIGTERM``."""
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a death by that signal."""
        return 128 + self.signum


def signal_number(error: BaseException) -> int:
    """The signal behind an interrupt: :class:`Interrupted`'s, else SIGINT (Python's own KeyboardInterrupt)."""
    return error.signum if isinstance(error, Interrupted) else int(signal.SIGINT)


def own_signals() -> None:
    """Take over the stop signals and the forwarded ones (main thread only; see the module docstring)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_interrupted)
    for signum in (*NOTED_SIGNALS, signal.SIGQUIT):
        signal.signal(signum, _note_ignored)


_raised: list[int] = []


def _raise_interrupted(signum: int, _frame: FrameType | None) -> None:
    if _raised:  # hvdrun is already on its way out: let its cleanup (the finally blocks) finish
        return
    _raised.append(signum)
    raise Interrupted(signum)


def _note_ignored(signum: int, _frame: FrameType | None) -> None:
    line = f"hvdrun: received {signal.Signals(signum).name}; {_NOTES[signum]}\n"
    try:
        os.write(2, line.encode())  # one short line; a signal handler does no buffered I/O
    except OSError:
        pass


def interrupted_before_ranks(error: BaseException) -> JobInterrupted:
    """The error of a stop signal that came while hvdrun reached the hosts or staged, before any rank started."""
    signum = signal_number(error)
    return JobInterrupted(f"received {signal.Signals(signum).name} while reaching the hosts; nothing was started",
                          128 + signum)


@contextlib.contextmanager
def exit_if_interrupted() -> Iterator[None]:
    """Inside, an interrupt ends hvdrun with one line and exit code 128 + N (for the imports before the command
    line's own handling)."""
    try:
        yield
    except KeyboardInterrupt as e:
        signum = signal_number(e)
        with contextlib.suppress(OSError):
            os.write(2, f"hvdrun: error: received {signal.Signals(signum).name}; nothing is running\n".encode())
        sys.exit(128 + signum)


class Wakeup:
    """An event that a signal handler may set: a pipe, not a lock. (:class:`threading.Event`'s ``set()`` in a
    handler deadlocks when the signal lands while the main thread is inside that event's ``wait()``, which holds
    the event's lock at that moment: the handler runs on the main thread and waits for it forever.)"""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def set(self) -> None:
        """Wake the waiter (any thread, or a signal handler); a no-op once closed."""
        if self._write < 0:
            return
        try:
            os.write(self._write, b"\0")
        except OSError:  # full: a wake is pending anyway
            pass

    def wait(self, timeout_s: float | None) -> bool:
        """Until set (then cleared) or ``timeout_s`` (None: no limit): whether it was set."""
        if self._read < 0:
            return False
        try:
            readable = select.select([self._read], [], [], timeout_s)[0]
        except (OSError, ValueError):  # closed meanwhile
            return False
        return bool(readable) and self.clear()

    def clear(self) -> bool:
        """Forget the wakes so far: whether there was one."""
        woken = False
        try:
            while self._read >= 0 and os.read(self._read, 64):
                woken = True
        except OSError:  # empty (or closed)
            pass
        return woken

    def close(self) -> None:
        """Close the pipe; later calls do nothing (its descriptors' numbers may name other files by then)."""
        fds, self._read, self._write = (self._read, self._write), -1, -1
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

