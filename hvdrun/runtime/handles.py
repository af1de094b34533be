"""What the engine hands out and keeps per op: the :class:`Handle` (a future) and the :class:`LocalOp` record.

A handle finishes once, with a result or an error, and frees the op's name on this rank as it does, once the
caller takes up that end or goes on to another collective (:mod:`hvdrun.runtime.submissions`); a caller that
waits on it drives the engine's progress on its own thread (:meth:`EngineLike.drive_until`) instead of sleeping.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

from hvdrun.errors import CollectiveError
from hvdrun.runtime.forensics import Flight
from hvdrun.runtime.negotiation import Request
from hvdrun.runtime.transport.channels import Message


class EngineLike(Protocol):
    """What a handle needs of the engine (``hvdrun.runtime.engine.Engine`` provides it)."""

    def drive_until(self, handle: Handle, timeout_s: float | None) -> None:
        """Run cycles on the caller's thread until ``handle`` is done."""
        ...

    def release_name(self, name: str) -> None:
        """The op ``name`` finished on this rank: its name is free again once the rank goes on."""
        ...

    def name_seen(self, name: str, number: int) -> None:
        """The caller took up the end of the op ``name`` (this rank's submission ``number``): its name is free."""
        ...


class Handle:
    """The future of one submitted collective."""

    __slots__ = ("_done", "_finishing", "_gate", "_result", "_error", "_engine", "_name", "flight", "number")

    def __init__(self, engine: EngineLike | None = None, name: str | None = None) -> None:
        self._engine, self._name = engine, name
        self._done = False
        self._finishing = False  # finish() began (it says done only once the name is free)
        self._gate = threading.Lock()  # held until finish(): waiters block on it
        self._gate.acquire()
        self._result: Any = None
        self._error: BaseException | None = None
        self.flight: Flight | None = None  # this op in the rank's flight recorder
        self.number = 0  # the op's submission number on this rank (set by the ledger; 0 for the engine's own)

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Record the outcome, free the name and wake waiters (engine side).

        Horovod's rule: a name is taken from submission until the op finishes on this rank, whether or not its
        handle is ever synchronized (the name leaves Horovod's tensor table when the op is performed); here also
        until the caller sees it finish or goes on (see :mod:`hvdrun.runtime.submissions`).
        """
        if self._finishing:
            return
        self._finishing = True
        self._result, self._error = result, error
        if self.flight is not None:
            self.flight.land()
        if self._engine is not None and self._name is not None:
            # before done() says so: a waiter that polls done() (drive_until) may submit the name again at once
            self._engine.release_name(self._name)
        self._done = True
        self._gate.release()

    def done(self) -> bool:
        """True once the collective finished (successfully or not)."""
        return self._done

    def seen(self) -> None:
        """The caller took up this op's end (``hvd.poll`` said done): its name is free at once."""
        if self._done and self._engine is not None and self._name is not None:
            self._engine.name_seen(self._name, self.number)

    @property
    def name(self) -> str | None:
        """The name of the collective (None for handles the engine makes for itself)."""
        return self._name

    def block(self, timeout_s: float) -> None:
        """Sleep until finished or ``timeout_s`` passed, without driving communication."""
        if not self._done and self._gate.acquire(timeout=timeout_s):
            self._gate.release()

    def wait(self, timeout_s: float | None = None) -> Any:
        """Block until finished (driving communication meanwhile); return the result or raise its error."""
        if not self._done and self._engine is not None:
            self._engine.drive_until(self, timeout_s)
        if not self._done:
            self.block(-1 if timeout_s is None else timeout_s)
        if not self._done:
            raise TimeoutError("collective did not finish in time")
        self.seen()
        if self._error is not None:
            raise CollectiveError(str(self._error)) from self._error
        return self._result


@dataclass
class LocalOp:
    """A request of this rank and the buffer it works on."""

    request: Request
    array: Any  # a numpy array (empty for barriers), or a torch tensor for device ops
    handle: Handle
    payload: Message | None = None
