"""DistributedOptimizer: averages gradients across ranks while backward still runs.

``DistributedOptimizer(opt, ...)`` returns an instance of a subclass of ``opt``'s class built from
its parameter groups, so ``isinstance(hvd_opt, torch.optim.SGD)`` holds. Every parameter gets a
hook that fires when its gradient has been accumulated; after ``backward_passes_per_step`` such
firings the gradient's allreduce starts asynchronously, overlapping the rest of backward.
``step()`` waits for all of them (``synchronize()``) and then runs the wrapped optimizer's step. Without
overlap (CPU), the gradients go out at ``step()`` instead, flattened (:mod:`hvdrun.torch.flat_step`).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch

from hvdrun.envvars import OVERLAP
from hvdrun.runtime import context
from hvdrun.torch import buckets
from hvdrun.torch.compression import Compression
from hvdrun.torch.flat_step import FlatStep
from hvdrun.torch.ops import (
    Adasum,
    Average,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_async_,
    sparse_allreduce_async,
    synchronize,
)
from hvdrun.torch.process_sets import set_id


def _names(optimizer: torch.optim.Optimizer, named_parameters: Any) -> dict[torch.Tensor, str]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"noname.{g}.{i}" for g, group in enumerate(optimizer.param_groups)
                for i, p in enumerate(group["params"])}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()")
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"parameter names in named_parameters must be unique; duplicated: {duplicates}")
    by_param = {p: name for name, p in named}
    unnamed = [i for i, p in enumerate(params) if p not in by_param]
    if unnamed:
        raise ValueError(f"named_parameters was given but {len(unnamed)} optimizer parameter(s) are not in it "
                         f"(positions {unnamed[:5]}); pass model.named_parameters() of the optimized model")
    return by_param


def _overlap_policy(params: list[torch.Tensor]) -> bool:
    """Whether gradient allreduces progress during backward (``HVDRUN_OVERLAP`` overrides).

    On GPUs communication overlaps device compute. On CPUs every core is busy with backward (the
    launcher gives each rank cores / local ranks threads), so background progress only competes with
    it: measured on 2 cores, starting the allreduces at step() was 5-15 % faster.
    """
    setting = os.environ.get(OVERLAP)
    if setting in ("0", "1"):
        return setting == "1"
    return any(not p.is_cpu for p in params)


_ALONE = -1  # a bucket whose members went out one by one (a sparse gradient among them)


def _split_groups(params: list[torch.Tensor], groups: Any) -> list[list[torch.Tensor]]:
    if not groups:
        return []
    if isinstance(groups, int):
        size = -(-len(params) // groups)
        return [params[i:i + size] for i in range(0, len(params), size)]
    return [list(group) for group in groups]


class _DistributedOptimizer(torch.optim.Optimizer):
    """The methods mixed into the dynamic subclass (see :func:`DistributedOptimizer`)."""

    def __init__(self, params: Any, named_parameters: Any, compression: Any, backward_passes_per_step: int,
                 op: int, gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                 process_set: Any = None) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]  # the wrapped class takes params
        self._parameter_names = _names(self, named_parameters)
        self._compression, self.op, self.sparse_as_dense = compression, op, sparse_as_dense
        self._densified: set[torch.Tensor] = set()
        self.backward_passes_per_step = backward_passes_per_step
        self._predivide = gradient_predivide_factor
        all_params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._groups = _split_groups(all_params, groups)
        self._group_of = {p: index for index, group in enumerate(self._groups) for p in group}
        self._requires_update = set(all_params)
        # gradients outside any group, in name order (every rank submits them in the same order)
        self._ungrouped = sorted(set(all_params) - set(self._group_of), key=self._parameter_names.__getitem__)
        self._position = {p: i for i, p in enumerate(all_params)}
        self._fired = [0] * len(all_params)  # backward passes that reached each parameter since synchronize()
        self._handles: dict[torch.Tensor, tuple[int | None, Any]] = {}
        self._group_handles: dict[int, tuple[int, list[Any]]] = {}
        self._flat = FlatStep(compression, self._dense_grad)  # submitted at step() without overlap
        self._synchronized = False
        self._should_synchronize = True
        self._process_set = process_set
        self._overlap = _overlap_policy(all_params)
        self._buckets = buckets.Bucketing(self._build_buckets([p for p in all_params if p not in self._group_of]),
                                          self._submit_bucket, self._python_hook)
        self._unbucketed = [p for p in self._ungrouped if p not in self._buckets.of]  # in name order
        self._hooks: list[Any] = []  # each parameter's Python hook, by position
        member = process_set is None or process_set.included()
        if (context.current().world.size > 1 or context.current().assignment is not None) and member:
            self._hooks = [param.register_post_accumulate_grad_hook(self._make_hook(index, self._buckets.of.get(param)))
                           for index, param in enumerate(all_params)]

    # -- hooks and submission ------------------------------------------------------------------
    def _make_hook(self, index: int, bucket: buckets.Bucket | None) -> Any:
        """The hook of parameter ``index`` (in ``bucket``, or None): it runs once per parameter and backward, so it
        is kept cheap (no lookup keyed by the tensor: hashing one costs microseconds, 200 of them a millisecond)."""
        fired = self._fired

        def hook(param: torch.Tensor) -> None:
            passes = fired[index] + 1
            if passes > self.backward_passes_per_step:
                raise AssertionError(buckets.BPPS_EXCEEDED)
            fired[index] = passes
            if passes != self.backward_passes_per_step or not self._overlap:
                return
            if bucket is None:
                self._submit(param)
                return
            bucket.arrived.append(param)
            if bucket.complete:
                self._submit_bucket(bucket)
        return hook

    def _reset_passes(self) -> None:
        self._fired[:] = [0] * len(self._fired)
        self._buckets.reset()

    def _python_hook(self, param: torch.Tensor, bucket: buckets.Bucket) -> None:
        index = self._position[param]
        self._hooks[index] = param.register_post_accumulate_grad_hook(self._make_hook(index, bucket))

    def _build_buckets(self, params: list[torch.Tensor]) -> list[buckets.Bucket]:
        """Buckets of ``params`` when gradients go out during backward (:mod:`hvdrun.torch.buckets`); none without
        overlap (all go out flattened at step()) or with a compressor other than none and fp16 (each gradient is
        compressed on its own, and the engine fuses what is ready together)."""
        known = (Compression.none, Compression.fp16)
        runtime = context.current()
        alone = runtime.world.size == 1 and runtime.assignment is None  # no hooks: nothing to bucket
        if not self._overlap or self._compression not in known or alone:
            return []
        return buckets.build(params, self._parameter_names.__getitem__, self._compression is Compression.fp16,
                             context.current().engine.fusion_threshold)

    def _submit_bucket(self, bucket: buckets.Bucket) -> None:
        """One allreduce of ``bucket``'s gradients in its buffer; where one is sparse (and stays sparse), each
        member goes out on its own instead."""
        if not self.sparse_as_dense and any(p.grad is not None and p.grad.is_sparse for p in bucket.params):
            bucket.handle = _ALONE
            for param in bucket.params:
                self._submit_alone(param)
            return
        prescale, postscale = self._scales()
        grads = [p.grad for p in bucket.params]
        if any(grad is None or grad.is_sparse for grad in grads):  # no gradient (zeros), or densified
            buffer = bucket.fill([self._dense_grad(p) for p in bucket.params])
        else:
            buffer = bucket.fill(cast(list[torch.Tensor], grads))
        bucket.handle = allreduce_async_(buffer, name=bucket.name, op=self.op, prescale_factor=prescale,
                                         postscale_factor=postscale, process_set=self._process_set)

    def _scales(self) -> tuple[float, float]:
        if self.op == Average:
            return 1.0 / self._predivide, self._predivide
        return 1.0, 1.0

    def _submit(self, param: torch.Tensor) -> None:
        if param in self._group_of:
            self._submit_group_if_complete(self._group_of[param])
            return
        self._submit_alone(param)

    def _submit_alone(self, param: torch.Tensor) -> None:
        if param.grad is not None and param.grad.is_sparse and not self.sparse_as_dense:
            self._handles[param] = (None, "sparse")
            return
        grad = self._dense_grad(param)
        compressed, ctx = self._compression.compress(grad)
        prescale, postscale = self._scales()
        handle = allreduce_async_(compressed, name=f"allreduce.{self._parameter_names[param]}", op=self.op,
                                  prescale_factor=prescale, postscale_factor=postscale, process_set=self._process_set,
                                  _progress_now=self._overlap)
        self._handles[param] = (handle, (compressed, ctx))

    def _submit_together(self, params: list[torch.Tensor]) -> None:
        """Without overlap (CPU), every gradient waits for ``step()``: they go out flattened into one buffer per dtype
        and device, one allreduce each (:mod:`hvdrun.torch.flat_step`); sparse ones keep their allgather."""
        prescale, postscale = self._scales()
        options = {"op": self.op, "prescale_factor": prescale, "postscale_factor": postscale,
                   "process_set": self._process_set, "_progress_now": False}
        for param in self._flat.submit(params, options, self.sparse_as_dense):
            self._handles[param] = (None, "sparse")

    def _submit_group_if_complete(self, index: int, force: bool = False) -> None:
        group = self._groups[index]
        passes = self.backward_passes_per_step
        if index in self._group_handles or not (force or all(self._fired[self._position[p]] >= passes
                                                               for p in group)):
            return
        compressed = [self._compression.compress(self._dense_grad(p)) for p in group]
        prescale, postscale = self._scales()
        handle = grouped_allreduce_async_([c for c, _ in compressed], name=f"allreduce.group.{index}",
                                          op=self.op, prescale_factor=prescale, postscale_factor=postscale,
                                          process_set=self._process_set, _progress_now=self._overlap)
        self._group_handles[index] = (handle, compressed)

    def _dense_grad(self, param: torch.Tensor) -> torch.Tensor:
        """``param.grad``, made dense (created as zeros if missing); a sparse one is remembered so that the
        averaged gradient is made sparse again before the step (``sparse_as_dense``, as Horovod does)."""
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if param.grad.is_sparse:
            self._densified.add(param)
            param.grad = param.grad.to_dense()
        return param.grad

    # -- synchronization -----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Start the allreduces that have not started (zero gradients where none), wait for all."""
        outsider = self._process_set is not None and not self._process_set.included()
        runtime = context.current()
        if (runtime.world.size == 1 and runtime.assignment is None) or outsider:  # no hooks, nothing pending
            self._synchronized = True
            return
        self._start_pending()
        for param, (handle, ctx) in list(self._handles.items()):
            if ctx == "sparse":
                param.grad = self._sparse_allreduce(param)
            elif handle is not None:
                output = synchronize(handle)
                compressed, compression_ctx = ctx
                if output is not param.grad:
                    self._dense_grad(param).copy_(self._compression.decompress(output, compression_ctx))
        for bucket in self._buckets.buckets:
            if bucket.handle is not None and bucket.handle != _ALONE:
                synchronize(bucket.handle)
                bucket.drain([cast(torch.Tensor, p.grad) for p in bucket.params])
        self._flat.finish()
        for index, (handle, compressed) in self._group_handles.items():
            for param, output, (_, ctx) in zip(self._groups[index], synchronize(handle), compressed, strict=True):
                if output is not param.grad:
                    self._dense_grad(param).copy_(self._compression.decompress(output, ctx))
        for param in self._densified:
            param.grad = cast(torch.Tensor, param.grad).to_sparse()
        self._densified.clear()
        self._handles.clear()
        self._group_handles.clear()
        self._buckets.learn(self._hooks, self._position.__getitem__, self.backward_passes_per_step)
        self._reset_passes()
        self._synchronized = True

    def _start_pending(self) -> None:
        """Start what backward has not started: the buckets not complete, the gradients outside buckets without a
        handle (zeros where a parameter got no gradient), the groups (all of them without overlap)."""
        handles = self._handles
        waiting = [p for p in self._unbucketed if p not in handles] if handles else list(self._unbucketed)
        for param in waiting:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        if self._overlap:
            for param in waiting:
                self._submit(param)
        else:
            self._submit_together(waiting)
        for index in range(len(self._groups)):
            self._submit_group_if_complete(index, force=True)
        self._buckets.start_rest()

    def reset_pending(self) -> None:
        """Forget gradients submitted to a runtime that failed (elastic reset): the next backward starts afresh."""
        self._handles.clear()
        self._group_handles.clear()
        self._flat.forget()
        for param in self._densified:
            if param.grad is not None and not param.grad.is_sparse:
                param.grad = param.grad.to_sparse()
        self._densified.clear()
        self._buckets.renew()
        self._reset_passes()
        self._synchronized = False

    def _sparse_allreduce(self, param: torch.Tensor) -> torch.Tensor:
        grad = cast(torch.Tensor, param.grad)
        name = f"sparse.{self._parameter_names[param]}"
        return cast(torch.Tensor, sparse_allreduce_async(grad, name, self.op, self._process_set)())

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, ``step()`` does not synchronize again (after an explicit ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize (unless skipped), then the wrapped optimizer's step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(); this can cause training slowdown", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return self._base_step(closure)

    def _base_step(self, closure: Any = None) -> Any:
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's zero_grad; refused while allreduces are pending."""
        if (any(handle is not None for handle, _ in self._handles.values()) or self._group_handles
                or self._buckets.pending):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                                 "cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate before each allreduce."""
        self.backward_passes_per_step = passes
        if passes != 1:
            self._buckets.unlearn()
        self._reset_passes()


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """``op=hvd.Adasum``, as Horovod: each rank takes the wrapped optimizer's step on its own gradients, and
    the parameters' changes (not the gradients) are combined with Adasum, then applied to the starting values."""

    def __init__(self, params: Any, named_parameters: Any, compression: Any) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]  # the wrapped class takes params
        self._parameter_names = _names(self, named_parameters)
        self._compression = compression

    def synchronize(self) -> None:
        """Nothing to wait for: the changes are combined inside ``step()``."""

    def skip_synchronize(self) -> None:
        """Refused, as in Horovod: Adasum combines inside ``step()``."""
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")

    def step(self, closure: Any = None) -> Any:
        """Local step, then the Adasum of every parameter's change across ranks, applied to its start."""
        params = sorted((p for group in self.param_groups for p in group["params"] if p.requires_grad),
                        key=lambda p: self._parameter_names[p])
        start = [p.detach().clone() for p in params]
        loss = super(self.__class__, self).step(closure)
        if context.current().world.size == 1 or not params:
            return loss
        compressed = [self._compression.compress(p.detach() - s) for p, s in zip(params, start, strict=True)]
        combined = grouped_allreduce([c for c, _ in compressed], name="adasum.step.deltas", op=Adasum)
        with torch.no_grad():
            for param, begin, change, (_, ctx) in zip(params, start, combined, compressed, strict=True):
                param.copy_(begin + self._compression.decompress(change, ctx))
        return loss


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,  # noqa: N802 - Horovod
                         compression: Any = Compression.none, backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: int | Sequence[Sequence[torch.Tensor]] | None = None, sparse_as_dense: bool = False,
                         process_set: Any = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged (or ``op``-reduced) across ranks.

    Args:
        optimizer: any torch optimizer; the result is an instance of a subclass of its class.
        named_parameters: ``model.named_parameters()``; names match the allreduces across ranks.
        compression: ``Compression.none`` or ``Compression.fp16``.
        backward_passes_per_step: backward passes accumulated locally before each allreduce.
        op: ``Average`` (default), ``Sum``, ...; ``Adasum`` combines each rank's parameter change instead.
        gradient_predivide_factor: with Average, divide by this before the sum and multiply after.
        num_groups: deprecated spelling of an integer ``groups``.
        groups: N (fuse parameters into N groups) or lists of parameters fused together.
        sparse_as_dense: densify sparse gradients instead of allgathering them.
        process_set: reduce gradients only among these ranks (registered with ``add_process_set``).
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    if backward_passes_per_step <= 0:
        raise ValueError(f"backward_passes_per_step must be positive, got {backward_passes_per_step}")
    if process_set is not None and process_set.process_set_id is None:
        set_id(process_set)  # raises: not registered
    if op == Adasum:
        if process_set is not None and set_id(process_set) != 0:
            raise ValueError("op=Adasum runs on the global process set only (as in Horovod)")
        adasum_cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
                          dict(_DistributedAdasumOptimizer.__dict__))
        return adasum_cls(optimizer.param_groups, named_parameters, compression)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups or num_groups, sparse_as_dense, process_set)
