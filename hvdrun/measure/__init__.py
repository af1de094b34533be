"""What ``hvdrun check`` and ``hvdrun bench`` (and ``benchmarks/``) share to measure collectives.

- :mod:`timing`: warm-up, batches, medians, bus bandwidth, and byte sizes (``4K`` in, ``4 KB`` out);
- :mod:`capture`: run a job whose ranks' output is read, not shown.
"""
