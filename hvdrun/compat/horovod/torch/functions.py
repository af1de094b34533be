"""``horovod.torch.functions``: :mod:`hvdrun.torch.functions`' parameter, optimizer-state and object helpers."""

from hvdrun.torch.functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]
