"""Files that a reader sees whole or not at all: written beside their place, then renamed over it."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomically(path: str | os.PathLike[str], text: str, mode: int | None = None) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same directory (made when missing) and a rename:
    a reader sees the old file or the new one, never half of it; a failed write leaves no temporary behind.

    Args:
        mode: the file's permission bits (default: what the user's umask gives).

    Raises:
        OSError: the directory or the file cannot be written.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8")
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return target


def why_unwritable(path: str | os.PathLike[str], appended: bool = False) -> str | None:
    """Why a file could not be written at ``path`` later (None: it could), found by doing it now: a probe file is
    created, written, synced and removed in the nearest folder of ``path`` that exists (the missing ones would be
    made), so a folder that only claims to be writable (``/proc`` to root, a read-only mount) or a full disk is
    found before a job spends hours, not when it ends. ``appended``: the file is appended to where it exists (a
    file in a folder of others', ``/dev/stdout``, a pipe), so an existing one is opened for appending instead."""
    target = Path(path)
    if appended and target.exists() and not target.is_dir():
        try:
            with open(target, "ab"):
                return None
        except OSError as e:
            return f"cannot append to it ({e.strerror or e})"
    folder = next(parent for parent in target.resolve().parents if parent.exists())
    if not folder.is_dir():
        return f"{folder} is not a directory"
    probe = folder / f".hvdrun-probe.{os.getpid()}"
    try:
        with open(probe, "wb") as file:
            file.write(b"\0")
            file.flush()
            os.fsync(file.fileno())
    except OSError as e:
        return f"cannot write in {folder} ({e.strerror or e})"
    finally:
        probe.unlink(missing_ok=True)
    return None
