"""``horovod.torch.sync_batch_norm``: :class:`hvdrun.torch.sync_batch_norm.SyncBatchNorm`."""

from hvdrun.torch.sync_batch_norm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
