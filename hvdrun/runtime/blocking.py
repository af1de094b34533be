"""The runtime's door for a blocking allreduce of the whole job: the paths that skip the engine's queue.

Cheapest first: the fast lane (a numpy buffer, every rank on this host, :mod:`hvdrun.runtime.lane`), then an
express cycle (a numpy buffer or a device tensor, :meth:`hvdrun.runtime.engine.Engine.express_allreduce`). When
neither takes the op, the caller queues it with :meth:`~hvdrun.runtime.engine.Engine.run`. The API above the
runtime (``hvdrun.torch``) calls this one function and never chooses between the runtime's paths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hvdrun.runtime.lane import try_allreduce
from hvdrun.runtime.negotiation import Request

if TYPE_CHECKING:
    from hvdrun.runtime.engine import Engine

ExpressRequest = Callable[[Any, str, int, float, float], Request]


def allreduce_unqueued(engine: Engine, buffer: Any, name: str, op: int, prescale: float, postscale: float,
                       express_request: ExpressRequest | None) -> bool:
    """Reduce ``buffer`` in place across the whole job without the engine's queue, when a path takes it.

    Args:
        engine: this rank's engine.
        buffer: a numpy array (the lane, then an express cycle) or a device tensor (an express cycle).
        name: the op's name, the same on whichever path takes it.
        express_request: makes the request of an express cycle from ``(buffer, name, op, prescale, postscale)``;
            None: no express cycle (a barrier's token).

    Returns:
        True: ``buffer`` holds the result. False: no path took it; queue it under the same ``name``.
    """
    if isinstance(buffer, np.ndarray) and try_allreduce(engine, buffer, name, op, prescale, postscale):
        return True
    if express_request is None or not engine.express:
        return False
    waiting = engine.recorder.wait_begins()
    try:
        return engine.express_allreduce(express_request(buffer, name, op, prescale, postscale), buffer)
    finally:
        engine.recorder.wait_ends(waiting)
