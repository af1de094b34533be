"""The worker runtime: rendezvous, engine, ring transport and collectives on numpy buffers.

``hvdrun.torch`` builds Horovod's PyTorch API on top of this package; ``init()``,
``shutdown()`` and the topology calls live in :mod:`hvdrun.runtime.context`, loaded on first use
(so that importing a module of this package, or what the launcher shares with the workers in
:mod:`hvdrun.protocol`, does not load the whole runtime and numpy).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hvdrun.runtime.context import current, init, is_initialized, shutdown

__all__ = ["current", "init", "is_initialized", "shutdown"]


def __getattr__(name: str) -> Any:
    """``init``, ``shutdown``, ``current`` and ``is_initialized`` of :mod:`hvdrun.runtime.context`."""
    if name in __all__:
        return getattr(importlib.import_module("hvdrun.runtime.context"), name)
    raise AttributeError(f"module 'hvdrun.runtime' has no attribute {name!r}")
