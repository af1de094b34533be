"""The exclude file that ``hvdrun check --write-excludes FILE`` writes for ``hvdrun --exclude-hosts-file FILE``.

One host name per line, as the job names it (``-H``, hostfile, cluster YAML, allocation); a line that starts
with ``#`` is a comment. The first line says who wrote the file and when; a comment before each host names
the checks it failed::

    # written by hvdrun check at 2026-11-25T03:14:07Z
    # 10.200.0.77 failed: reach
    10.200.0.77
    # node17 failed: allreduce
    node17

When every host passed, the file holds the first line only, so that a list from an earlier check never
outlives the hosts' repair.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path

from hvdrun.atomic_files import write_text_atomically
from hvdrun.errors import UsageError

COMMENT = "#"


def exclude_text(failed: Mapping[str, Sequence[str]], written_at: datetime) -> str:
    """The file's text: the header, then each host of ``failed`` (host -> failed check names) in order."""
    stamp = written_at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    lines = [f"{COMMENT} written by hvdrun check at {stamp}"]
    for host, checks in failed.items():
        lines += [f"{COMMENT} {host} failed: {', '.join(checks) or 'a check'}", host]
    return "\n".join(lines) + "\n"


def check_writable(path: str | os.PathLike[str]) -> None:
    """Refuse, before any host is contacted, a ``path`` whose directory cannot be written.

    Raises:
        UsageError: the directory is missing and cannot be made, or is not writable.
    """
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(path, e) from e
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _unwritable(path, PermissionError(13, f"{parent} is not writable"))


def _unwritable(path: str | os.PathLike[str], error: OSError) -> UsageError:
    return UsageError(f"--write-excludes {os.fspath(path)!r}: cannot write it ({error.strerror or error}); give a "
                      "file in a directory you can write, e.g. --write-excludes ./bad-hosts")


def write_excludes(path: str | os.PathLike[str], failed: Mapping[str, Sequence[str]],
                   written_at: datetime | None = None) -> Path:
    """Write :func:`exclude_text` to ``path`` atomically (a temp file beside it, then a rename).

    Raises:
        UsageError: ``path`` cannot be written (a directory, no permission, a parent that cannot be made).
    """
    text = exclude_text(failed, written_at or datetime.now(timezone.utc))
    try:  # readable by the other users of the allocation, whatever this user's umask
        return write_text_atomically(path, text, mode=0o644)
    except OSError as e:
        raise _unwritable(path, e) from e


def describe_written(path: Path, hosts: Sequence[str], all_passed: bool) -> str:
    """The one line ``hvdrun check`` prints after writing the file."""
    if not hosts:
        why = "every host passed" if all_passed else "the checks failed, but no host is to blame; see the report"
        return f"hvdrun check: wrote 0 hosts to exclude to {path} ({why})"
    names = ", ".join(hosts[:8]) + (", ..." if len(hosts) > 8 else "")
    return f"hvdrun check: wrote {len(hosts)} host{'s' if len(hosts) != 1 else ''} to exclude to {path} ({names})"
