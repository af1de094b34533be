"""Byte streams cut into lines, for both sides: the launcher's output router and the rank shim on the hosts.

Lines end at ``\\n``, ``\\r\\n`` or ``\\r`` (progress bars), and the terminator is kept; a last line
without terminator is still delivered at EOF. Lines are cut as bytes (no UTF-8 byte sequence contains
``\\n`` or ``\\r``) in time linear in their length. A line that grows past :data:`MAX_LINE_BYTES` without a
terminator is passed on in pieces of about that size, so memory stays bounded whatever a rank writes.
Standard library only.

Many streams on one (mpiexec's merged output, a host agent's SSH channel) travel as *tagged lines*:
``[N]<kind>:`` and one line. ``N`` is a rank for the kinds ``stdout``, ``stderr`` (a line the rank wrote, its
terminator kept) and ``exit`` (the rank's exit code, negative for a signal), a host's index in its job for the
host agents' kinds (:mod:`hvdrun.launch.remote.host_agent.main`). A line that had no terminator (the last line of a
stream, or a piece of a huge line) gets ``\\n`` and a ``~`` after its kind (``[3]<stdout~>:no newline\\n``),
which :func:`untag` takes off again: what a rank wrote arrives byte for byte.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import NamedTuple

MAX_LINE_BYTES = 8 << 20  # a partial line longer than this is passed on as a piece (no terminator)
TAGGED_LINE_BYTES = 2 * MAX_LINE_BYTES  # a tagged line is at most a piece and its tag: cut none on the way
_TAG_RE = re.compile(rb"\[(\d+)\]<([a-z]+)(~?)>:")


class Tagged(NamedTuple):
    """One tagged line, untagged: who (a rank or a host index), what kind, and the text as it was written."""

    number: int
    kind: str
    text: bytes


def tag(number: int, kind: str, line: bytes) -> bytes:
    """``[number]<kind>:line`` as one line: a line without terminator gets one, and ``~`` says so."""
    if line.endswith((b"\n", b"\r")):
        return b"[%d]<%s>:%s" % (number, kind.encode(), line)
    return b"[%d]<%s~>:%s\n" % (number, kind.encode(), line)


def untag(line: bytes) -> Tagged | None:
    """The tagged line ``line`` (as :func:`tag` made it) taken apart; None for a line without a tag."""
    match = _TAG_RE.match(line)
    if match is None:
        return None
    text = line[match.end():]
    if match.group(3):
        text = text[:-1] if text.endswith(b"\n") else text
    return Tagged(int(match.group(1)), match.group(2).decode(), text)


class LineSplitter:
    """Cut a byte stream into lines, keeping terminators.

    Linear in the bytes fed: only new bytes are searched for terminators, and a partial line is
    kept as a list of pieces joined once, when its terminator arrives. A ``\\r`` at the very end
    of a chunk stays undecided until the next chunk says whether a ``\\n`` follows. A partial line
    of ``max_line_bytes`` or more is returned as it is (a piece without terminator).
    """

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._parts: list[bytes] = []
        self._cr_pending = False
        self._max_line_bytes = max_line_bytes
        self._size = 0  # bytes in _parts

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return every line completed so far (terminator included)."""
        return self._split(data, final=False)

    def close(self) -> list[bytes]:
        """Return what is left (a partial last line) at EOF."""
        return self._split(b"", final=True)

    def _split(self, data: bytes, final: bool) -> list[bytes]:
        lines: list[bytes] = []
        start = 0
        if self._cr_pending and (data or final):
            if data.startswith(b"\n"):
                self._add(b"\n")
                start = 1
            lines.append(self._take())
        for end in _line_ends(data, start):
            if end < 0:  # a \r closing the chunk: maybe the first half of \r\n, decided by the next chunk
                if final:
                    self._add(data[start:])
                    lines.append(self._take())
                    return lines
                self._add(data[start:])
                self._cr_pending = True
                return lines
            self._add(data[start:end])
            lines.append(self._take())
            start = end
        if start < len(data):
            self._add(data[start:])
        if self._parts and final:
            lines.append(self._take())
        elif self._size >= self._max_line_bytes:
            lines.append(self._take_piece())
        return lines

    def _add(self, part: bytes) -> None:
        self._parts.append(part)
        self._size += len(part)

    def _take(self) -> bytes:
        line = b"".join(self._parts)
        self._parts, self._cr_pending, self._size = [], False, 0
        return line

    def _take_piece(self) -> bytes:
        """A piece of a long partial line: all of it but its last byte, which stays to start the rest, so that a
        terminator arriving next never makes a line of its own (an empty line after a piece of exactly the limit)."""
        line = self._take()
        self._add(line[-1:])
        return line[:-1]


def _line_ends(data: bytes, start: int) -> Iterator[int]:
    """End offsets (after the terminator) of the lines in ``data[start:]``; -1 for a ``\r`` at the very end.

    ``bytes.find`` runs at memory speed; each position is searched again only once passed, so the
    scan stays linear however many lines a chunk holds.
    """
    size = len(data)
    next_nl, next_cr = data.find(b"\n", start), data.find(b"\r", start)
    while next_nl >= 0 or next_cr >= 0:
        if next_cr < 0 or 0 <= next_nl < next_cr:
            end = next_nl + 1
        elif next_cr + 1 == size:
            yield -1
            return
        else:
            end = next_cr + 2 if data[next_cr + 1] == 0x0A else next_cr + 1
        yield end
        if next_nl < end:
            next_nl = data.find(b"\n", end)
        if 0 <= next_cr < end:
            next_cr = data.find(b"\r", end)
