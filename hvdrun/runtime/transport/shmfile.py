"""Shared-memory files of one host's ranks in ``/dev/shm``: the name, making or opening the file and its FIFO
bells, and removing the names. The rings (:mod:`.shm`), the post board (:mod:`.posts`) and the fast lane's
board (:mod:`hvdrun.runtime.lane.board`) are all made this way: the creating rank makes the file (``O_EXCL``,
mode 0600) and the bells, the others open them, and the names are unlinked once every rank has mapped them
(mappings stay valid)."""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path

from hvdrun import envvars


def shm_file(job_key: str, rank: int, suffix: str, sender: int | None = None) -> Path:
    """``/dev/shm/hvdrun-JOB-GEN-RANK[.fromSENDER]SUFFIX``: a file named after the rank that creates it, so that
    rank's guard removes it if the job dies before it is unlinked."""
    return Path(envvars.shm_segment_base(job_key, rank, sender) + suffix)


def map_shared(path: Path, bell_paths: list[Path], length: int, create: bool) -> tuple[mmap.mmap, list[int]]:
    """Make (``create``) or open the file ``path`` of ``length`` bytes and its FIFO bells: the mapping and the
    bells' fds (read-write, non-blocking). On failure nothing stays open, and what this call made is removed.

    Raises:
        OSError: the file or a bell cannot be made or opened, or a bell is not a FIFO.
    """
    made: list[Path] = []
    bell_fds: list[int] = []
    mapping: mmap.mmap | None = None
    fd = -1
    try:
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            made.append(path)
            os.ftruncate(fd, length)
            for bell in bell_paths:
                os.mkfifo(bell, 0o600)
                made.append(bell)
        else:
            fd = os.open(path, os.O_RDWR)
            for bell in bell_paths:
                if not stat.S_ISFIFO(os.stat(bell).st_mode):
                    raise OSError(f"{bell} is not a FIFO")
        mapping = mmap.mmap(fd, length)
        for bell in bell_paths:
            bell_fds.append(os.open(bell, os.O_RDWR | os.O_NONBLOCK))
        return mapping, bell_fds
    except BaseException:
        for opened in bell_fds:
            os.close(opened)
        if mapping is not None:
            mapping.close()
        for made_path in made:
            made_path.unlink(missing_ok=True)
        raise
    finally:
        if fd >= 0:
            os.close(fd)


def unlink_names(*paths: Path) -> None:
    """Remove the names from ``/dev/shm`` (mappings stay valid); a name already gone is fine."""
    for path in paths:
        path.unlink(missing_ok=True)
