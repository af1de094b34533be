"""Every rank's stack on demand, from the launcher: Ctrl-\\ (SIGQUIT) to hvdrun, or ``hvdrun stacks [JOB]``.

The launcher asks rank 0's rendezvous for every rank's report (see :mod:`hvdrun.runtime.rendezvous`,
authenticated with the job's secret) and prints them folded (:func:`hvdrun.protocol.inspection.format_reports`);
the job goes on. So that ``hvdrun stacks`` can find a job from another shell, each running job is
registered (:mod:`hvdrun.launch.registry`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

from hvdrun.envvars import Rendezvous
from hvdrun.errors import RendezvousError
from hvdrun.interrupts import Wakeup
from hvdrun.launch.registry import register, unregister
from hvdrun.protocol.inspection import INSPECT, SIGNAL, STACKS, ask_rank0, format_reports

# rank 0 did not answer: the job ended or has not reached init(), a port now served by another job
NO_ANSWER = (OSError, ValueError, EOFError, RendezvousError)


def fetch_report(addr: str, port: int, secret: str) -> str:
    """Every rank's report of the job whose rank 0 serves ``addr:port``, folded into text.

    Raises:
        OSError: rank 0 cannot be reached (the job ended, or has not started its rendezvous yet).
        RendezvousError: rank 0 refused the secret (another job now serves that port).
    """
    _, reports, absent, size = ask_rank0(addr, port, secret, (INSPECT, STACKS))
    return format_reports(reports, size, dict(absent))


def signal_ranks(rendezvous: Rendezvous, signum: int) -> int:
    """Have rank 0 pass ``signum`` to every rank's process over the control connections (where the launcher
    cannot: MPICH's mpiexec dies of SIGUSR1); the number of ranks reached, 0 when rank 0 does not answer."""
    try:
        _, reached = ask_rank0(rendezvous.addr, rendezvous.port, rendezvous.secret, (SIGNAL, signum))
        return int(reached)
    except NO_ANSWER:
        return 0


def print_stacks(rendezvous: Rendezvous, write: Callable[[str], None]) -> None:
    """Print every rank's report of the running job, or one line saying why there is none."""
    try:
        text = fetch_report(rendezvous.addr, rendezvous.port, rendezvous.secret)
    except NO_ANSWER as e:
        text = (f"hvdrun: no stacks: rank 0's rendezvous at {rendezvous.addr}:{rendezvous.port} did not answer "
                f"({e}); the ranks may not have reached init() yet")
    write(text + "\n")


@contextlib.contextmanager
def stacks_on_demand(rendezvous: Rendezvous, size: int, write: Callable[[str], None]) -> Iterator[None]:
    """While the job runs: Ctrl-\\ prints every rank's stacks (in a thread: supervision goes on), and the job
    is registered for ``hvdrun stacks``."""
    asked, done = Wakeup(), threading.Event()  # the handler only wakes the printer: no lock, no thread start

    def printer() -> None:  # sleeps until Ctrl-\ or the job's end wakes it
        while asked.wait(None) and not done.is_set():
            print_stacks(rendezvous, write)

    registered = register(rendezvous, size)
    thread, previous = threading.Thread(target=printer, name="hvdrun-stacks", daemon=True), None
    if threading.current_thread() is threading.main_thread():
        thread.start()
        previous = signal.signal(signal.SIGQUIT, lambda signum, frame: asked.set())
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGQUIT, previous)
        done.set()
        asked.set()
        if thread.is_alive():
            thread.join(1.0)
        if not thread.is_alive():  # else it is still printing: its pipe stays open with it
            asked.close()
        unregister(registered)
