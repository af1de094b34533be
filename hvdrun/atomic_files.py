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
