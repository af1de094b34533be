"""``horovod.runner.util.threads``: ``in_thread``, which Horovod's test utilities (``test/utils/common.py``) import."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any


def in_thread(target: Callable[..., Any], args: Sequence[Any] = (), name: str | None = None, daemon: bool = True,
              silent: bool = False) -> threading.Thread:
    """Run ``target(*args)`` in a started thread and return the thread; ``silent`` swallows its exception."""

    def run() -> None:
        try:
            target(*args)
        except Exception:
            if not silent:
                raise

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


__all__ = ["in_thread"]
