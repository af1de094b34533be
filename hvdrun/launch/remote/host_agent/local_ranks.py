"""The ranks of one host, as its agent runs them (:mod:`hvdrun.launch.remote.host_agent.main`).

Each rank runs under its own guard, forked by the agent's fork server (:mod:`hvdrun.launch.remote.forkserver`),
with its own lifeline (a pipe whose write end only the agent holds: if the agent dies, even by SIGKILL, every
guard sees EOF and stops its rank), so every guarantee of ``guard.py`` holds as for a local rank. Every line a
rank writes goes up as a tagged line (:mod:`hvdrun.launch.remote.lines`), and ``[rank]<exit>:CODE`` after its
last line, once both of its streams ended and its guard reported the rank's status on its status pipe (CODE as
:attr:`subprocess.Popen.returncode`: negative for a signal). A guard that ended without reporting one was killed
(its rank with it: the rank's parent-death signal and the fork server): its own status, as the fork server
reports it, is the rank's, after a line that names the guard's death. A fork server that dies is named at once
on the stderr of one running rank; the running ranks go on, and their statuses still come from their guards.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from hvdrun.envvars import start_timeout_s
from hvdrun.errors import LaunchError
from hvdrun.launch.remote.forkserver import ForkServer, GuardStatus, describe_status
from hvdrun.launch.remote.host_agent.messages import DROP
from hvdrun.launch.remote.lines import LineSplitter, tag

_READ_BYTES = 1 << 20
_SETTLE_S = 2.0  # how long a rank's exit waits for its streams to end (a process that outlived it holds them)


@dataclass
class _Rank:
    rank: int
    lifeline: int
    status: GuardStatus
    streams_open: int = 2
    pid: int | None = None
    guard: int | None = None  # the guard's own status, from the fork server
    said: int | None = None  # the rank's status, from its guard's status pipe
    code: int | None = None
    reported: bool = False


class HostRanks:
    """Starts this host's ranks and sends their output and exit codes up.

    Args:
        up: writes bytes (whole tagged lines) up the agent's channel.
        where: this host's name, for messages.
    """

    def __init__(self, up: Callable[[bytes], None], where: str) -> None:
        self._up, self.where = up, where
        self._ranks: dict[int, _Rank] = {}
        self._by_pid: dict[int, _Rank] = {}
        self._lock = threading.Lock()
        self.server: ForkServer | None = None

    def start(self, entries: Iterable[tuple[int, Sequence[str], dict[str, str], str]],
              login_env: dict[str, str]) -> None:
        """Start every ``(rank, guard_argv, env, cwd)`` of a plan, with ``env`` on top of ``login_env``, within the
        job's start timeout (a preload stuck in an import: the fork server is stopped and each rank's error says
        so)."""
        assert self.server is not None
        deadline: float | None = None
        overdue: LaunchError | None = None
        for rank, guard_argv, env, cwd in entries:
            deadline = deadline or time.monotonic() + start_timeout_s(env)
            try:
                if overdue is not None:  # the server was stopped: every rank left gets the same error
                    raise overdue
                self._start(rank, guard_argv, {**login_env, **env}, cwd, deadline)
            except LaunchError as e:
                if overdue is None and time.monotonic() > deadline:
                    overdue = e
                    self.server.close()  # stuck: killed (its requests are unanswered), so no late guard starts
                self._up(tag(rank, "stderr", f"hvdrun: error: {e}\n".encode()) + tag(rank, "exit", b"1\n"))

    def _start(self, rank: int, guard_argv: Sequence[str], env: dict[str, str], cwd: str, deadline: float) -> None:
        assert self.server is not None
        pipes = self.server.start_guard(guard_argv, env, cwd, rank)
        state = _Rank(rank, pipes.lifeline, GuardStatus(pipes.status))
        with self._lock:
            self._ranks[rank] = state
        for stream, fd in (("stdout", pipes.stdout), ("stderr", pipes.stderr)):
            threading.Thread(target=self._pump, args=(state, stream, fd), daemon=True,
                             name=f"hvdrun-rank-{rank}-{stream}").start()
        threading.Thread(target=self._watch_status, args=(state,), daemon=True,
                         name=f"hvdrun-rank-{rank}-status").start()
        self._started(state, pipes.request, deadline)

    def _started(self, state: _Rank, request: int, deadline: float) -> None:
        """Learn the guard's pid (the server's answer, by ``deadline``); an exit reported before that is taken now."""
        assert self.server is not None
        try:
            pid = self.server.pid_of(request, state.rank, deadline)
        except LaunchError:
            with self._lock:
                state.reported = True  # start() reports it
                self._close_lifeline(state)
            raise
        with self._lock:
            state.pid = pid
            self._by_pid[pid] = state
            early = self.server.exited.get(pid)
        if early is not None:
            self.on_exit(pid, early)

    def _pump(self, state: _Rank, stream: str, fd: int) -> None:
        splitter = LineSplitter()
        while data := _read(fd):
            self._up(b"".join(tag(state.rank, stream, line) for line in splitter.feed(data)))
        self._up(b"".join(tag(state.rank, stream, line) for line in splitter.close()))
        os.close(fd)
        with self._lock:
            state.streams_open -= 1
        self._report_if_done(state)

    def _watch_status(self, state: _Rank) -> None:
        said = state.status.read(block=True)
        with self._lock:
            state.said = said
        self._resolve(state)

    def on_exit(self, pid: int, code: int) -> None:
        """The fork server says a guard ended (from its reader thread)."""
        with self._lock:
            state = self._by_pid.get(pid)
            if state is None:  # before pid_of() returned: start() looks again
                return
            state.guard = code
        self._resolve(state)

    def on_gone(self, death: str) -> None:
        """The fork server died (from its reader thread): one line, on the stderr of the first running rank."""
        with self._lock:
            running = [state.rank for state in self._ranks.values() if state.code is None]
        if running:
            self._up(tag(min(running), "stderr", f"hvdrun: warning: {death}; the running ranks go on (their guards "
                                                 f"report how they end), but no new rank can start here\n".encode()))
        for state in list(self._ranks.values()):
            self._resolve(state)

    def _resolve(self, state: _Rank) -> None:
        """Settle the rank's status once its guard ended: the one it reported, else the guard's own (then a line
        names the guard's death), else 1 when the fork server that would say is gone."""
        assert self.server is not None
        with self._lock:
            if state.code is not None or not state.status.ended:
                return
            if state.said is None and state.guard is None and not self.server.gone:
                return  # the fork server's word on the guard is on its way
            state.code = state.said if state.said is not None else state.guard if state.guard is not None else 1
            lost = state.said is None and (state.guard is None or state.guard < 0)
        if lost:
            how = describe_status(state.guard) if state.guard is not None else "ended without a word while " \
                "hvdrun's fork server that would say how was gone"
            self._up(tag(state.rank, "stderr", f"hvdrun: error: rank {state.rank}'s guard (pid {state.pid}) on "
                                               f"{self.where} {how}; its rank was stopped\n".encode()))
        self._report_if_done(state)
        threading.Timer(_SETTLE_S, self._report, args=(state,)).start()

    def _report_if_done(self, state: _Rank) -> None:
        if state.streams_open == 0 and state.code is not None:
            self._report(state)
        elif state.streams_open == 0:
            threading.Timer(_SETTLE_S, self._report_unknown, args=(state,)).start()

    def _report_unknown(self, state: _Rank) -> None:
        """A rank whose streams ended long ago: settle its status if it can be (a fork server that went away)."""
        self._resolve(state)

    def _report(self, state: _Rank) -> None:
        """``[rank]<exit>:CODE``, once; the lifeline is closed (a later signal finds nothing to reach)."""
        with self._lock:
            if state.reported or state.code is None:
                return
            state.reported = True
            self._close_lifeline(state)
        self._up(tag(state.rank, "exit", f"{state.code}\n".encode()))

    def signal(self, ranks: Sequence[int] | None, code: int) -> None:
        """Write ``code`` to the lifelines of ``ranks`` (None: every rank), or close them (:data:`DROP`)."""
        with self._lock:
            chosen = list(self._ranks.values()) if ranks is None else [self._ranks[r] for r in ranks
                                                                      if r in self._ranks]
            for state in chosen:
                if code == DROP:
                    self._close_lifeline(state)
                elif state.lifeline >= 0:
                    try:
                        os.write(state.lifeline, bytes([code]))
                    except OSError:
                        pass  # the guard is gone: nothing left to signal

    @staticmethod
    def _close_lifeline(state: _Rank) -> None:
        if state.lifeline >= 0:
            os.close(state.lifeline)
            state.lifeline = -1


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, _READ_BYTES)
    except OSError:
        return b""
