"""Per-worker guard: ``python guard.py GRACE_S -- COMMAND...``. Standard library only.

The guard leads a process group (and session) that holds the worker and everything the
worker starts. Its standard input is a *lifeline* pipe from hvdrun (or the SSH channel):

* when the lifeline reaches EOF (hvdrun died, even by SIGKILL, or the connection dropped)
  or the guard gets SIGHUP, it sends SIGTERM to its group, waits up to GRACE_S seconds
  and then SIGKILLs the group, itself included;
* SIGTERM / SIGINT sent to the group reach the worker directly; the guard survives them
  so that it can report the worker's status;
* it exits with the worker's exit code, or dies of the same signal the worker died of.

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


def _kill_group(grace_s: float, worker: subprocess.Popen[bytes]) -> None:
    """SIGTERM the whole group, wait for the worker up to ``grace_s``, then SIGKILL the group."""
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(0, signal.SIGKILL)


def _watch_lifeline(grace_s: float, worker: subprocess.Popen[bytes]) -> None:
    while True:
        try:
            data = os.read(0, 4096)
        except OSError:
            data = b""
        if not data:
            _kill_group(grace_s, worker)
            return


def _exit_like(returncode: int) -> None:
    if returncode >= 0:
        sys.exit(returncode)
    signum = -returncode
    if signum not in (signal.SIGKILL, signal.SIGSTOP):  # their handlers cannot be changed
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    sys.exit(128 + signum)


def main(argv: list[str]) -> None:
    """Run the guard; ``argv`` is ``[GRACE_S, "--", COMMAND...]``."""
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("usage: guard.py GRACE_S -- COMMAND...\n")
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
    _exit_like(worker.wait())


if __name__ == "__main__":
    main(sys.argv[1:])
