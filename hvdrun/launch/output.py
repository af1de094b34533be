"""Worker output: rank-prefixed console lines, per-rank log files, stderr tails.

One :class:`OutputRouter` per job decides where every byte a worker writes goes:

* the console gets each line as ``[RANK]<stdout>:text`` (Horovod's format) on hvdrun's
  own stdout or stderr, or the bare text with ``prefix=False``;
* with an output directory, ``DIR/rank.N/stdout`` and ``DIR/rank.N/stderr`` get the raw
  bytes, unprefixed (N zero-padded to the width of the last rank, as Horovod does);
* the last lines of each rank's stderr are kept for the failure report;
* a rank whose runtime says it failed because of another rank (a control line on its stderr,
  :data:`hvdrun.envvars.CONSEQUENCE_MARKER`) is remembered, and the line is dropped; so are the
  lines that say a rank entered ``init()`` and joined the job (:data:`hvdrun.envvars.INIT_MARKER`);
* ``console_ranks`` (``--ranks-output``) limits the console to some ranks; the files and tails keep all;
* a log file that cannot be written (a full disk) is given up with one warning; the console goes on.

Lines end at ``\\n``, ``\\r\\n`` or ``\\r`` (progress bars), and the terminator is kept; a
last line without terminator is still delivered at EOF. Lines are cut as bytes (no UTF-8
byte sequence contains ``\\n`` or ``\\r``) by :class:`~hvdrun.launch.remote.lines.LineSplitter`
and reach the console unchanged, in time linear in their length: a worker printing megabyte
lines is not slowed down by hvdrun.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TextIO

from hvdrun.envvars import CONSEQUENCE_MARKER, INIT_MARKER, JOINED_MARKER
from hvdrun.launch.console import SAY_WAIT_S, ConsoleStream, standard_streams
from hvdrun.launch.remote.lines import TAGGED_LINE_BYTES, LineSplitter, untag

STREAMS = ("stdout", "stderr")
_READ_SIZE = 1 << 20
_TAIL_LINE_BYTES = 4096  # a longer stderr line is cut short in the failure report's tail


def rank_dir_name(rank: int, size: int) -> str:
    """``rank.N`` with N padded to the width of ``size - 1`` so names sort by rank."""
    return f"rank.{rank:0{len(str(max(size - 1, 0)))}d}"


def _with_newline(line: bytes) -> bytes:
    return line if line.endswith((b"\n", b"\r")) else line + b"\n"


class OutputRouter:
    """Routes the output streams of every rank of one job.

    Args:
        size: number of ranks.
        prefix: prefix console lines with ``[rank]<stream>:``.
        output_dir: also write ``DIR/rank.N/{stdout,stderr}``; None for console only.
        tail_lines: how many stderr lines to keep per rank for failure reports.
        console: where console lines go per stream (default hvdrun's stdout and stderr).
        timestamp: start each console line with the time (horovodrun's ``--prefix-timestamp``).
        console_ranks: the ranks whose lines reach the console (``--ranks-output``); None for all.
    """

    def __init__(self, size: int, prefix: bool = True, output_dir: str | Path | None = None,
                 tail_lines: int = 20, console: dict[str, TextIO] | None = None, timestamp: bool = False,
                 console_ranks: frozenset[int] | None = None) -> None:
        self.size, self.prefix, self.timestamp, self.console_ranks = size, prefix, timestamp, console_ranks
        self.last_output = time.monotonic()  # when a rank last wrote anything (--idle-timeout)
        self.output_dir = Path(output_dir) if output_dir else None
        self._console = {name: ConsoleStream(stream) for name, stream in (console or standard_streams()).items()}
        self._tails: dict[int, deque[bytes]] = {}
        self._tail_lines = tail_lines
        self._pumps: list[threading.Thread] = []
        self._feeds: dict[str, threading.Event] = {}  # tagged streams read by others: set at their end
        self._rank_pumps: dict[int, list[threading.Thread]] = {}
        self._rank_logs: dict[tuple[int, str], BinaryIO | None] = {}  # None: could not be opened (warned)
        self._logs_lock = threading.Lock()
        self._consequences: dict[int, float] = {}
        self.entered_init: dict[int, float] = {}  # ranks that said they entered init(), and when (wall clock)
        self.joined: dict[int, float] = {}  # ranks whose init() rendezvous completed, and when
        self._markers = {CONSEQUENCE_MARKER: self._consequences, INIT_MARKER: self.entered_init,
                         JOINED_MARKER: self.joined}
        self._disk_warned = False
        self._stalls_said: set[str] = set()  # console streams whose stall was said

    def attach(self, rank: int, stream: str, fd: int) -> None:
        """Start pumping file descriptor ``fd`` (the worker's ``stream``) until EOF; then close it."""
        self.attach_reader(rank, stream, lambda: _read(fd), lambda: os.close(fd))

    def attach_reader(self, rank: int, stream: str, read: Callable[[], bytes],
                      close: Callable[[], None] = lambda: None) -> None:
        """Start pumping ``read()`` (blocking; ``b""`` at EOF) as the worker's ``stream``; ``close()`` at EOF."""
        log = self._log_for(rank, stream)
        self._tails.setdefault(rank, deque(maxlen=self._tail_lines))
        pump = self._start_pump(f"{rank}-{stream}", self._pump, rank, stream, read, close, log)
        self._rank_pumps.setdefault(rank, []).append(pump)

    def attach_multiplexed(self, stream: str, fd: int, on_exit: Callable[[int, int], None],
                           on_own_line: Callable[[bytes], None] = lambda line: None) -> threading.Thread:
        """Pump mpiexec's merged ``stream``.

        Lines tagged ``[rank]<stdout|stderr>:`` (:mod:`hvdrun.launch.remote.lines`) go to that rank as if it
        had written them itself; ``[rank]<exit>:CODE`` calls ``on_exit(rank, code)``; other lines (mpiexec's
        own) are written as they are, and given to ``on_own_line``.
        """
        self._open_multiplexed()
        return self._start_pump(f"mpiexec-{stream}", self._pump_multiplexed, stream, fd, on_exit, on_own_line)

    def multiplexed(self, name: str, on_exit: Callable[[int, int], None]) -> Callable[[bytes], None]:
        """A feed for tagged lines that a reader of their own takes from their source (a host agent's SSH
        channel): call it with each whole line, routed as :meth:`attach_multiplexed` routes them, and with
        ``b""`` at the end of the source; :meth:`drain` waits for that end (``name`` names it if it never comes).
        """
        self._open_multiplexed()
        ended = self._feeds.setdefault(name, threading.Event())

        def feed(line: bytes) -> None:
            if not line:
                ended.set()
                return
            self.last_output = time.monotonic()
            self._route_tagged(line, "stdout", on_exit)

        return feed

    def _log_for(self, rank: int, stream: str) -> BinaryIO | None:
        """The rank's log file of ``stream``, opened once for whichever source carries it (its own pipe, or a stream
        of many ranks' tagged lines; in a mixed job both kinds run at once); opened again after it was closed (a
        restarted rank)."""
        with self._logs_lock:
            log = self._rank_logs.get((rank, stream))
            if log is None and (rank, stream) in self._rank_logs or log is not None and not log.closed:
                return log
            log = self._rank_logs[(rank, stream)] = self._open_log(rank, stream)
            return log

    def _open_multiplexed(self) -> None:
        """Every rank's tail, for streams that carry many ranks' lines (their log files open at their first line)."""
        for rank in range(self.size):
            self._tails.setdefault(rank, deque(maxlen=self._tail_lines))

    def _start_pump(self, name: str, target: Callable[..., None], *args: object) -> threading.Thread:
        pump = threading.Thread(target=target, args=args, name=f"hvdrun-output-{name}", daemon=True)
        pump.start()
        self._pumps.append(pump)
        return pump

    def failed_because_of_another_rank(self, rank: int, timeout_s: float = 1.0) -> bool:
        """Whether ``rank``'s runtime said its failure was a consequence (waits for its output to end)."""
        for pump in self._rank_pumps.get(rank, ()):
            pump.join(timeout_s)
        return rank in self._consequences

    def stderr_tail(self, rank: int) -> list[str]:
        """The last stderr lines of ``rank``, without terminators."""
        return [line.decode(errors="replace").rstrip("\r\n") for line in self._tails.get(rank, ())]

    def drain(self, timeout_s: float) -> None:
        """Wait until every stream reached EOF and was written out, ``timeout_s`` in all: a stream still open
        then is held by a process that outlived its rank, named in a warning and no longer waited for.

        The console gets half of ``timeout_s`` to take what is left; output it did not take by then (a reader
        that stopped reading) is dropped and counted, in one line (the log files get all of it).
        """
        deadline = time.monotonic() + timeout_s
        for console in self._console.values():
            console.give_up_at(deadline - timeout_s / 2)
        for pump in self._pumps:
            pump.join(max(deadline - time.monotonic(), 0.0))
        for ended in self._feeds.values():
            ended.wait(max(deadline - time.monotonic(), 0.0))
        held = [pump.name.removeprefix("hvdrun-output-") for pump in self._pumps if pump.is_alive()]
        held += [name for name, ended in self._feeds.items() if not ended.is_set()]
        if held:
            self.say(f"hvdrun: warning: not waiting for output still held open {timeout_s:g} s after the ranks "
                     f"ended (a process that outlived its rank?): {', '.join(held)}")
        for log in self._rank_logs.values():
            self._close_log(log)
        self._say_dropped()

    def _say_dropped(self) -> None:
        """One line per console stream that did not take all of the ranks' output."""
        for name, console in self._console.items():
            dropped = console.dropped()
            if dropped is not None:
                self.say(f"hvdrun: warning: the console's {name} stopped reading; {dropped} of the ranks' output "
                         f"not shown ({self._kept()})")

    def _kept(self) -> str:
        return (f"every rank's output is in {self.output_dir}" if self.output_dir else
                "--output-dir DIR keeps every rank's output in files")

    def _open_log(self, rank: int, stream: str) -> BinaryIO | None:
        if self.output_dir is None:
            return None
        folder = self.output_dir / rank_dir_name(rank, self.size)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return open(folder / stream, "wb")
        except OSError as e:
            self._warn_disk(rank, e)
            return None

    def _write_log(self, rank: int, log: BinaryIO, data: bytes) -> None:
        """Append to a rank's log file; a failing write (full disk) closes it, warns once, and is not fatal."""
        try:
            log.write(data)
            log.flush()
        except OSError as e:
            self._warn_disk(rank, e)
            self._close_log(log)

    def _close_log(self, log: BinaryIO | None) -> None:
        if log is None or log.closed:
            return
        try:
            log.close()
        except OSError:  # the unflushed rest could not be written: already warned, or warned now
            with contextlib.suppress(OSError, ValueError):
                log.close()

    def _warn_disk(self, rank: int, error: OSError) -> None:
        if not self._disk_warned:
            self._disk_warned = True
            self.say(f"hvdrun: warning: cannot write rank {rank}'s output to {self.output_dir}: "
                     f"{error.strerror or error}; the console still gets it")

    def say(self, line: str) -> None:
        """One line of hvdrun's own on the console's stderr, between whole lines of the ranks; it waits for the
        console :data:`~hvdrun.launch.console.SAY_WAIT_S` at most."""
        self._console["stderr"].write(line.encode() + b"\n", SAY_WAIT_S)

    def _pump(self, rank: int, stream: str, read: Callable[[], bytes], close: Callable[[], None],
              log: BinaryIO | None) -> None:
        splitter = LineSplitter()
        try:
            while data := read():
                self.last_output = time.monotonic()
                self._deliver(rank, stream, splitter.feed(data), log)
            self._deliver(rank, stream, splitter.close(), log)
        finally:
            close()
            self._close_log(log)

    def _pump_multiplexed(self, stream: str, fd: int, on_exit: Callable[[int, int], None],
                          on_own_line: Callable[[bytes], None]) -> None:
        splitter = LineSplitter(TAGGED_LINE_BYTES)
        try:
            while data := _read(fd):
                self.last_output = time.monotonic()
                for line in splitter.feed(data):
                    self._route_tagged(line, stream, on_exit, on_own_line)
            for line in splitter.close():
                self._route_tagged(line, stream, on_exit, on_own_line)
        finally:
            os.close(fd)

    def _route_tagged(self, line: bytes, stream: str, on_exit: Callable[[int, int], None],
                      on_own_line: Callable[[bytes], None] = lambda line: None) -> None:
        tagged = untag(line)
        if tagged is None or not 0 <= tagged.number < self.size or tagged.kind not in (*STREAMS, "exit"):
            on_own_line(line)
            self._write_console(stream, _with_newline(line))
        elif tagged.kind == "exit":
            on_exit(tagged.number, int(tagged.text.strip() or 0))
        else:
            self._deliver(tagged.number, tagged.kind, [tagged.text], self._log_for(tagged.number, tagged.kind))

    def _deliver(self, rank: int, stream: str, lines: list[bytes], log: BinaryIO | None) -> None:
        """One rank's lines to its log file and the console; the runtime's control lines are taken out."""
        if stream == "stderr" and any(line in self._markers for line in lines):
            now = time.time()
            for line in lines:
                marked = self._markers.get(line)
                if marked is not None:
                    marked.setdefault(rank, now)
            lines = [line for line in lines if line not in self._markers]
        if log and not log.closed and lines:
            self._write_log(rank, log, b"".join(lines))
        self._emit(rank, stream, lines)

    def _emit(self, rank: int, stream: str, lines: list[bytes]) -> None:
        if not lines:
            return
        if stream == "stderr":
            self._tails[rank].extend(line if len(line) <= _TAIL_LINE_BYTES else line[:_TAIL_LINE_BYTES] + b"..."
                                     for line in lines)
        if self.console_ranks is not None and rank not in self.console_ranks:
            return
        tag = f"[{rank}]<{stream}>:".encode() if self.prefix else b""
        if self.timestamp:
            tag = time.asctime().encode() + b" " + tag
        self._write_console(stream, b"".join(tag + _with_newline(line) for line in lines))

    def _write_console(self, stream: str, data: bytes) -> None:
        """The ranks' output to the console: it waits while the job runs (unless the console stalls), and until the
        drain gives up at its end. A stall is said once per stream, when it begins."""
        console = self._console[stream]
        console.write(data)
        if console.stalled and stream not in self._stalls_said:
            self._stalls_said.add(stream)
            self.say(f"hvdrun: warning: the console's {stream} took nothing for {console.stall_s:g} s: the ranks' "
                     f"output no longer waits for it until it reads again ({self._kept()}; "
                     "HVDRUN_CONSOLE_STALL_S=0 waits for ever)")


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, _READ_SIZE)
    except OSError:
        return b""
