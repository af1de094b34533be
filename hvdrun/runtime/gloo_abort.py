"""Ending a gloo op when the job aborts: gloo itself cannot interrupt one.

gloo notices a peer's end only on the connections the pending op waits on, so two ranks that wait on each other
inside an op whose other ranks died or left wait out the group's whole timeout (60 s by default), and an alive
peer's engine can even keep completing negotiation cycles with them after a failure. ``ProcessGroupGloo.abort()``
and ``shutdown()`` end nothing (torch 2.13, measured); destroying the group closes its connections, but blocks
while an op is pending. So a rank waits on a gloo op in short steps (:func:`wait_or_abort`) and, once the job's
abort flag is set, shuts down the group's own connections (:func:`opened_connections`, found when the group was
created): that ends the op here and on every rank still in it, which then raise and reset.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from hvdrun.errors import CollectiveError

STEP = datetime.timedelta(milliseconds=100)  # how often a rank waiting on a gloo op looks at the job's abort
ENDED_WITHIN_S = 5.0  # an op whose connections were shut down ends within this; else it is kept, not destroyed
_abandoned: list[tuple[Any, Any]] = []  # ops (and their groups) still pending after that: destroying them blocks
_T = TypeVar("_T")


def opened_connections(create: Callable[[], _T]) -> tuple[_T, list[int]]:
    """``create()``'s result and the connected sockets it opened (gloo connects every pair as the group is made).
    gloo's listener is left out: its thread ends the process (std::terminate) when its accept() fails."""
    before = _socket_fds()
    made = create()
    return made, [fd for fd in sorted(_socket_fds() - before) if _connected(fd)]


def wait_or_abort(work: Any, abort_reason: Callable[[], str | None], connections: Sequence[int], group: Any) -> None:
    """Wait for ``work`` in steps; once ``abort_reason()`` names a reason (also before the first step: peers that
    have not heard yet go on with ops that complete among them), shut down ``connections`` and raise
    :class:`CollectiveError` with it. An op's own error is raised as it is."""
    while True:
        reason = abort_reason()
        if reason is not None:
            _end(work, connections, group)
            raise CollectiveError(reason)
        try:
            work.wait(STEP)
            return
        except RuntimeError:
            if work.is_completed():
                work.wait()  # the op's own outcome: its error, or done just after the step ran out
                return


def _end(work: Any, connections: Sequence[int], group: Any) -> None:
    for fd in connections:
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    deadline = time.monotonic() + ENDED_WITHIN_S
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not work.is_completed():
        _abandoned.append((work, group))


def _socket_fds() -> set[int]:
    """This process's open socket descriptors (none where /proc cannot say)."""
    found: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.add(int(name))
        except (OSError, ValueError):
            continue
    return found


def _connected(fd: int) -> bool:
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            return not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        return False
