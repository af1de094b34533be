"""Collective algorithms over channels between ranks.

- :mod:`~hvdrun.runtime.collectives.streams`: transfers, sinks and the progress loop they all use.
- :mod:`~hvdrun.runtime.collectives.ring`: the ring (reduce-scatter then all-gather), for large buffers
  and for every job's negotiation and alltoall.
- :mod:`~hvdrun.runtime.collectives.pairwise`: recursive doubling, recursive halving and doubling
  (Rabenseifner) and binomial trees, for small and medium buffers: log2(ranks) steps, not ranks - 1.
- :mod:`~hvdrun.runtime.collectives.hierarchical`: shared memory inside a host, one of the above
  across hosts, chosen by size (``HVDRUN_ALGORITHM`` and the crossover variables).

The reduction rules they apply live in :mod:`hvdrun.runtime.reduce`.
"""

from hvdrun.runtime.collectives.ring import Ring

__all__ = ["Ring"]
