"""The background thread of a rank's progress loop (``hvdrun/runtime/progress.py``) starts no cycle once the
job's shutdown completed, even one it was waiting to start when a caller's thread ran the shutdown: that cycle
would wait for peers that left (with MPI, a 30 s stall and then a crash in MPI_Finalize)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from hvdrun.runtime.progress import ProgressLoop


class _ShutdownWhileWaiting:
    """The progress lock, taken by the background thread only after a caller's cycle completed the shutdown."""

    def __init__(self, ledger: SimpleNamespace) -> None:
        self.ledger, self._lock = ledger, threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if blocking and timeout > 0:  # the background thread's wait for a caller's cycle
            self.ledger.stopped = True
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()


def test_no_cycle_starts_after_the_shutdown_completed_on_a_callers_thread():
    ledger = SimpleNamespace(lock=threading.Lock(), stopped=False, async_new=False, new=[],
                             take_new=lambda confirm_s: ([], []))
    runs: list[int] = []
    cycle = SimpleNamespace(run=lambda new, waiting: runs.append(1), flush_due=lambda: False)
    backend = SimpleNamespace(lane=None, world=SimpleNamespace(rank=1), wakeable=False, peer_waiting=lambda: False,
                              idle_wait=lambda fds: None)
    failures: list[str] = []
    loop = ProgressLoop(backend, ledger, cycle, 0.0, failures.append, failures.append,  # type: ignore[arg-type]
                        lambda: None)
    loop._progress = _ShutdownWhileWaiting(ledger)  # type: ignore[assignment]
    loop.start()
    loop._thread.join(10)
    assert not loop._thread.is_alive() and not failures
    assert runs == [], "a cycle ran after the shutdown completed"
    loop.stop(1)
