"""``horovod.torch.optimizer``: :func:`hvdrun.torch.optimizer.DistributedOptimizer`."""

from hvdrun.torch.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
