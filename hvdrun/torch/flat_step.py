"""DistributedOptimizer's gradients without overlap (CPU): every gradient waits for ``step()``, then they go out
flattened into one buffer per dtype and device, one allreduce each (per-op overhead paid once, not per tensor);
sparse ones keep their allgather. With overlap, gradients go out during backward instead (:mod:`.buckets`).

The name carries a digest of the shapes, so ranks whose models differ wait on different names and the deadlock check
names them, instead of summing mismatched layouts. Adasum combines tensor by tensor: it goes as a grouped allreduce.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any, cast

import torch

from hvdrun.torch import buckets
from hvdrun.torch.compression import Compression
from hvdrun.torch.ops import Adasum, allreduce_async_, grouped_allreduce_async_, synchronize

_Flat = tuple[list[int], str, torch.Tensor, list[torch.Tensor]]  # positions, name, buffer, views of the positions


class FlatStep:
    """The gradients submitted at ``step()`` (see the module docstring), until :meth:`finish` writes them back.

    Args:
        compression: the optimizer's compressor (``Compression.none`` or another).
        dense_grad: the optimizer's ``param.grad``, made dense (created as zeros if missing; a sparse one is made
            sparse again before the step).
    """

    def __init__(self, compression: Any, dense_grad: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.compression, self.dense_grad = compression, dense_grad
        self._layouts: dict[tuple[int, ...], list[_Flat]] = {}  # see _layout
        # submitted: (handle, params, (compressed, ctx) pairs, views into the flat buffer)
        self.pending: list[tuple[Any, list[torch.Tensor], list[Any], list[torch.Tensor] | None]] = []

    def submit(self, params: list[torch.Tensor], options: dict[str, Any], sparse_as_dense: bool) -> list[torch.Tensor]:
        """Submit the gradients of ``params`` (every one has one) with the allreduce ``options``, sparse ones made dense
        with ``sparse_as_dense``; the parameters whose gradient stays sparse, left for the caller's allgather."""
        sparse, dense, grads = [], [], []
        for param in params:
            grad = cast(torch.Tensor, param.grad)
            if grad.is_sparse:
                if not sparse_as_dense:
                    sparse.append(param)
                    continue
                grad = self.dense_grad(param)
            dense.append(param)
            grads.append(grad)
        if not dense:
            return sparse
        if self.compression is Compression.none:
            compressed: list[Any] = [(grad, None) for grad in grads]
        else:
            compressed = [self.compression.compress(grad) for grad in grads]
        if options["op"] == Adasum:
            handle = grouped_allreduce_async_([c for c, _ in compressed], name="allreduce.step", **options)
            self.pending = [(handle, dense, compressed, None)]
            return sparse
        self.pending = []
        for members, name, buffer, views in self._layout(dense, [c for c, _ in compressed]):
            tensors = [compressed[i][0] for i in members]
            torch._foreach_copy_(views, tensors)  # into this layout's buffer: one allreduce for all of them
            handle = allreduce_async_(buffer, name=name, **options)
            self.pending.append((handle, [dense[i] for i in members], [compressed[i] for i in members], views))
        return sparse

    def _layout(self, params: list[torch.Tensor], tensors: list[torch.Tensor]) -> list[_Flat]:
        """One flat buffer per dtype and device of ``tensors``: the positions of its members, its name, the
        buffer and the members' views into it. Worked out once for a given set of parameters (their gradients'
        shapes, dtypes and devices follow theirs; compression maps a dtype the same way every step)."""
        key = tuple(map(id, params))
        known = self._layouts.get(key)
        if known is not None:
            return known
        layout: list[_Flat] = []
        for kind in dict.fromkeys((t.dtype, t.device) for t in tensors):
            members = [i for i, t in enumerate(tensors) if (t.dtype, t.device) == kind]
            shapes = [tuple(tensors[i].shape) for i in members]
            sizes = [math.prod(shape) for shape in shapes]
            digest = zlib.crc32(repr(tuple(shapes)).encode())
            buffer = torch.empty(sum(sizes), dtype=kind[0], device=kind[1])
            views = buckets.shaped_views(buffer, shapes)
            layout.append((members, f"allreduce.step.{str(kind[0]).replace('torch.', '')}.{digest:08x}", buffer, views))
        if len(self._layouts) > 16:
            self._layouts.clear()
        self._layouts[key] = layout
        return layout

    def finish(self) -> None:
        """Wait for every submission and write the reduced gradients back into ``param.grad``."""
        for handle, params, compressed, views in self.pending:
            self._take_results(synchronize(handle), params, compressed, views)
        self.pending = []

    def forget(self) -> None:
        """Drop what was submitted to a runtime that failed (elastic reset)."""
        self.pending = []

    def _take_results(self, output: Any, params: list[torch.Tensor], compressed: list[Any],
                      views: list[torch.Tensor] | None) -> None:
        """Write the reduced gradients of one submission back into ``param.grad``."""
        outputs = output if views is None else views
        if views is not None and self.compression is Compression.none:  # one copy for all of them
            torch._foreach_copy_([c for c, _ in compressed], views)  # uncompressed, these are the grads
            return
        for param, piece, (_, ctx) in zip(params, outputs, compressed, strict=True):
            if piece is not param.grad:
                self.dense_grad(param).copy_(self.compression.decompress(piece, ctx))
