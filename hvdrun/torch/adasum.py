"""Adasum's arithmetic (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021).

Two gradients ``a`` and ``b`` combine as ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``: orthogonal
gradients add up, parallel ones average, and everything in between is a mix. Ranks combine in a
binary tree over rank order ((0,1), (2,3), then those results, ...), which is what Horovod's
recursive halving computes for a power-of-two number of ranks. For other counts, hvdrun extends the
tree the natural way: at each level an unpaired last value moves up unchanged (3 ranks:
``adasum(adasum(g0, g1), g2)``). Sums run in float64 whatever the tensor's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# below this squared norm a vector counts as zero and keeps coefficient 1 (Horovod uses sqrt(DBL_MIN))
_TINY_NORM_SQ = float(np.sqrt(np.finfo(np.float64).tiny))


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Adasum of two flat float64 vectors."""
    dot, a_sq, b_sq = float(a @ b), float(a @ a), float(b @ b)
    a_coeff = 1.0 - dot / a_sq * 0.5 if a_sq >= _TINY_NORM_SQ else 1.0
    b_coeff = 1.0 - dot / b_sq * 0.5 if b_sq >= _TINY_NORM_SQ else 1.0
    return a_coeff * a + b_coeff * b


def tree(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Adasum of every rank's vector (index = rank), combined pairwise level by level."""
    level = [np.asarray(v, dtype=np.float64) for v in vectors]
    while len(level) > 1:
        paired = [combine(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = paired + ([level[-1]] if len(level) % 2 else [])
    return level[0]
