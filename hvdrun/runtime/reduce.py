"""Reduction rules: Horovod's op codes, the element-wise functions, scaling, and the buffer arithmetic.

Every part of the runtime that reduces (the engine's executors, the fast lane, the device path, the
ring and the other collective algorithms) takes its rules from here, so that each rule is written
once:

* an op code (``AVERAGE``, ``SUM``, ...) maps to one numpy function in :data:`REDUCE_FNS`;
* *Average is a sum followed by a division by the number of ranks of the op's set*
  (:func:`average_divisor`, folded into the postscale factor by :func:`final_factor`), applied after
  the reduction, as Horovod does;
* scaling follows Horovod's arithmetic (:func:`scale`): integers through float64, float16 through
  float32, so ``prescale``/``postscale`` factors never overflow a narrow type;
* a buffer is cut into ``parts`` chunks whose sizes differ by at most one element
  (:func:`chunk_bounds`), and transfers are padded to 8 bytes (:func:`padded`);
* an alltoall given no splits sends every rank an equal share of rows (:func:`default_splits`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

# inf - inf and overflow are values of a reduction (NaN, inf), as in torch, not something to warn about
warnings.filterwarnings("ignore", r"(invalid value|overflow) encountered", RuntimeWarning, r"hvdrun\.runtime\.")

# Horovod's op codes
AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT = 0, 1, 2, 3, 4, 5
OP_NAMES = {AVERAGE: "Average", SUM: "Sum", ADASUM: "Adasum", MIN: "Min", MAX: "Max", PRODUCT: "Product"}
REDUCE_FNS = {AVERAGE: np.add, SUM: np.add, MIN: np.minimum, MAX: np.maximum, PRODUCT: np.multiply}

REDUCTION_DTYPES = ("int32", "int64", "float16", "float32", "float64")
MOVEMENT_DTYPES = REDUCTION_DTYPES + ("uint8", "int8", "int16", "bool")

# a numpy ufunc: fn(a, b, out=a), the output by keyword (numpy 2 deprecates it by position for minimum and maximum)
ReduceFn = Callable[..., object]


def average_divisor(op: int, set_size: int) -> int | None:
    """What the reduction's result is divided by: the op's set size for Average, None for every other op."""
    return set_size if op == AVERAGE else None


def final_factor(op: int, postscale: float, set_size: int) -> float:
    """The factor applied after the reduction: ``postscale``, divided by :func:`average_divisor` for Average."""
    divisor = average_divisor(op, set_size)
    return postscale if divisor is None else postscale / divisor


def scale(buffer: np.ndarray, factor: float) -> None:
    """Multiply in place: integers through float64, float16 through float32 (Horovod's rules)."""
    if factor == 1.0 or buffer.size == 0:
        return
    if buffer.dtype in (np.float32, np.float64):
        np.multiply(buffer, factor, out=buffer)
    elif buffer.dtype == np.float16:
        buffer[...] = (buffer.astype(np.float32) * factor).astype(np.float16)
    else:
        buffer[...] = (buffer.astype(np.float64) * factor).astype(buffer.dtype)


def scale_tensor(tensor: Any, factor: float) -> None:
    """:func:`scale` for a torch tensor, on its own device: integers through float64, float16 through float32."""
    import torch

    if factor == 1.0:
        return
    if tensor.dtype in (torch.float32, torch.float64, torch.bfloat16):
        tensor.mul_(factor)
    elif tensor.dtype == torch.float16:
        tensor.copy_((tensor.float() * factor).half())
    else:
        tensor.copy_((tensor.double() * factor).to(tensor.dtype))


def identity(op: int, dtype: np.dtype) -> float | int:
    """The element that leaves a reduction by ``op`` unchanged (what a rank outside the op contributes)."""
    if op in (AVERAGE, SUM):
        return 0
    if op == PRODUCT:
        return 1
    limits = np.finfo(dtype) if dtype.kind == "f" else np.iinfo(dtype)
    return limits.max if op == MIN else limits.min


def reduce_in_rank_order(contributions: list[np.ndarray], out: np.ndarray, op: int) -> None:
    """``out`` = every contribution combined by ``op``, in rank order, so every rank gets identical bits.

    ``out`` may be one of the contributions' memory only if it is the first one.
    """
    combine = REDUCE_FNS[op]
    combine(contributions[0], contributions[1], out=out)
    for contribution in contributions[2:]:
        combine(out, contribution, out=out)


def padded(length: int) -> int:
    """``length`` rounded up to a multiple of 8."""
    return (length + 7) & ~7


def as_bytes(array: np.ndarray) -> memoryview:
    """A byte view of a contiguous array (no copy)."""
    return array.data.cast("B") if array.size else memoryview(bytearray())


def default_splits(rows: int, parts: int) -> list[int]:
    """An alltoall's splits when none are given: ``rows // parts`` rows to each of the ``parts`` ranks."""
    return [rows // parts] * parts


def chunk_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``count`` elements into ``parts`` ranges; the first ``count % parts`` get one more."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
