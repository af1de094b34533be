"""``horovod.torch.elastic.state``: :class:`hvdrun.torch.elastic.TorchState`."""

from hvdrun.torch.elastic import TorchState

__all__ = ["TorchState"]
