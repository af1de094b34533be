"""Gradient buckets: DistributedOptimizer's gradients reduced during backward, a bucket at a time (DDP's buckets,
Horovod's fusion buffer).

With overlap on (device parameters), a gradient used to go out alone the moment its hook fired: one engine op, one
negotiation and one collective per tensor. Instead, parameters are laid out once into buckets in the order backward
produces their gradients (the reverse of registration, as DDP assumes), one dtype and device per bucket, up to a cap:
the first bucket small (1 MiB, so communication starts early), the others up to the fusion threshold (at most 25 MiB,
DDP's default, so that backward still has work to overlap). When every gradient of a bucket has fired, it is copied
into the bucket's flat buffer, cast on the way when fp16 compression applies, and the buffer goes out as one
``allreduce_async_``; ``synchronize()`` copies the reduced buffer back into the gradients (cast back), one
``_foreach_copy_`` a bucket.

A Python hook costs about 6 µs a call (200 parameters: over a millisecond a step, where DDP's hooks are C++). Once
a step has shown in which order backward reaches a bucket's members, the optimizer replaces their hooks
(:func:`install_fast_hooks`): every member but the last records its arrival with ``list.append`` (a C call, no
Python frame), and only the last runs Python, which submits the bucket when every member has arrived.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

BPPS_EXCEEDED = ("Gradients were computed more than backward_passes_per_step times before call to step(). Increase "
                 "backward_passes_per_step to accumulate gradients locally.")
MIB = 1 << 20
FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES
BUCKET_CAP_BYTES = 25 * MIB  # DistributedDataParallel's bucket_cap_mb default


@dataclass
class Bucket:
    """Parameters whose gradients go out together, and the flat buffer they go out in."""

    params: list[torch.Tensor]
    name: str
    buffer: torch.Tensor
    views: list[torch.Tensor]
    handle: int | None = field(default=None)
    arrived: list[torch.Tensor] = field(default_factory=list)  # members whose gradient is ready, in backward's order

    @property
    def complete(self) -> bool:
        """Every member's gradient is ready."""
        return len(self.arrived) == len(self.params)

    def fill(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """Copy ``grads`` into the buffer (cast to its dtype) and return the buffer."""
        torch._foreach_copy_(self.views, list(grads))
        return self.buffer

    def drain(self, grads: Sequence[torch.Tensor]) -> None:
        """Copy the reduced buffer back into ``grads`` (cast to theirs)."""
        torch._foreach_copy_(list(grads), self.views)

    def reset(self) -> None:
        """Ready for the next step (the same ``arrived`` list: the fast hooks hold its ``append``)."""
        self.handle = None
        self.arrived.clear()

    def renew(self) -> None:
        """A buffer of its own again (after an elastic reset: the failed runtime's side stream may still be at the
        old one, and the next step's copies would not wait for it). Host buffers have no such stream."""
        if self.buffer.is_cpu:
            return
        self.buffer = torch.empty_like(self.buffer)
        self.views = shaped_views(self.buffer, [p.shape for p in self.params])

    @property
    def overfull(self) -> bool:
        """A member arrived twice this step (a second backward before step())."""
        return len(self.arrived) > len(self.params) or len(set(map(id, self.arrived))) != len(self.arrived)


def install_fast_hooks(bucket: Bucket, last: torch.Tensor, submit: Callable[[Bucket], None]) -> list[Any]:
    """Hooks for ``bucket``'s members once backward's order is known: ``list.append`` on all but ``last`` (the
    member backward reaches last), a Python hook on ``last`` that submits the bucket when every member arrived
    (one that has not, where backward's order changed, leaves the bucket to ``synchronize()``). Returns the
    hooks' handles."""
    members = len(bucket.params)
    handles = [p.register_post_accumulate_grad_hook(bucket.arrived.append) for p in bucket.params if p is not last]

    def closer(param: torch.Tensor) -> None:
        arrived = bucket.arrived
        if bucket.handle is not None or len(arrived) >= members:
            del arrived[members:]  # the others' second arrivals: said here, once
            raise AssertionError(BPPS_EXCEEDED)
        arrived.append(param)
        if len(arrived) == members and len(set(map(id, arrived))) == members:
            submit(bucket)

    handles.append(last.register_post_accumulate_grad_hook(closer))
    return handles


def shaped_views(buffer: torch.Tensor, shapes: Sequence[torch.Size | tuple[int, ...]]) -> list[torch.Tensor]:
    """Consecutive pieces of the flat ``buffer``, one of each shape in turn."""
    sizes = [math.prod(shape) for shape in shapes]
    return [piece.view(shape) for piece, shape in zip(buffer.split(sizes), shapes, strict=True)]


def wire_dtype(param: torch.Tensor, fp16: bool) -> torch.dtype:
    """The dtype a parameter's gradient travels as: float16 for floating ones under fp16 compression."""
    return torch.float16 if fp16 and param.dtype.is_floating_point else param.dtype


def bucket_caps(fusion_threshold: int) -> tuple[int, int]:
    """The first bucket's cap and the others', in bytes, for the job's fusion threshold (0: no fusion, a bucket
    a parameter, as Horovod's threshold 0 means)."""
    cap = min(fusion_threshold, BUCKET_CAP_BYTES)
    return min(FIRST_BUCKET_BYTES, cap), cap


def assign(sizes: Sequence[int], kinds: Sequence[object], first_cap: int, cap: int) -> list[list[int]]:
    """Positions grouped into buckets: consecutive positions of one kind (dtype and device), each bucket closed
    when the next member would take it past its cap (a member larger than the cap gets a bucket of its own). The
    first bucket closed takes ``first_cap``, later ones ``cap``. Pure: ``sizes`` in bytes, in backward's order.

    >>> assign([4, 4, 4, 4], ["f"] * 4, first_cap=4, cap=8)
    [[0], [1, 2], [3]]
    """
    buckets: list[list[int]] = []
    open_: dict[object, tuple[list[int], int]] = {}
    for position, (size, kind) in enumerate(zip(sizes, kinds, strict=True)):
        members, total = open_.get(kind, ([], 0))
        limit = first_cap if not buckets else cap
        if members and total + size > limit:
            buckets.append(members)
            members, total = [], 0
        open_[kind] = (members + [position], total + size)
    buckets.extend(members for members, _ in open_.values() if members)
    return sorted(buckets, key=lambda members: members[0])


def build(params: Sequence[torch.Tensor], names: Callable[[torch.Tensor], str], fp16: bool,
          fusion_threshold: int) -> list[Bucket]:
    """The buckets of ``params`` (in registration order): laid out in backward's order (see :func:`assign`),
    each named by its members' names and shapes so that ranks whose models differ never sum mismatched layouts."""
    order = list(reversed(params))
    dtypes = [wire_dtype(p, fp16) for p in order]
    sizes = [p.numel() * dtype.itemsize for p, dtype in zip(order, dtypes, strict=True)]
    kinds = [(dtype, p.device) for p, dtype in zip(order, dtypes, strict=True)]
    buckets = []
    for index, members in enumerate(assign(sizes, kinds, *bucket_caps(fusion_threshold))):
        chosen = [order[i] for i in members]
        dtype, device = kinds[members[0]]
        buffer = torch.empty(sum(p.numel() for p in chosen), dtype=dtype, device=device)
        views = shaped_views(buffer, [p.shape for p in chosen])
        digest = zlib.crc32(repr([(names(p), tuple(p.shape)) for p in chosen]).encode())
        name = f"allreduce.bucket.{index}.{str(dtype).removeprefix('torch.')}.{digest:08x}"
        buckets.append(Bucket(chosen, name, buffer, views))
    return buckets


class Bucketing:
    """One DistributedOptimizer's buckets and what they know of a step: which member belongs where, backward's
    order (each bucket's ``arrived`` after a step of Python hooks), the fast hooks that replace those, and the
    buckets left to start at ``synchronize()``.

    Args:
        buckets: the layout (:func:`build`); empty: nothing is bucketed.
        submit: sends one complete bucket out (the optimizer's: it knows the op and the scaling).
    """

    def __init__(self, buckets: list[Bucket], submit: Callable[[Bucket], None],
                 python_hook: Callable[[torch.Tensor, Bucket], None]) -> None:  # noqa: D107
        self.buckets, self.submit, self.python_hook = buckets, submit, python_hook
        self.of = {p: bucket for bucket in buckets for p in bucket.params}
        self._fast_hooks: list[Any] = []  # none: the members have Python hooks, and backward's order is learned
        self._order_changed = False  # a bucket whose members all arrived did not go out: its last one came early

    @property
    def pending(self) -> bool:
        """A bucket went out and was not synchronized."""
        return any(bucket.handle is not None for bucket in self.buckets)

    def reset(self) -> None:
        """Ready for the next step."""
        for bucket in self.buckets:
            bucket.reset()

    def renew(self) -> None:
        """Fresh device buffers (:meth:`Bucket.renew`) and nothing pending: after an elastic reset."""
        for bucket in self.buckets:
            bucket.renew()
            bucket.reset()

    def start_rest(self) -> None:
        """Send out the buckets backward did not complete (``synchronize()``); a member that arrived twice in a
        fast hook (a second backward before step()) is refused here, once."""
        for bucket in self.buckets:
            if bucket.overfull:
                bucket.arrived.clear()
                raise AssertionError(BPPS_EXCEEDED)
            if bucket.handle is None:
                self._order_changed |= len(bucket.arrived) == len(bucket.params)
                self.submit(bucket)

    def learn(self, python_hooks: list[Any], position: Callable[[torch.Tensor], int], passes: int) -> None:
        """At the end of a step (before :meth:`reset`): after one in which backward reached every bucketed
        parameter once (one pass a step), replace their Python hooks (``python_hooks[position(param)]``) by fast
        ones (:func:`install_fast_hooks`), the last to arrive in each bucket closing it; else learn again next
        step."""
        if self._order_changed:  # backward's order is no longer the one learned: learn it again
            self._order_changed = False
            self.unlearn()
            return
        if self._fast_hooks or passes != 1 or not python_hooks or not all(
                len(bucket.arrived) == len(set(map(id, bucket.arrived))) == len(bucket.params)
                for bucket in self.buckets):
            return
        for bucket in self.buckets:
            for param in bucket.params:
                python_hooks[position(param)].remove()
            self._fast_hooks += install_fast_hooks(bucket, bucket.arrived[-1], self.submit)

    def unlearn(self) -> None:
        """Back from the fast hooks to a Python hook a parameter (several backward passes a step are counted
        there, and backward's order is learned again)."""
        if not self._fast_hooks:
            return
        for handle in self._fast_hooks:
            handle.remove()
        self._fast_hooks = []
        for param, bucket in self.of.items():
            self.python_hook(param, bucket)
