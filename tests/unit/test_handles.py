"""A handle frees its op's name before it says it is done: a caller that polls ``done()`` (as the engine's
``drive_until`` does while another thread finishes the op) may submit the same name again at once."""

from __future__ import annotations

import threading
import time

from hvdrun.runtime.handles import Handle


class _TakenNames:
    """The two things a handle needs of the engine; ``release_name`` takes a while, as a contended lock can."""

    def __init__(self) -> None:
        self.taken = {"steady"}

    def drive_until(self, handle: Handle, timeout_s: float | None) -> None:
        while not handle.done():
            time.sleep(0.0001)

    def release_name(self, name: str) -> None:
        time.sleep(0.02)
        self.taken.discard(name)

    def name_seen(self, name: str, number: int) -> None:
        pass


def test_a_waiter_that_sees_done_finds_the_name_free() -> None:
    for _ in range(5):
        names = _TakenNames()
        names.taken.add("steady")
        handle = Handle(names, "steady")
        finisher = threading.Thread(target=handle.finish, args=(42,))
        finisher.start()
        assert handle.wait() == 42
        assert "steady" not in names.taken, "done() said so while the name was still taken"
        finisher.join()


def test_a_second_finish_changes_nothing() -> None:
    names = _TakenNames()
    handle = Handle(names, "steady")
    handle.finish(1)
    handle.finish(2, error=RuntimeError("late"))
    assert handle.wait() == 1
