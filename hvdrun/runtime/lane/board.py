"""The fast lane's board: one shared-memory file of a one-host job, a slot per rank.

Layout: every slot has ``HEADER_WORDS`` 64-bit header words, then two data buffers of ``CAPACITY``
bytes used by attempt parity. Rank 0's header also holds the verdict count and a ring of the last
``HISTORY`` verdicts. :mod:`hvdrun.runtime.lane.attempt` gives the words their meaning.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np

from hvdrun.runtime.transport.shmfile import map_shared, shm_file, unlink_names

CAPACITY = 64 << 10  # bytes of one post: larger allreduces are the ring's
HEADER_WORDS = 128
POST, WITHDRAW, DONE = 0, 2, 3  # header words of every slot; a post is attempt << 32 | signature
COUNT, ENGINE_WAIT = 4, 5  # rank 0's: verdicts issued; 1 while rank 0 waits in the engine's path
VERDICTS, HISTORY = 16, 64  # rank 0: verdicts[g % 64] at words 16..79
GO, ABORT = 1, 2
SLOT_BYTES = HEADER_WORDS * 8 + 2 * CAPACITY


def board_path(job_key: str) -> Path:
    """``/dev/shm/hvdrun-JOB-GEN-0.lane``: a file of rank 0, which creates it, so rank 0's guard removes it
    even when the launcher is killed."""
    return shm_file(job_key, 0, ".lane")


class Board:
    """The shared board of one job generation; rank 0 creates it, the others open it."""

    def __init__(self, job_key: str, size: int, create: bool) -> None:
        self.path, self.bell_path = board_path(job_key), board_path(job_key).with_suffix(".lanebell")
        self.map, (self.bell_fd,) = map_shared(self.path, [self.bell_path], size * SLOT_BYTES, create)
        self.words = [memoryview(self.map)[r * SLOT_BYTES:r * SLOT_BYTES + HEADER_WORDS * 8].cast("q")
                      for r in range(size)]
        self.buffers = [[np.frombuffer(self.map, np.uint8, CAPACITY, r * SLOT_BYTES + HEADER_WORDS * 8 + p * CAPACITY)
                         for p in (0, 1)] for r in range(size)]

    def unlink(self) -> None:
        """Remove the names once every rank has mapped the board."""
        unlink_names(self.path, self.bell_path)

    def close(self) -> None:
        """Unmap (left to the garbage collector while views remain)."""
        os.close(self.bell_fd)
        for words in self.words:
            words.release()
        self.words, self.buffers = [], []
        try:
            self.map.close()
        except BufferError:
            pass


def signature(name: str, dtype: np.dtype, shape: tuple[int, ...], op: int, prescale: float,
              postscale: float) -> int:
    """What every rank's post must agree on, as one number of 32 bits (never 0)."""
    text = f"{name}|{dtype.str}|{shape}|{op}|{prescale}|{postscale}"
    return zlib.crc32(text.encode()) % 0xFFFFFFFF + 1
