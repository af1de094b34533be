"""Waiting for sockets and pipes with ``poll(2)``: ``select(2)`` cannot watch a descriptor numbered 1024 or more
(Python raises ValueError), and rank 0 of a job of a thousand hosts holds a socket for each."""

from __future__ import annotations

import errno
import os
import select
import socket
from collections.abc import Sequence
from typing import Any

_READ = select.POLLIN | select.POLLPRI
_ENDED = select.POLLHUP | select.POLLERR  # reported whatever was asked: a read then says why


def readable(watched: Sequence[Any], timeout_s: float | None, writable: Sequence[Any] = ()) -> list[Any]:
    """Those of ``watched`` (sockets, or file descriptors) that can be read (or whose peer closed, or that failed),
    as :func:`select.select`'s first list; waits at most ``timeout_s`` (None: for ever) for one of them, or for one of
    ``writable`` to take data.

    Raises:
        ValueError: a socket of ``watched`` or ``writable`` is closed (as select does).
        OSError: a descriptor was closed (EBADF, as select does).
    """
    masks: dict[int, int] = {}
    by_fd: dict[int, Any] = {}
    for item in watched:
        fd = _fileno(item)
        masks[fd] = masks.get(fd, 0) | _READ
        by_fd[fd] = item
    for item in writable:
        fd = _fileno(item)
        masks[fd] = masks.get(fd, 0) | select.POLLOUT
    poller = select.poll()
    for fd, mask in masks.items():
        poller.register(fd, mask)
    events = poller.poll(None if timeout_s is None else max(timeout_s, 0.0) * 1000.0)
    if any(event & select.POLLNVAL for _, event in events):  # a descriptor closed meanwhile: as select says it
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))
    return [by_fd[fd] for fd, event in events if fd in by_fd and event & (_READ | _ENDED)]


def _fileno(item: socket.socket | int) -> int:
    fd = item if isinstance(item, int) else item.fileno()
    if fd < 0:
        raise ValueError("file descriptor cannot be a negative integer (a closed socket)")
    return fd
