"""Shared-memory channels between ranks of one host: one single-producer/single-consumer byte ring per rank.

Every rank creates one segment in ``/dev/shm`` that is *its receive ring* and one FIFO that is
its doorbell. The previous rank of the ring writes into it; this rank reads from it::

    offset 0    write_count  (bytes ever written, owned by the writer)
    offset 64   read_count   (bytes ever read, owned by the reader)
    offset 128  sleeping     (1 while the owner sleeps in select(); peers then ring its bell)
    offset 256  data         (capacity bytes, a multiple of 8)

Counters are 8-byte aligned words written with single stores; the writer publishes
``write_count`` after copying the data and the reader publishes ``read_count`` after using
it, which the x86-64 memory model keeps in order (see :func:`shm_supported`).
Segments and FIFOs are unlinked as soon as every peer has opened them, so nothing is left in
``/dev/shm`` even if a rank is killed.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from hvdrun import envvars
from hvdrun.runtime.transport.channels import Doorbell, RxChannel, TxChannel
from hvdrun.runtime.transport.shmfile import map_shared, shm_file, unlink_names

_HEADER = 256
_WRITE, _READ, _SLEEPING = 0, 8, 16  # word indices in the header
SHM_DIR = Path(envvars.SHM_DIR)


def shm_supported() -> bool:
    """Shared-memory rings rely on x86-64 store ordering and on /dev/shm."""
    return platform.machine() in ("x86_64", "AMD64") and SHM_DIR.is_dir()


def _paths(job_key: str, rank: int, sender: int | None) -> tuple[Path, Path]:
    return shm_file(job_key, rank, ".ring", sender), shm_file(job_key, rank, ".bell", sender)


class ShmSegment:
    """A rank's receive ring and doorbell, created by that rank or opened by its peer.

    ``sender``: the segment of one link (what that rank writes to ``rank``), beside the ring's own.
    """

    def __init__(self, job_id: str, rank: int, capacity: int, create: bool, sender: int | None = None) -> None:
        self.ring_path, self.bell_path = _paths(job_id, rank, sender)
        self.capacity = capacity
        self.map, (self.bell_fd,) = map_shared(self.ring_path, [self.bell_path], _HEADER + capacity, create)
        self.words = memoryview(self.map)[:_HEADER].cast("Q")
        self.data = memoryview(self.map)[_HEADER:]
        self.bell = Doorbell(self.bell_fd, memoryview(self.map)[_SLEEPING * 8:_SLEEPING * 8 + 8].cast("Q"))

    def unlink(self) -> None:
        """Remove the names from /dev/shm (mappings stay valid)."""
        unlink_names(self.ring_path, self.bell_path)

    def close(self) -> None:
        """Close the doorbell and unmap (left to the garbage collector while views remain)."""
        os.close(self.bell_fd)
        try:
            self.words.release()
            self.data.release()
            self.bell.sleeping.release()  # type: ignore[attr-defined]
            self.map.close()
        except BufferError:
            pass


class ShmRx(RxChannel):
    """Reads this rank's own ring; rings the writer's bell when space frees up."""

    def __init__(self, own: ShmSegment, writer_bell: Doorbell) -> None:
        self.seg, self.writer_bell = own, writer_bell

    def peek(self, limit: int) -> memoryview:
        words, capacity = self.seg.words, self.seg.capacity
        read = words[_READ]
        available = words[_WRITE] - read
        if not available:
            return self.seg.data[0:0]
        offset = read % capacity
        return self.seg.data[offset:offset + min(available, capacity - offset, limit)]

    def consume(self, count: int) -> None:
        self.seg.words[_READ] += count
        self.writer_bell.ring()

    def wait_fds(self) -> tuple[list[int], list[int]]:
        return [self.seg.bell_fd], []

    def ready(self) -> bool:
        words = self.seg.words
        return words[_WRITE] != words[_READ]


class ShmTx(TxChannel):
    """Writes into the next rank's ring; rings its bell after each write."""

    def __init__(self, peer: ShmSegment, own_bell_fd: int) -> None:
        self.seg, self.own_bell_fd = peer, own_bell_fd
        self.bytes_sent = 0

    def send_some(self, data: memoryview) -> int:
        words, capacity = self.seg.words, self.seg.capacity
        written = words[_WRITE]
        free = capacity - (written - words[_READ])
        offset = written % capacity
        count = min(len(data), free, capacity - offset)
        if count <= 0:
            return 0
        self.seg.data[offset:offset + count] = data[:count]
        words[_WRITE] = written + count
        self.seg.bell.ring()
        self.bytes_sent += count
        return count

    def wait_fds(self) -> tuple[list[int], list[int]]:
        return [self.own_bell_fd], []

    def ready(self) -> bool:
        words = self.seg.words
        return words[_WRITE] - words[_READ] < self.seg.capacity
