"""Horovod's collectives on torch tensors: blocking, in-place (``_``) and asynchronous forms.

Tensors are viewed as numpy arrays (no copy for CPU tensors) and handed to the engine of
:mod:`hvdrun.runtime`. Asynchronous calls return an integer handle for :func:`poll` and
:func:`synchronize`, as in Horovod.
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hvdrun import envvars
from hvdrun.runtime import context
from hvdrun.runtime.blocking import allreduce_unqueued
from hvdrun.runtime.device_buffers import SideStreams, wait_for_device_ops
from hvdrun.runtime.handles import Handle
from hvdrun.runtime.negotiation import GLOBAL_SET, JOIN, MIXED_DEVICES, Request
from hvdrun.runtime.reduce import ADASUM, AVERAGE, MAX, MIN, PRODUCT, SUM, average_divisor
from hvdrun.torch import adasum, dtypes
from hvdrun.torch.dtypes import MOVEMENT_DTYPES, REDUCTION_DTYPES
from hvdrun.torch.process_sets import set_id, set_size

Average, Sum, Adasum, Min, Max, Product = AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT

_handles: dict[int, tuple[Handle | _GroupHandle, Callable[[Any], Any]]] = {}
_handle_ids = itertools.count(1)
_handles_lock = threading.Lock()
_groups = itertools.count(1)


def _engine():  # noqa: ANN202 - internal
    return context.current().engine


_cpu_via_device: bool | None = None  # HVDRUN_CPU_VIA_DEVICE_BACKEND, read once per process


def _via_device(tensor: torch.Tensor) -> bool:
    """Device tensors go to the device path (torch.distributed); CPU tensors too when so configured."""
    global _cpu_via_device
    if not tensor.is_cpu:
        return True
    if _cpu_via_device is None:
        _cpu_via_device = os.environ.get(envvars.CPU_VIA_DEVICE) == "1"
    return _cpu_via_device


def _require(tensor: torch.Tensor, kinds: tuple[str, ...]) -> None:
    """ValueError unless ``tensor`` is a contiguous tensor of a dtype in ``kinds``."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    if dtypes.name_of(tensor.dtype) not in kinds:
        raise ValueError(f"Tensor type {tensor.dtype} is not supported; supported: {', '.join(kinds)}")


def _check(tensor: torch.Tensor, kinds: tuple[str, ...]) -> Any:
    """A numpy view of a contiguous CPU tensor, or the tensor itself for the device path."""
    _require(tensor, kinds)
    if _via_device(tensor):
        return tensor.detach()
    return dtypes.wire_array(tensor)


def _identity(result: Any) -> Any:
    return result


def _as_tensor(result: Any) -> torch.Tensor:
    return result if isinstance(result, torch.Tensor) else torch.from_numpy(result)


def _resolve_op(op: int | None, average: bool | None, default: int = AVERAGE, adasum: bool = False) -> int:
    """The reduction op from ``op``/``average``; Adasum only where ``adasum`` (allreduces) says it applies."""
    if op is not None and average is not None:
        raise ValueError("op and average cannot both be given")
    if average is not None:
        warnings.warn("the average argument is deprecated; use op=hvd.Average or op=hvd.Sum",
                      DeprecationWarning, stacklevel=3)
        return AVERAGE if average else SUM
    op = default if op is None else op
    if op == ADASUM and not adasum:
        raise RuntimeError("Adasum applies to allreduce only (as in Horovod); use Average or Sum here")
    if op not in (AVERAGE, SUM, MIN, MAX, PRODUCT, ADASUM):
        raise ValueError(f"unknown reduction op {op}; expected hvd.Average, Sum, Min, Max or Product")
    return op


def _scoped_name(kind: str, name: str | None, scope: int) -> str:
    """Names are matched within a process set, as in Horovod: those of other sets get a suffix."""
    suffix = f"@set{scope}" if scope else ""
    return _engine().auto_name(kind + suffix) if name is None else name + suffix


def _request(kind: str, array: Any, name: str | None, source: str = "", **fields: Any) -> Request:
    name = _scoped_name(kind, name, fields.get("process_set", 0))
    if isinstance(array, torch.Tensor):
        return Request(name, kind, str(array.dtype).removeprefix("torch."), tuple(array.shape),
                       device=f"torch:{array.device.type}", **fields)
    return Request(name, kind, dtypes.wire_name(array), array.shape, source=source, **fields)


def _side_streams() -> SideStreams | None:
    device = context.current().device
    return device.streams if device is not None else None


def _on_device(values: Sequence[Any]) -> list[torch.Tensor]:
    """The device tensors among ``values`` (not CPU tensors, numpy arrays or anything else)."""
    return [value for value in values if isinstance(value, torch.Tensor) and not value.is_cpu]


def _mark_ready(arrays: Sequence[Any]) -> None:
    """Record where device tensors hold their values, on the submitting thread's stream (see
    :mod:`hvdrun.runtime.device_buffers`); CPU tensors and numpy arrays need nothing."""
    devices = _on_device(arrays)
    streams = _side_streams() if devices else None
    if streams is not None:
        streams.mark_ready(devices)


def _device_result(result: Any) -> Any:
    """``result`` of a finished op, usable on the caller's stream: a device tensor's stream waits (on the device,
    not the host) for the side stream that produced it."""
    tensors = _on_device(result if isinstance(result, (list, tuple)) else (result,))
    if tensors:
        wait_for_device_ops(tensors, _side_streams())
    return result


def _run(request: Request, array: Any) -> Any:
    """Submit and wait on this thread (the blocking forms), ordered on a device tensor's streams."""
    _mark_ready((array,))
    return _device_result(_engine().run(request, array))


def _start(request: Request, array: np.ndarray | None, finish: Callable[[Any], Any], wake: bool = True) -> int:
    _mark_ready((array,))
    handle = _engine().submit(request, array, wake=wake)
    with _handles_lock:
        handle_id = next(_handle_ids)
        _handles[handle_id] = (handle, finish)
    return handle_id


def poll(handle: int) -> bool:
    """True when the asynchronous op behind ``handle`` finished."""
    with _handles_lock:
        if handle not in _handles:
            raise ValueError(f"unknown handle {handle}")
        entry = _handles[handle][0]
    if not entry.done():
        return False
    entry.seen()
    return True


def synchronize(handle: int) -> Any:
    """Wait for ``handle``, release it and return its output (None for an unknown handle)."""
    with _handles_lock:
        entry = _handles.get(handle)
    if entry is None:
        return None
    try:
        return entry[1](_device_result(entry[0].wait()))
    finally:
        with _handles_lock:
            _handles.pop(handle, None)


def _reduce_request(tensor_array: np.ndarray, name: str | None, op: int, prescale: float, postscale: float,
                    process_set: Any, group: int = 0, group_size: int = 0, source: str = "") -> Request:
    return _request("allreduce", tensor_array, name, source, op=op, prescale=float(prescale),
                    postscale=float(postscale), group=group, group_size=group_size, process_set=set_id(process_set))


def _reduced_in(tensor: torch.Tensor, op: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tensor a reduction of ``tensor`` works on (a float32 copy for float16/bfloat16, see
    :mod:`hvdrun.torch.dtypes`), and that copy (None when it is ``tensor`` itself)."""
    _require(tensor, REDUCTION_DTYPES)
    dtypes.check_reduction(tensor, op)
    wide = None if _via_device(tensor) else dtypes.widened(tensor)  # the device path reduces every dtype itself
    return (tensor, None) if wide is None else (wide, wide)


def _written_back(tensor: torch.Tensor, wide: torch.Tensor | None) -> torch.Tensor:
    """``tensor`` holding the result (rounded once from its float32 copy where it was widened)."""
    if wide is not None:
        with torch.no_grad():
            tensor.copy_(wide)
    return tensor


def _start_group(items: Sequence[tuple[Request, np.ndarray, Callable[[Any], Any]]], wake: bool = True) -> list[int]:
    """Submit requests in one announcement (a grouped op's, or a batch of independent ones); one handle id per
    request. A grouped op's tensors on several devices are announced as such (:data:`MIXED_DEVICES`): every rank's
    negotiation then fails the group, naming them. (A batch may mix them: Adam keeps ``step`` on the CPU.)"""
    devices = sorted({request.device for request, _, _ in items})
    if len(devices) > 1 and any(request.group_size for request, _, _ in items):  # a grouped op, not a batch
        items = [(request._replace(device=f"{MIXED_DEVICES}{' and '.join(devices)}"), array, finish)
                 for request, array, finish in items]
    _mark_ready([array for _, array, _ in items])
    handles = _engine().submit_many([(request, array) for request, array, _ in items], wake=wake)
    with _handles_lock:
        ids = [next(_handle_ids) for _ in handles]
        for handle_id, handle, (_, _, finish) in zip(ids, handles, items, strict=True):
            _handles[handle_id] = (handle, finish)
    return ids


# -- allreduce ------------------------------------------------------------------------------------

def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = None, *, _progress_now: bool = True) -> int:
    """Start an in-place allreduce of ``tensor``; returns a handle.

    ``_progress_now=False`` (DistributedOptimizer on CPU) leaves the progress to whoever waits.
    """
    op = _resolve_op(op, average, adasum=True)
    if op == ADASUM:
        return _adasum_start([tensor], name, prescale_factor, postscale_factor, process_set, _progress_now,
                             single=True)
    work, wide = _reduced_in(tensor, op)
    array = _check(work, REDUCTION_DTYPES)
    request = _reduce_request(array, name, op, prescale_factor, postscale_factor, process_set,
                              source=dtypes.source_of(tensor, array))
    return _start(request, array, lambda _: _written_back(tensor, wide), wake=_progress_now)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = None) -> int:
    """Start an allreduce into a new tensor; returns a handle."""
    output = tensor.detach().clone(memory_format=torch.contiguous_format)
    return allreduce_async_(output, average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None) -> torch.Tensor:
    """Allreduce ``tensor`` in place (default op Average) and return it."""
    return _allreduce_in_place(tensor, average, name, op, prescale_factor, postscale_factor, process_set, True)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, compression: Any = None,
              op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced across ranks (default op Average); the input is untouched."""
    output = tensor.detach().clone(memory_format=torch.contiguous_format)
    return _allreduce_in_place(output, average, name, op, prescale_factor, postscale_factor, process_set, False)


def _allreduce_in_place(tensor: torch.Tensor, average: bool | None, name: str | None, op: int | None,
                        prescale_factor: float, postscale_factor: float, process_set: Any,
                        remember: bool) -> torch.Tensor:
    """The blocking allreduce: of the whole job, the runtime's unqueued paths first (a numpy view of a CPU tensor as
    it is; a device tensor), else the engine's queued path."""
    op = _resolve_op(op, average, adasum=True)
    if op == ADASUM:
        return synchronize(allreduce_async_(tensor, None, name, op, prescale_factor, postscale_factor, process_set))
    if process_set is None:
        engine = _engine()
        if name is None:
            name = engine.auto_name("allreduce")  # the same name on either path
        array = _lane_view(tensor, remember)
        if array is not None and allreduce_unqueued(engine, array, name, op, prescale_factor, postscale_factor,
                                                    _express_request):
            return tensor
    work, wide = _reduced_in(tensor, op)
    array = _check(work, REDUCTION_DTYPES)
    if process_set is None and name is not None and isinstance(array, torch.Tensor) and _express_on_device(
            engine, array, name, op, prescale_factor, postscale_factor):
        return tensor  # a device tensor: no lane, but the express cycle
    request = _reduce_request(array, name, op, prescale_factor, postscale_factor, process_set,
                              source=dtypes.source_of(tensor, array))
    _run(request, array)
    return _written_back(tensor, wide)


def _express_on_device(engine: Any, array: torch.Tensor, name: str, op: int, prescale: float,
                       postscale: float) -> bool:
    """The express cycle of a blocking allreduce of a device tensor: run on the caller's stream where every rank
    took it at once; where it joined the engine's queue instead, the engine's side stream ran it, so the caller's
    stream waits for that (on the device). False: not taken."""
    _mark_ready((array,))
    try:
        taken = allreduce_unqueued(engine, array, name, op, prescale, postscale, _express_request)
    finally:
        streams = _side_streams() if not array.is_cpu else None
        if streams is not None:
            streams.forget(array)  # ran on this thread: the event recorded for the engine was not needed
    if taken:
        _device_result(array)
    return taken


# what the lane reduces as it is: not float16/bfloat16 (reduced in float32, and a post does not carry the caller's
# dtype, so a mismatch would go unseen), not bool (Min/Max only, checked on the engine's path)
_LANE_DTYPES = frozenset(getattr(torch, name) for name in REDUCTION_DTYPES) - dtypes.WIDENED - {torch.bool}
_lane_views: dict[int, tuple[int, torch.Size, torch.dtype, np.ndarray]] = {}
_MAX_LANE_VIEWS = 64


_express_requests: dict[tuple, Request] = {}
_MAX_EXPRESS_REQUESTS = 64


def _express_request(array: Any, name: str, op: int, prescale: float, postscale: float) -> Request:
    """The request of a blocking allreduce of the whole job (a numpy view of a lane dtype, or a device tensor),
    remembered by name and layout (an automatic name never comes back, so its request is not kept)."""
    key = (name, array.dtype, array.shape, op, prescale, postscale,
           array.device if isinstance(array, torch.Tensor) else None)
    request = _express_requests.get(key)
    if request is None:
        request = _reduce_request(array, name, op, prescale, postscale, None)
        if ".noname." not in name:
            if len(_express_requests) >= _MAX_EXPRESS_REQUESTS:
                _express_requests.clear()
            _express_requests[key] = request
    return request


def _lane_view(tensor: torch.Tensor, remember: bool) -> np.ndarray | None:
    """The numpy view of a contiguous CPU tensor of a reducible dtype, else None (the engine's path checks and
    names the problem). ``t.numpy()`` costs about a microsecond, so views of tensors reduced in place again
    and again are remembered by identity, checked against the tensor's address, shape and dtype; a view holds
    the tensor's storage (not the tensor), so a matching address is this memory."""
    if not isinstance(tensor, torch.Tensor):  # an id of a freed tensor may now name anything
        return None
    entry = _lane_views.get(id(tensor))
    if (entry is not None and entry[0] == tensor.data_ptr() and entry[1] == tensor.shape and entry[2] == tensor.dtype
            and tensor.is_contiguous()):
        return entry[3]
    if _via_device(tensor) or tensor.dtype not in _LANE_DTYPES or not tensor.is_contiguous():
        return None
    array = tensor.detach().numpy()
    if remember:
        if len(_lane_views) >= _MAX_LANE_VIEWS:
            _lane_views.clear()
        _lane_views[id(tensor)] = (tensor.data_ptr(), tensor.shape, tensor.dtype, array)
    return array


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None, *, _progress_now: bool = True) -> int:
    """Start an in-place allreduce of a list of tensors, reduced as one fused group."""
    op = _resolve_op(op, average, adasum=True)
    if op == ADASUM:
        return _adasum_start(tensors, name, prescale_factor, postscale_factor, process_set, _progress_now)
    works = [_reduced_in(t, op) for t in tensors]
    arrays = [_check(work, REDUCTION_DTYPES) for work, _ in works]
    base = name if name is not None else _engine().auto_name("grouped_allreduce")
    group = next(_groups)
    items = [(_reduce_request(a, f"{base}.{i}", op, prescale_factor, postscale_factor, process_set, group,
                              len(arrays), dtypes.source_of(t, a)), a, _identity)
             for i, (t, a) in enumerate(zip(tensors, arrays, strict=True))]
    return _grouped(_start_group(items, wake=_progress_now),
                    lambda _: [_written_back(t, wide) for t, (_, wide) in zip(tensors, works, strict=True)])


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = None) -> int:
    """Start a grouped allreduce into new tensors."""
    outputs = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    return grouped_allreduce_async_(outputs, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = None) -> list[torch.Tensor]:
    """Allreduce a list of tensors in place as one fused group."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = None, op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None) -> list[torch.Tensor]:
    """New tensors: every tensor of the list reduced across ranks, as one fused group."""
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                               process_set))


def _adasum_start(tensors: Sequence[torch.Tensor], name: str | None, prescale: float, postscale: float,
                  process_set: Any, wake: bool, single: bool = False) -> int:
    """Adasum allreduce of each tensor (in place): an allgather, then every rank combines the same rows in the
    same order (:mod:`hvdrun.torch.adasum`), so every rank gets identical bits."""
    if process_set is not None and set_id(process_set) != GLOBAL_SET:
        raise ValueError("Adasum runs on the global process set only (as in Horovod)")
    for tensor in tensors:
        if not tensor.is_floating_point():
            raise ValueError(f"Adasum needs floating-point tensors, got {tensor.dtype}")
    base = name if name is not None else _engine().auto_name("adasum")
    flat = [t.detach().reshape(1, -1) for t in tensors]
    items = [_allgather_item(f, base if single else f"{base}.{i}", None, 0 if single else len(flat))
             for i, f in enumerate(flat)]

    def finish(gathered: list[torch.Tensor]) -> Any:
        for tensor, rows in zip(tensors, gathered, strict=True):
            combined = adasum.tree(list(rows.to(torch.float64).numpy() * prescale)) * postscale
            tensor.copy_(torch.from_numpy(combined.reshape(tuple(tensor.shape))).to(tensor.dtype))
        return tensors[0] if single else list(tensors)

    return _grouped(_start_group(items, wake=wake), finish)


class _GroupHandle:
    """Several engine handles that finish together."""

    def __init__(self, handles: Sequence[Handle | _GroupHandle]) -> None:
        self.handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def seen(self) -> None:
        """The caller took up the end of every op (see :meth:`Handle.seen`)."""
        for handle in self.handles:
            handle.seen()

    def wait(self) -> list[Any]:
        """Every output; every handle is waited (and its name freed) even when an earlier one failed."""
        results: list[Any] = []
        error: BaseException | None = None
        for handle in self.handles:
            try:
                results.append(handle.wait())
            except Exception as e:  # noqa: BLE001 - re-raised below, after the others
                error = error or e
                results.append(None)
        if error is not None:
            raise error
        return results


# -- allgather, broadcast, alltoall, reducescatter, barrier -----------------------------------------

def _allgather_item(tensor: torch.Tensor, name: str | None, process_set: Any,
                    group_size: int = 0) -> tuple[Request, np.ndarray, Callable[[Any], Any]]:
    array = _check(tensor, MOVEMENT_DTYPES)
    if array.ndim == 0:
        raise ValueError("allgather needs a tensor with at least one dimension")
    source = dtypes.source_of(tensor, array)
    request = _request("allgather", array, name, source, process_set=set_id(process_set), group_size=group_size)
    return request, array, dtypes.from_wire(source)


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> int:
    """Start an allgather: every rank's tensor concatenated along dim 0, in rank order."""
    return _start(*_allgather_item(tensor, name, process_set))


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0 (first dimensions may differ)."""
    return synchronize(allgather_async(tensor, name, process_set))


def _broadcast_item(tensor: torch.Tensor, root_rank: int, name: str | None,
                    process_set: Any = None) -> tuple[Request, Any, Callable[[Any], Any]]:
    """The request of an in-place broadcast of ``tensor``, its buffer, and what its handle gives back."""
    array = _check(tensor, MOVEMENT_DTYPES)
    request = _request("broadcast", array, name, dtypes.source_of(tensor, array), root=int(root_rank),
                       process_set=set_id(process_set))
    return request, array, lambda _: tensor


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> int:
    """Start an in-place broadcast from ``root_rank``."""
    return _start(*_broadcast_item(tensor, root_rank, name, process_set))


def broadcasts_async_(named: Sequence[tuple[str, torch.Tensor]], root_rank: int) -> list[int]:
    """Start in-place broadcasts of many named tensors in one announcement (one handle each): the engine sees
    them in one cycle, and on the device path they go as one fused broadcast per fusion buffer."""
    return _start_group([_broadcast_item(tensor, root_rank, name) for name, tensor in named])


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> int:
    """Start a broadcast into a new tensor."""
    return broadcast_async_(tensor.detach().clone(memory_format=torch.contiguous_format), root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s value; returns it."""
    request, array, _ = _broadcast_item(tensor, root_rank, name, process_set)
    _run(request, array)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """A new tensor equal to ``root_rank``'s ``tensor``."""
    return broadcast_(tensor.detach().clone(memory_format=torch.contiguous_format), root_rank, name, process_set)


def _splits(array: np.ndarray, splits: Any, size: int) -> tuple[int, ...]:
    if splits is None:
        if array.shape[0] % size:
            raise ValueError(f"alltoall without splits needs dim 0 ({array.shape[0]}) divisible by size ({size})")
        return ()
    values = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    if isinstance(splits, torch.Tensor) and splits.dtype != torch.int32:
        raise ValueError("splits must be an int32 tensor or a list of ints")
    if len(values) != size or any(v < 0 for v in values) or sum(values) > array.shape[0]:
        raise ValueError(f"splits {values} must have {size} non-negative entries summing to at most {array.shape[0]}")
    return tuple(int(v) for v in values)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None) -> int:
    """Start an alltoall; the result is ``(output, received_splits)``."""
    array = _check(tensor, MOVEMENT_DTYPES)
    if array.ndim == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    source = dtypes.source_of(tensor, array)
    request = _request("alltoall", array, name, source, splits=_splits(array, splits, set_size(process_set)),
                       process_set=set_id(process_set))
    restore = dtypes.from_wire(source)
    return _start(request, array, lambda result: (restore(result[0]), _as_tensor(result[1])))


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None) -> Any:
    """Send slice j of dim 0 to rank j, gather what others sent; with ``splits`` also return received splits."""
    output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int | None = None,
                        process_set: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start a reducescatter (default op Average)."""
    return _start(*_reducescatter_item(tensor, name, op, process_set, prescale_factor, postscale_factor))


def _reducescatter_item(tensor: torch.Tensor, name: str | None, op: int | None, process_set: Any,
                        prescale_factor: float, postscale_factor: float,
                        group_size: int = 0) -> tuple[Request, np.ndarray, Callable[[Any], Any]]:
    op = _resolve_op(op, None)
    work, wide = _reduced_in(tensor, op)
    array = _check(work, REDUCTION_DTYPES)
    if array.ndim == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    source = dtypes.source_of(tensor, array)
    request = _request("reducescatter", array, name, source, process_set=set_id(process_set), op=op,
                       prescale=float(prescale_factor), postscale=float(postscale_factor), group_size=group_size)
    if wide is None:
        return request, array, dtypes.from_wire(source)
    return request, array, lambda result: _as_tensor(result).to(tensor.dtype)


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = None, op: int | None = None,
                  process_set: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce across ranks; rank r keeps block r of dim 0 (the first ``dim0 % size`` ranks get one more row)."""
    return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))


def join(device: int = -1) -> int:
    """Declare that this rank has no more data; returns, once all ranks joined, the rank that joined last.

    Until then this rank takes part in the others' allreduces with zeros (Average still divides by
    the full size); other collectives that would need it fail on every rank.
    """
    return int(_engine().run(Request(JOIN, "join")))


def barrier(process_set: Any = None) -> None:
    """Block until every rank reached the barrier."""
    scope = set_id(process_set)
    name = _scoped_name("barrier", None, scope)
    if scope == GLOBAL_SET and allreduce_unqueued(_engine(), _BARRIER_TOKEN, name, SUM, 1.0, 1.0, None):
        return  # every rank posted it on the fast lane
    _engine().run(Request(name, "barrier", process_set=scope))


_BARRIER_TOKEN = np.zeros(1, np.int32)  # what a barrier posts on the fast lane (stays zero: a sum of zeros)


def _grouped(starts: list[int], finish: Callable[[Any], Any] = lambda results: results) -> int:
    """One handle for several started ops, finishing with the list of their outputs."""
    with _handles_lock:
        entries = [_handles.pop(handle) for handle in starts]
        handle_id = next(_handle_ids)
        group = _GroupHandle([handle for handle, _ in entries])
        _handles[handle_id] = (group, lambda outputs: finish([f(o) for (_, f), o in zip(entries, outputs,
                                                                                        strict=True)]))
    return handle_id


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None, process_set: Any = None) -> int:
    """Start an allgather of every tensor of a list, as one group."""
    base = name if name is not None else _engine().auto_name("grouped_allgather")
    return _grouped(_start_group([_allgather_item(t, f"{base}.{i}", process_set, len(tensors))
                                  for i, t in enumerate(tensors)]))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = None) -> list[torch.Tensor]:
    """Every tensor of the list allgathered (first dimensions may differ per rank)."""
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int | None = None,
                                process_set: Any = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start a reducescatter of every tensor of a list, as one group."""
    base = name if name is not None else _engine().auto_name("grouped_reducescatter")
    return _grouped(_start_group([_reducescatter_item(t, f"{base}.{i}", op, process_set, prescale_factor,
                                                      postscale_factor, len(tensors))
                                  for i, t in enumerate(tensors)]))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None, compression: Any = None,
                          op: int | None = None, process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Every tensor of the list reduced and scattered (default op Average)."""
    return synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                                   postscale_factor))


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int, process_set: Any = None) -> Callable[[], Any]:
    """Allreduce a sparse COO tensor by allgathering its indices and values; returns a callable that waits."""
    grad = tensor.coalesce()
    indices = allgather_async(grad.indices().t().contiguous(), f"{name}.indices", process_set)
    values = allgather_async(grad.values().contiguous(), f"{name}.values", process_set)
    divisor = average_divisor(op, set_size(process_set))

    def wait() -> torch.Tensor:
        gathered = synchronize(values)
        if divisor is not None:
            gathered = gathered / divisor
        return torch.sparse_coo_tensor(synchronize(indices).t(), gathered, grad.shape).coalesce()

    return wait
