"""Horovod's Adasum in float64 NumPy, written apart from hvdrun's (:mod:`hvdrun.torch.adasum`): the workers'
reference for ``op=hvd.Adasum``."""

from __future__ import annotations

import numpy as np


def reference_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Adasum of two vectors: orthogonal ones add up, parallel ones average (a zero vector keeps coefficient 1)."""
    dot, a_sq, b_sq = np.dot(a, b), np.dot(a, a), np.dot(b, b)
    return (1 - dot / (2 * a_sq) if a_sq else 1.0) * a + (1 - dot / (2 * b_sq) if b_sq else 1.0) * b


def reference(vectors: list[np.ndarray]) -> np.ndarray:
    """Distance doubling: at level l, rank i (a multiple of 2^(l+1)) absorbs rank i + 2^l; a partner past the
    end (non power-of-two counts) leaves rank i's value as it is."""
    values = [np.asarray(v, np.float64).ravel() for v in vectors]
    distance = 1
    while distance < len(values):
        for i in range(0, len(values), 2 * distance):
            if i + distance < len(values):
                values[i] = reference_pair(values[i], values[i + distance])
        distance *= 2
    return values[0]
