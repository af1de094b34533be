"""Worker output: rank-prefixed console lines, per-rank log files, stderr tails.

One :class:`OutputRouter` per job decides where every byte a worker writes goes:

* the console gets each line as ``[RANK]<stdout>:text`` (Horovod's format) on hvdrun's
  own stdout or stderr, or the bare text with ``prefix=False``;
* with an output directory, ``DIR/rank.N/stdout`` and ``DIR/rank.N/stderr`` get the raw
  bytes, unprefixed (N zero-padded to the width of the last rank, as Horovod does);
* the last lines of each rank's stderr are kept for the failure report.

Lines end at ``\\n``, ``\\r\\n`` or ``\\r`` (progress bars), and the terminator is kept; a
last line without terminator is still delivered at EOF.
"""

from __future__ import annotations

import codecs
import os
import re
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TextIO

STREAMS = ("stdout", "stderr")
_READ_SIZE = 65536
# a line of mpiexec's merged output, tagged by hvdrun's rank shim (launch/mpirank.py)
_TAGGED_RE = re.compile(r"^\[(\d+)\]<(stdout|stderr|exit)>:(.*)$", re.DOTALL)
# a line ends at \n, \r\n, or a \r that is not the first half of \r\n (undecided at the end)
_LINE_RE = re.compile(r"[^\r\n]*(?:\n|\r\n|\r(?=[^\n]))")


class LineSplitter:
    """Incrementally decode UTF-8 bytes and cut them into lines, keeping terminators."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

    def feed(self, data: bytes) -> list[str]:
        """Add bytes; return every line completed so far (terminator included)."""
        return self._split(self._pending + self._decoder.decode(data), final=False)

    def close(self) -> list[str]:
        """Return what is left (a partial last line) at EOF."""
        return self._split(self._pending + self._decoder.decode(b"", final=True), final=True)

    def _split(self, text: str, final: bool) -> list[str]:
        lines, end = [], 0
        for match in _LINE_RE.finditer(text):
            lines.append(match.group())
            end = match.end()
        rest = text[end:]
        if final and rest:
            lines.append(rest)
            rest = ""
        self._pending = rest
        return lines


def rank_dir_name(rank: int, size: int) -> str:
    """``rank.N`` with N padded to the width of ``size - 1`` so names sort by rank."""
    return f"rank.{rank:0{len(str(max(size - 1, 0)))}d}"


class OutputRouter:
    """Routes the output streams of every rank of one job.

    Args:
        size: number of ranks.
        prefix: prefix console lines with ``[rank]<stream>:``.
        output_dir: also write ``DIR/rank.N/{stdout,stderr}``; None for console only.
        tail_lines: how many stderr lines to keep per rank for failure reports.
    """

    def __init__(self, size: int, prefix: bool = True, output_dir: str | Path | None = None,
                 tail_lines: int = 20, console: dict[str, TextIO] | None = None) -> None:
        self.size, self.prefix = size, prefix
        self.output_dir = Path(output_dir) if output_dir else None
        self._console = console or {"stdout": sys.stdout, "stderr": sys.stderr}
        self._lock = threading.Lock()
        self._tails: dict[int, deque[str]] = {}
        self._tail_lines = tail_lines
        self._pumps: list[threading.Thread] = []
        self._rank_logs: dict[tuple[int, str], BinaryIO | None] = {}

    def attach(self, rank: int, stream: str, fd: int) -> None:
        """Start pumping file descriptor ``fd`` (the worker's ``stream``) until EOF; then close it."""
        self.attach_reader(rank, stream, lambda: _read(fd), lambda: os.close(fd))

    def attach_reader(self, rank: int, stream: str, read: Callable[[], bytes],
                      close: Callable[[], None] = lambda: None) -> None:
        """Start pumping ``read()`` (blocking; ``b""`` at EOF) as the worker's ``stream``; ``close()`` at EOF."""
        log = self._open_log(rank, stream)
        self._tails.setdefault(rank, deque(maxlen=self._tail_lines))
        pump = threading.Thread(target=self._pump, args=(rank, stream, read, close, log),
                                name=f"hvdrun-output-{rank}-{stream}", daemon=True)
        pump.start()
        self._pumps.append(pump)

    def attach_multiplexed(self, stream: str, fd: int, on_exit: Callable[[int, int], None]) -> threading.Thread:
        """Pump mpiexec's merged ``stream``: lines tagged ``[rank]<stdout|stderr>:`` go to that rank as if it
        had written them itself; ``[rank]<exit>:CODE`` calls ``on_exit(rank, code)``; untagged lines
        (mpiexec's own) are written as they are."""
        if not self._rank_logs:  # shared by both streams: a launcher may put a rank's stderr on its stdout
            self._rank_logs.update({(rank, name): self._open_log(rank, name)
                                    for rank in range(self.size) for name in STREAMS})
        for rank in range(self.size):
            self._tails.setdefault(rank, deque(maxlen=self._tail_lines))
        pump = threading.Thread(target=self._pump_multiplexed, args=(stream, fd, on_exit, self._rank_logs),
                                name=f"hvdrun-output-mpiexec-{stream}", daemon=True)
        pump.start()
        self._pumps.append(pump)
        return pump

    def _pump_multiplexed(self, stream: str, fd: int, on_exit: Callable[[int, int], None],
                          logs: dict[tuple[int, str], BinaryIO | None]) -> None:
        splitter = LineSplitter()
        try:
            while data := _read(fd):
                for line in splitter.feed(data):
                    self._route_tagged(line, stream, on_exit, logs)
            for line in splitter.close():
                self._route_tagged(line, stream, on_exit, logs)
        finally:
            os.close(fd)

    def _route_tagged(self, line: str, stream: str, on_exit: Callable[[int, int], None],
                      logs: dict[tuple[int, str], BinaryIO | None]) -> None:
        match = _TAGGED_RE.match(line)
        rank = int(match.group(1)) if match else -1
        if not match or not 0 <= rank < self.size:
            self._write_console(stream, line if line.endswith(("\n", "\r")) else line + "\n")
            return
        kind, text = match.group(2), match.group(3)
        if kind == "exit":
            on_exit(rank, int(text.strip() or 0))
            return
        log = logs.get((rank, kind))
        if log and not log.closed:
            log.write(text.encode())
            log.flush()
        self._emit(rank, kind, [text])

    def stderr_tail(self, rank: int) -> list[str]:
        """The last stderr lines of ``rank``, without terminators."""
        return [line.rstrip("\r\n") for line in self._tails.get(rank, ())]

    def drain(self, timeout_s: float) -> None:
        """Wait until every stream reached EOF and was written out (or the timeout passed)."""
        for pump in self._pumps:
            pump.join(timeout_s)
        for log in self._rank_logs.values():
            if log:
                log.close()

    def _open_log(self, rank: int, stream: str) -> BinaryIO | None:
        if self.output_dir is None:
            return None
        folder = self.output_dir / rank_dir_name(rank, self.size)
        folder.mkdir(parents=True, exist_ok=True)
        return open(folder / stream, "wb")

    def _pump(self, rank: int, stream: str, read: Callable[[], bytes], close: Callable[[], None],
              log: BinaryIO | None) -> None:
        splitter = LineSplitter()
        try:
            while data := read():
                if log:
                    log.write(data)
                    log.flush()
                self._emit(rank, stream, splitter.feed(data))
            self._emit(rank, stream, splitter.close())
        finally:
            close()
            if log:
                log.close()

    def _emit(self, rank: int, stream: str, lines: list[str]) -> None:
        if not lines:
            return
        if stream == "stderr":
            self._tails[rank].extend(lines)
        tag = f"[{rank}]<{stream}>:" if self.prefix else ""
        self._write_console(stream, "".join(tag + line if line.endswith(("\n", "\r")) else tag + line + "\n"
                                            for line in lines))

    def _write_console(self, stream: str, text: str) -> None:
        console = self._console[stream]
        with self._lock:
            try:
                console.write(text)
                console.flush()
            except (BrokenPipeError, ValueError):  # console closed (e.g. piped into head): keep the logs
                pass


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, _READ_SIZE)
    except OSError:
        return b""
