"""``horovod.torch.elastic`` (``hvd.elastic``): every name of :mod:`hvdrun.torch.elastic`.

Horovod's package exports ``run``, ``TorchState`` and ``ElasticSampler``; hvdrun's module adds the
state base classes and the two exceptions the loop handles, kept here so ``hvd.elastic`` is unchanged.
"""

from hvdrun.torch.elastic import (
    ElasticSampler,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    TorchState,
    run,
)

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState",
           "run"]
