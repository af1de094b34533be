"""A rank of :func:`hvdrun.run`: ``python -m hvdrun.launch.remote.task`` calls the function the launcher sent.

The function, its arguments and keyword arguments arrive pickled (cloudpickle when installed, so
lambdas and closures travel too) and base64-encoded in :data:`TASK_VAR`; the return value goes back
on stdout as one line that starts with :data:`RESULT_MARK`, which the launcher takes out of the output.
"""

from __future__ import annotations

import base64
import pickle
import sys
from typing import Any

from hvdrun import envvars

TASK_VAR = envvars.TASK
RESULT_MARK = "\x1ehvdrun:result:"


def dumps(obj: Any) -> str:
    """base64 of the pickle of ``obj`` (cloudpickle when available)."""
    try:
        import cloudpickle

        data = cloudpickle.dumps(obj)
    except ImportError:
        data = pickle.dumps(obj)
    return base64.b64encode(data).decode()


def loads(text: str) -> Any:
    """The object :func:`dumps` encoded."""
    return pickle.loads(base64.b64decode(text))


def main() -> None:
    """Run the task of this rank and print its result line."""
    import os

    fn, args, kwargs = loads(os.environ.pop(TASK_VAR))
    result = fn(*args, **kwargs)
    sys.stdout.flush()
    sys.stdout.write(f"{RESULT_MARK}{dumps(result)}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
