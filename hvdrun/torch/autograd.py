"""Autograd through the collectives, with Horovod's gradient rules.

* allreduce: the gradient is allreduced with the same op and scale factors;
* allgather: the gradient is averaged across ranks, then this rank's rows are taken;
* broadcast: the gradient is averaged across ranks on the root, zero elsewhere;
* alltoall: the gradient travels back with an alltoall using the received splits;
* reducescatter: the gradient is allgathered (times size for Sum, times the scale factors).

The functions exported by ``hvdrun.torch`` dispatch here when a tensor requires grad.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hvdrun.runtime import context
from hvdrun.torch import ops
from hvdrun.torch.compression import Compression
from hvdrun.torch.ops import Average, Sum
from hvdrun.torch.process_sets import set_size


def _grad_name(name: str | None) -> str | None:
    return f"{name}.grad" if name is not None else None


def _tracks_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, pre: float, post: float,
                ps: Any) -> torch.Tensor:
        ctx.args = (name, op, pre, post, ps)
        return ops.allreduce(tensor, name=name, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        name, op, pre, post, ps = ctx.args
        reduced = ops.allreduce(grad.contiguous(), name=_grad_name(name), op=op, prescale_factor=pre,
                                postscale_factor=post, process_set=ps)
        return reduced, None, None, None, None, None


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, ps: Any) -> torch.Tensor:
        output = ops.allgather(tensor, name=name, process_set=ps)
        sizes = ops.allgather(torch.tensor([tensor.shape[0]], dtype=torch.int64),
                              name=None if name is None else f"{name}.sizes", process_set=ps).tolist()
        index = ps.rank() if ps is not None else context.current().world.rank
        ctx.args = (name, sum(sizes[:index]), sizes[index], ps)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        name, start, rows, ps = ctx.args
        reduced = ops.allreduce(grad.contiguous(), name=_grad_name(name), op=Average, process_set=ps)
        return reduced[start:start + rows], None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, ps: Any) -> torch.Tensor:
        ctx.args = (root_rank, name, ps)
        return ops.broadcast(tensor, root_rank, name=name, process_set=ps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        root_rank, name, ps = ctx.args
        reduced = ops.allreduce(grad.contiguous(), name=_grad_name(name), op=Average, process_set=ps)
        if context.current().world.rank != root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                ps: Any) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = ops.synchronize(ops.alltoall_async(tensor, splits, name, ps))
        ctx.args = (name, received, ps)
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _received_grad: Any) -> tuple[Any, ...]:
        name, received, ps = ctx.args
        returned, _ = ops.alltoall(grad.contiguous(), splits=received.tolist(), name=_grad_name(name), process_set=ps)
        return returned, None, None, None


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, pre: float, post: float,
                ps: Any) -> torch.Tensor:
        ctx.args = (name, op, pre, post, ps)
        return ops.reducescatter(tensor, name=name, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        name, op, pre, post, ps = ctx.args
        gathered = ops.allgather(grad.contiguous(), name=_grad_name(name), process_set=ps)
        factor = pre * post * (set_size(ps) if op == Sum else 1)
        return (gathered * factor if factor != 1 else gathered), None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = None) -> torch.Tensor:
    """A new tensor reduced across ranks (default Average), differentiable; ``compression`` applies on the wire."""
    op = ops._resolve_op(op, average, adasum=True)
    compressed, ctx = compression.compress(tensor)
    if _tracks_grad(compressed):
        reduced = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    else:
        reduced = ops.allreduce(compressed, name=name, op=op, prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, process_set=process_set)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None) -> list[torch.Tensor]:
    """Every tensor reduced across ranks as one fused group; differentiable tensor by tensor."""
    if not _tracks_grad(*tensors):
        return ops.grouped_allreduce(tensors, average, name, op=op, prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor, process_set=process_set)
    base = name if name is not None else context.current().engine.auto_name("grouped_allreduce")
    return [allreduce(t, average, f"{base}.{i}", compression, op, prescale_factor, postscale_factor, process_set)
            for i, t in enumerate(tensors)]


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0, differentiable."""
    if _tracks_grad(tensor):
        return _Allgather.apply(tensor, name, process_set)
    return ops.allgather(tensor, name, process_set)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """A new tensor equal to root's, differentiable."""
    if _tracks_grad(tensor):
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return ops.broadcast(tensor, root_rank, name, process_set)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None) -> Any:
    """Scatter slices of dim 0 and gather what others sent; differentiable."""
    if not _tracks_grad(tensor):
        return ops.alltoall(tensor, splits, name, process_set)
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: int | None = None, process_set: Any = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce across ranks and keep this rank's block of dim 0 (default Average); differentiable."""
    op = ops._resolve_op(op, None)
    if _tracks_grad(tensor):
        return _Reducescatter.apply(tensor, name, op, prescale_factor, postscale_factor, process_set)
    return ops.reducescatter(tensor, name, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             process_set=process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = None) -> list[torch.Tensor]:
    """Every tensor of the list allgathered as one group; differentiable tensor by tensor."""
    if not _tracks_grad(*tensors):
        return ops.grouped_allgather(tensors, name, process_set)
    base = name if name is not None else context.current().engine.auto_name("grouped_allgather")
    return [allgather(t, f"{base}.{i}", process_set) for i, t in enumerate(tensors)]


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None, compression: Any = None,
                          op: int | None = None, process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Every tensor of the list reduced and scattered as one group (default Average); differentiable tensor
    by tensor."""
    if not _tracks_grad(*tensors):
        return ops.grouped_reducescatter(tensors, name, compression, op, process_set, prescale_factor,
                                         postscale_factor)
    base = name if name is not None else context.current().engine.auto_name("grouped_reducescatter")
    return [reducescatter(t, f"{base}.{i}", op=op, process_set=process_set, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor) for i, t in enumerate(tensors)]
