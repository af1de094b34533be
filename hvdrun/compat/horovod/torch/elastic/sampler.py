"""``horovod.torch.elastic.sampler``: :class:`hvdrun.torch.elastic.ElasticSampler`."""

from hvdrun.torch.elastic import ElasticSampler

__all__ = ["ElasticSampler"]
