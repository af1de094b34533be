"""Which torch dtypes each collective takes on the CPU path, and how they travel as numpy buffers.

hvdrun's CPU backends (the ring over shared memory or TCP, the fast lane, gloo, MPI) work on numpy
arrays, and numpy has no bfloat16. So:

* **Reductions of float16 and bfloat16 are accumulated in float32 and rounded once**: the tensor is
  widened to a float32 copy, reduced (and scaled) there, and written back with one rounding. The
  result is the float64 reference rounded once wherever the float32 sum is exact (a handful of
  ranks, values of similar magnitude), within one rounding of it otherwise; a float16 ring that
  rounds at every step drifts by up to (ranks - 1) roundings.
* **bfloat16 moves as its 16 bits** (allgather, broadcast, alltoall): an int16 view, viewed back.
* **bool reduces with Min (logical and) and Max (logical or)**, as its bytes (uint8); a sum, product or
  average of booleans means nothing and is refused.

Every request also carries the tensor's own dtype (``Request.source`` where it differs from the wire
dtype), so ranks that pass different dtypes get the usual mismatch error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hvdrun.runtime.reduce import MAX, MIN, OP_NAMES

REDUCTION_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool")
MOVEMENT_DTYPES = REDUCTION_DTYPES
WIDENED = frozenset((torch.float16, torch.bfloat16))  # reduced as float32, rounded once
_AS_BITS = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}  # how numpy carries what it lacks
_NAMES = {getattr(torch, name): name for name in MOVEMENT_DTYPES}
_WIRE_NAMES = {np.dtype(name): name for name in ("uint8", "int8", "int16", "int32", "int64", "float16", "float32",
                                                 "float64", "bool")}


def name_of(dtype: torch.dtype) -> str | None:
    """``float32`` for ``torch.float32``; None for a dtype no collective takes."""
    return _NAMES.get(dtype)


def wire_name(array: np.ndarray) -> str:
    """The numpy dtype name of a wire buffer (a dict lookup: ``np.dtype.name`` is slow on hot paths)."""
    return _WIRE_NAMES[array.dtype]


def wire_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor's memory (bfloat16 as int16 bits, bool as uint8)."""
    base = tensor.detach()
    bits = _AS_BITS.get(base.dtype)
    return (base.view(bits) if bits is not None else base).numpy()


def source_of(tensor: torch.Tensor, array: Any) -> str:
    """The tensor's dtype name where it differs from the wire buffer's, else ``""``."""
    if not isinstance(array, np.ndarray):  # the device path carries the tensor itself
        return ""
    name = _NAMES.get(tensor.dtype, "")
    return name if name != _WIRE_NAMES.get(array.dtype) else ""


def widened(tensor: torch.Tensor) -> torch.Tensor | None:
    """A float32 copy of a float16/bfloat16 CPU tensor to reduce in its place, else None."""
    return tensor.detach().float() if tensor.dtype in WIDENED and tensor.is_cpu else None


def check_reduction(tensor: torch.Tensor, op: int) -> None:
    """bool tensors reduce only with Min or Max (ValueError otherwise)."""
    if tensor.dtype == torch.bool and op not in (MIN, MAX):
        raise ValueError(f"a bool tensor reduces with Min (logical and) or Max (logical or), not "
                         f"{OP_NAMES.get(op, op)}")


def from_wire(source: str) -> Callable[[Any], torch.Tensor]:
    """Turns a collective's numpy result back into a tensor of the caller's dtype."""
    bits_of = getattr(torch, source) if source in ("bfloat16", "bool") else None

    def convert(result: Any) -> torch.Tensor:
        tensor = result if isinstance(result, torch.Tensor) else torch.from_numpy(result)
        return tensor.view(bits_of) if bits_of is not None and tensor.dtype != bits_of else tensor

    return convert
