"""``horovod.common.exceptions``: Horovod's exceptions are hvdrun's own classes.

``HorovodInternalError`` is :class:`hvdrun.errors.CollectiveError` (a ``RuntimeError``), so an ``except``
clause written against either name catches what the other raises. ``HostsUpdatedInterrupt`` is
:class:`hvdrun.errors.HostsUpdatedInterrupt`, which :mod:`hvdrun.torch.elastic` raises (no torch is loaded here).
"""

from hvdrun.errors import CollectiveError as HorovodInternalError
from hvdrun.errors import HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
