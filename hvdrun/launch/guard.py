"""Per-worker guard: ``python guard.py GRACE_S [--signal-as-code] -- COMMAND...``. Standard library only.

The guard leads a process group (and session) that holds the worker and everything the
worker starts. Its standard input is a *lifeline* from hvdrun (a pipe, or an SSH channel):

* one byte ``T`` on the lifeline sends SIGTERM to the group, ``K`` SIGKILLs every other
  process of the group (the guard stays to report the worker's status): that is how hvdrun
  signals a rank on another host, where sshd refuses signal requests for root;
* when the lifeline reaches EOF (hvdrun died, even by SIGKILL, or the connection dropped)
  or the guard gets SIGHUP, it sends SIGTERM to its group, waits up to GRACE_S seconds
  and then SIGKILLs the group, itself included;
* SIGTERM / SIGINT sent to the group reach the worker directly; the guard survives them
  so that it can report the worker's status;
* when the worker ends, whatever it left in the group is killed; the guard exits with the
  worker's exit code, or dies of the same signal the worker died of. With
  ``--signal-as-code`` it exits with ``128 + N`` instead (SSH clients lose exit signals).

The worker's stdin is /dev/null; stdout and stderr are inherited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
TERMINATE, KILL = b"T", b"K"


def _kill_group(grace_s: float, worker: subprocess.Popen[bytes]) -> None:
    """SIGTERM the whole group, wait for the worker up to ``grace_s``, then SIGKILL the group."""
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(0, signal.SIGKILL)


def _kill_others() -> None:
    """SIGKILL every process of our group but the guard itself (Linux: read from /proc)."""
    me, group = os.getpid(), os.getpgrp()
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if pid != me and int(fields[2]) == group:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _watch_lifeline(grace_s: float, worker: subprocess.Popen[bytes]) -> None:
    while True:
        try:
            data = os.read(0, 4096)
        except OSError:
            data = b""
        if not data:
            _kill_group(grace_s, worker)
            return
        if KILL in data:
            _kill_others()
        elif TERMINATE in data:
            os.killpg(0, signal.SIGTERM)


def _exit_like(returncode: int, signal_as_code: bool) -> None:
    if returncode >= 0:
        sys.exit(returncode)
    signum = -returncode
    if signal_as_code:
        sys.exit(128 + signum)
    if signum not in (signal.SIGKILL, signal.SIGSTOP):  # their handlers cannot be changed
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    sys.exit(128 + signum)


def main(argv: list[str]) -> None:
    """Run the guard; ``argv`` is ``[GRACE_S, ["--signal-as-code"], "--", COMMAND...]``."""
    signal_as_code = len(argv) > 1 and argv[1] == "--signal-as-code"
    if signal_as_code:
        argv = [argv[0], *argv[2:]]
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("usage: guard.py GRACE_S [--signal-as-code] -- COMMAND...\n")
        sys.exit(2)
    grace_s = float(argv[0])
    if os.getpgid(0) != os.getpid():
        os.setsid()
    for signum in _STOP_SIGNALS:
        signal.signal(signum, lambda *_: None)
    try:
        worker = subprocess.Popen(argv[2:], stdin=subprocess.DEVNULL)
    except OSError as e:
        sys.stderr.write(f"hvdrun: cannot start {argv[2]!r}: {e.strerror}\n")
        sys.exit(127)
    signal.signal(signal.SIGHUP, lambda *_: _kill_group(grace_s, worker))
    threading.Thread(target=_watch_lifeline, args=(grace_s, worker), daemon=True).start()
    returncode = worker.wait()
    _kill_others()
    _exit_like(returncode, signal_as_code)


if __name__ == "__main__":
    main(sys.argv[1:])
