"""The worker runtime: rendezvous, engine, ring transport and collectives on numpy buffers.

``hvdrun.torch`` builds Horovod's PyTorch API on top of this package; ``init()``,
``shutdown()`` and the topology calls live in :mod:`hvdrun.runtime.context`.
"""

from hvdrun.runtime.context import current, init, is_initialized, shutdown

__all__ = ["current", "init", "is_initialized", "shutdown"]
