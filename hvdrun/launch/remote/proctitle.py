"""What ``ps`` and ``/proc/PID/environ`` show of a rank forked without ``exec`` (``preload.py``).

A forked process keeps its parent's command line and environment as the kernel shows them: the strings the
process started with, at the top of its stack. A rank forked from the fork server would show ``python
forkserver.py 5`` and the launcher's environment, not ``python -u train.py`` and its own variables (``ps``,
``pgrep -f train.py``, psutil, hvdrun's ``--track`` of a rank's processes by environment). :func:`show_as`
writes the rank's command and environment over those strings, as ``setproctitle`` does: the command as one line
(the kernel reads it up to its first NUL once the last byte of the area is not NUL), the environment entry by
entry, hvdrun's and the rank's ids first, each cut to the room the area has. :func:`room` is extra room a
spawner gives the process whose strings will be rewritten. Linux only; elsewhere nothing happens.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence

from hvdrun.envvars import PROC_ROOM

_FIRST = ("HVDRUN_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "HOROVOD_")  # environment entries written first


def room(command_bytes: int = 1024, environ_bytes: int = 16384) -> tuple[str, dict[str, str]]:
    """An extra argument and environment entry of blanks, for a process whose strings :func:`show_as` will
    rewrite: room for a rank's command line and for what its environment adds to the process's."""
    return " " * command_bytes, {PROC_ROOM: " " * environ_bytes}


def _areas() -> tuple[int, int, int, int] | None:
    """(arg_start, arg_end, env_start, env_end) of this process (``/proc/self/stat`` fields 48-51)."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        arg_start, arg_end, env_start, env_end = (int(value) for value in fields[45:49])
    except (OSError, ValueError):
        return None
    return arg_start, arg_end, env_start, env_end


def _environ_bytes(environ: Mapping[str, str], limit: int) -> bytes:
    first = sorted(environ, key=lambda name: not name.startswith(_FIRST))
    kept, size = [], 0
    for name in first:
        entry = f"{name}={environ[name]}".encode(errors="surrogateescape") + b"\0"
        if size + len(entry) <= limit:
            kept.append(entry)
            size += len(entry)
    return b"".join(kept)


def show_as(command: Sequence[str], environ: Mapping[str, str]) -> None:
    """Make this process show ``command`` and ``environ`` in ``/proc`` (cut to the room there is).

    Call it only once this process's C environment no longer points into the original strings (after
    ``os.environ.clear()`` and ``update``: the new values live in Python's memory).
    """
    areas = _areas()
    if areas is None or not all(areas):
        return
    arg_start, arg_end, env_start, env_end = areas
    if arg_end - arg_start >= 2:
        line = " ".join(command).encode(errors="surrogateescape")[:arg_end - arg_start - 2]
        area = line + b"\0" * (arg_end - arg_start - len(line) - 1) + b" "  # last byte not NUL: read as one line
        ctypes.memmove(arg_start, area, len(area))
    if env_end > env_start:
        entries = _environ_bytes(environ, env_end - env_start)
        ctypes.memmove(env_start, entries + b"\0" * (env_end - env_start - len(entries)), env_end - env_start)
