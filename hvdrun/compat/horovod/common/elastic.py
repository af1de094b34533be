"""``horovod.common.elastic``: the state base classes of :mod:`hvdrun.torch.elastic` and Horovod's ``run_fn``."""

from collections.abc import Callable
from typing import Any

from hvdrun.torch.elastic import ObjectState, State, run


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Horovod's elastic loop around ``func(state, ...)``: here :func:`hvdrun.torch.elastic.run`.

    Args:
        func: the training function; its first argument is a :class:`State`.
        reset: not called: hvdrun re-forms the job itself (``shutdown()`` then ``init()``, which is
            what Horovod's framework bindings pass here).
    """
    return run(func)


__all__ = ["ObjectState", "State", "run_fn"]
