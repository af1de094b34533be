"""Collectives on device tensors through a torch.distributed process group: NCCL on CUDA (and on
ROCm builds, whose ``torch.cuda`` is HIP and whose NCCL is RCCL), XCCL on Intel GPUs (``xpu``).

Device tensors are negotiated by the engine like any other op (names, mismatch checks,
ordering); only the execution differs: it runs on a process group built from a TCPStore that rank 0
opened at ``init()`` and announced in the authenticated rendezvous table, ready ops that agree fused
into one collective on a flat buffer (:mod:`hvdrun.runtime.device_buffers`), on a side stream of the
device. The group is created lazily by the first device op, which every rank executes at the same
point of the negotiated order (a process set's group by its first op).

``HVDRUN_DEVICE_BACKEND`` picks the group's backend (default: ``nccl`` when CUDA or ROCm is available,
``xccl`` when an Intel GPU is and the installed torch has XCCL, ``ccl`` with Intel's oneCCL bindings);
``HVDRUN_CPU_VIA_DEVICE_BACKEND=1`` also sends CPU tensors this way, which lets CPU-only machines
test this path with ``gloo``.
"""

from __future__ import annotations

import datetime
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hvdrun.envvars import DEVICE_BACKEND, DEVICE_ORDINAL, RANK
from hvdrun.errors import DeviceError, UsageError
from hvdrun.runtime import gloo_abort
from hvdrun.runtime.device_buffers import FusionBuffers, SideStreams
from hvdrun.runtime.negotiation import Entry, Request
from hvdrun.runtime.reduce import (
    AVERAGE,
    MAX,
    MIN,
    PRODUCT,
    SUM,
    chunk_bounds,
    default_splits,
    final_factor,
    scale_tensor,
)

DEVICE_BACKENDS = ("nccl", "xccl", "ccl", "gloo")


def device_backend_name(environ: Mapping[str, str]) -> str | None:
    """The torch.distributed backend for device tensors, or None when there is no device path."""
    name = environ.get(DEVICE_BACKEND, "").lower()
    if name and name not in DEVICE_BACKENDS:
        raise UsageError(f"{DEVICE_BACKEND}={name!r}; expected one of {', '.join(DEVICE_BACKENDS)}")
    torch = sys.modules.get("torch")  # never import torch for numpy-only users
    if name or torch is None:
        return name or None
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        return "nccl"  # CUDA, or ROCm (HIP behind torch.cuda, RCCL behind NCCL)
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        if getattr(torch.distributed, "is_xccl_available", lambda: False)():
            return "xccl"
        if "CCL" in torch.distributed.Backend._plugins:  # oneccl_bindings_for_pytorch, imported by the script
            return "ccl"
    return None


def own_device_ordinal(environ: Mapping[str, str], local_rank: int, count: int) -> int | None:
    """Which of the ``count`` devices this rank sees is its own: the ordinal hvdrun's launcher chose
    (``HVDRUN_DEVICE_ORDINAL``), else, where another launcher started it (mpiexec, srun: no ``HVDRUN_RANK``),
    ``local_rank`` among them. None without devices, for a job hvdrun started with no GPUs given out (it
    leaves CUDA alone), or when the launcher's ordinal is not among them (the script changed what it sees)."""
    given = environ.get(DEVICE_ORDINAL, "")
    if count < 1 or not given and RANK in environ:
        return None
    if given.isdigit():
        return int(given) if int(given) < count else None
    return local_rank % count


def select_current_device(environ: Mapping[str, str], local_rank: int) -> str | None:
    """Make this rank's own GPU the current device (``cuda`` or ``xpu``) unless the script already chose one
    (its runtime is initialised); returns it as ``cuda:N``, or None. Never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    for kind in ("cuda", "xpu"):
        module = getattr(torch, kind, None)
        if module is None or not module.is_available():
            continue
        if getattr(module, "is_initialized", lambda: False)():
            return None
        ordinal = own_device_ordinal(environ, local_rank, module.device_count())
        if ordinal is None:
            return None
        module.set_device(ordinal)
        return f"{kind}:{ordinal}"
    return None


def _new_group(backend: str, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """A process group of ``backend``; DeviceError when this torch has none."""
    import torch.distributed as dist

    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "xccl" and getattr(dist, "is_xccl_available", lambda: False)() and hasattr(dist, "ProcessGroupXCCL"):
        xccl_options = dist.ProcessGroupXCCL.Options()
        xccl_options._timeout = timeout
        return dist.ProcessGroupXCCL(store, rank, size, xccl_options)
    plugin = dist.Backend._plugins.get(backend.upper())
    if backend == "ccl" and plugin is not None:
        return plugin.creator_fn(store, rank, size, timeout)
    needs = {"xccl": "a torch built for Intel GPUs (XPU, 2.8 or later), whose torch.distributed.is_xccl_available() "
                     "is True", "ccl": "Intel's oneccl_bindings_for_pytorch, imported before hvd.init()"}[backend]
    raise DeviceError(f"{DEVICE_BACKEND}={backend}: this torch ({_torch_version()}) has no {backend.upper()} "
                      f"process group; it needs {needs}, or set {DEVICE_BACKEND}=gloo")


def _torch_version() -> str:
    torch = sys.modules.get("torch")
    return str(getattr(torch, "__version__", "?"))


class TorchGroup:
    """Tensor collectives on one torch.distributed process group (blocking). A gloo group given ``abort_reason``
    (the job's abort flag) ends its ops when the job aborts (:mod:`hvdrun.runtime.gloo_abort`)."""

    def __init__(self, group: Any, rank: int, size: int, abort_reason: Callable[[], str | None] | None = None,
                 connections: Sequence[int] = ()) -> None:
        import torch.distributed as dist

        self.group, self.rank, self.size, self.dist = group, rank, size, dist
        self.abort_reason, self.connections = abort_reason, list(connections)
        self.calls = 0  # collectives run on the group: what fusion saves is counted here
        self.ops: dict[int, Any] = {SUM: dist.ReduceOp.SUM, AVERAGE: dist.ReduceOp.SUM, MIN: dist.ReduceOp.MIN,
                    MAX: dist.ReduceOp.MAX, PRODUCT: dist.ReduceOp.PRODUCT}

    @classmethod
    def create(cls, backend: str, store: Any, prefix: str, rank: int, size: int, timeout_s: float,
               abort_reason: Callable[[], str | None] | None = None) -> TorchGroup:
        """A new process group of ``backend`` on ``store`` (keys under ``prefix``); ``abort_reason``: see the
        class (gloo only: other backends' waits do not block on peers)."""
        import torch.distributed as dist

        def new_group() -> Any:
            return _new_group(backend, dist.PrefixStore(prefix, store), rank, size,
                              datetime.timedelta(seconds=timeout_s))

        if backend != "gloo" or abort_reason is None:
            return cls(new_group(), rank, size)
        group, connections = gloo_abort.opened_connections(new_group)
        return cls(group, rank, size, abort_reason, connections)

    def close(self) -> None:
        """Let go of the process group now, while the interpreter is whole: a gloo group destroyed during its
        exit may call std::terminate (SIGABRT) instead of returning."""
        self.group = None

    def _finish(self, work: Any) -> None:
        """Wait for ``work`` (with ``abort_reason``: until done or the job aborts)."""
        self.calls += 1
        if self.abort_reason is None:
            work.wait()
        else:
            gloo_abort.wait_or_abort(work, self.abort_reason, self.connections, self.group)

    def allreduce(self, tensor: Any, op: int) -> None:
        """In place; int16, which neither NCCL nor gloo reduces, goes through int32 (wrapping the same way), and
        floating Max/Min propagate NaN as hvdrun's other paths do (one more allreduce of a byte mask)."""
        import torch

        if tensor.dtype == torch.int16:
            wide = tensor.int()
            self.allreduce(wide, op)
            tensor.copy_(wide)
            return
        nan = tensor.isnan().to(torch.uint8) if op in (MIN, MAX) and tensor.is_floating_point() else None
        if nan is not None:
            self._allreduce(nan, MAX)
        self._allreduce(tensor, op)
        if nan is not None:
            tensor.masked_fill_(nan.bool(), float("nan"))

    def _allreduce(self, tensor: Any, op: int) -> None:
        options = self.dist.AllreduceOptions()
        options.reduceOp = self.ops[op]
        self._finish(self.group.allreduce([tensor], options))

    def broadcast(self, tensor: Any, root: int) -> None:
        options = self.dist.BroadcastOptions()
        options.rootRank = root
        self._finish(self.group.broadcast([tensor], options))

    def allgather(self, tensor: Any, rows: list[int]) -> Any:
        """Concatenate every rank's tensor along dim 0 (rows may differ: padded to the largest)."""
        import torch

        width = max(rows)
        padded = torch.zeros((width,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded[:tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in rows]
        self._finish(self.group.allgather([gathered], [padded]))
        return torch.cat([part[:count] for part, count in zip(gathered, rows, strict=True)])

    def alltoall(self, output: Any, tensor: Any, out_splits: list[int], in_splits: list[int]) -> None:
        self._finish(self.group.alltoall_base(output, tensor, out_splits, in_splits, self.dist.AllToAllOptions()))


class LocalGroup(TorchGroup):
    """The group of a one-rank job: every collective is a local copy."""

    def __init__(self) -> None:  # noqa: D107 - no process group to hold
        self.rank, self.size, self.calls = 0, 1, 0

    def allreduce(self, tensor: Any, op: int) -> None:
        return None

    def broadcast(self, tensor: Any, root: int) -> None:
        return None

    def allgather(self, tensor: Any, rows: list[int]) -> Any:
        return tensor.clone()

    def alltoall(self, output: Any, tensor: Any, out_splits: list[int], in_splits: list[int]) -> None:
        output.copy_(tensor)


def as_rows_of_bytes(tensor: Any) -> Any:
    """A ``(rows, bytes_per_row)`` uint8 view: moving data needs no dtype (NCCL and gloo lack int16)."""
    import torch

    rows = tensor.shape[0] if tensor.ndim else 1
    per_row = math.prod(tensor.shape[1:]) if tensor.ndim else 1
    if not tensor.numel():  # empty tensors have no usable strides; there is nothing to write into them
        return torch.empty((rows, per_row * tensor.element_size()), dtype=torch.uint8, device=tensor.device)
    return tensor.reshape(rows, per_row).view(torch.uint8)


class DeviceCollectives:
    """Executes negotiated ops whose tensors live on a device (or CPU, when routed here for tests)."""

    def __init__(self, backend: str, store: Any, prefix: str, rank: int, size: int, timeout_s: float,
                 abort_reason: Callable[[], str | None] | None = None) -> None:
        self.backend, self._store, self.prefix = backend, store, prefix
        self.rank, self.size, self.timeout_s, self.abort_reason = rank, size, timeout_s, abort_reason
        self._group: TorchGroup | None = None
        self._set_groups: dict[tuple[int, ...], TorchGroup] = {}  # process sets' groups, by their global ranks
        self.buffers, self.streams = FusionBuffers(), SideStreams()

    @property
    def group(self) -> TorchGroup:
        """The process group, created by the first device op (all ranks reach it in the same order)."""
        if self._group is None and self.size == 1:
            self._group = LocalGroup()
        if self._group is None:
            members = range(self.size)
            self._group = TorchGroup.create(self._backend_of(self.prefix, members), self._store, self.prefix,
                                            self.rank, self.size, self.timeout_s, self.abort_reason)
        return self._group

    def group_of(self, members: Sequence[int]) -> TorchGroup:
        """The process group of the ranks ``members`` (global ranks, this rank among them): the job's own group
        for all of them, else one made for the set by its first device op (every member reaches it in the same
        negotiated order), on the job's backend."""
        if len(members) == self.size:
            return self.group
        key = tuple(members)
        group = self._set_groups.get(key)
        if group is None:  # only the members take part: the job's group may not exist yet, nor ever be needed
            prefix = f"{self.prefix}/set-{'-'.join(map(str, key))}"
            group = self._set_groups[key] = TorchGroup.create(
                self._backend_of(prefix, key), self._store, prefix, key.index(self.rank), len(key), self.timeout_s,
                self.abort_reason) if len(key) > 1 else LocalGroup()
        return group

    def _backend_of(self, prefix: str, members: Sequence[int]) -> str:
        """The backend of a group of ``members``: the job's, but gloo where NCCL would refuse it (two of them on
        one GPU)."""
        return "gloo" if self.backend == "nccl" and self._shared_gpu(prefix, members) else self.backend

    @property
    def collectives(self) -> int:
        """Collectives run on the process groups so far (one per fused buffer)."""
        groups = [self._group, *self._set_groups.values()]
        return sum(group.calls for group in groups if group is not None)

    def _shared_gpu(self, prefix: str, members: Sequence[int]) -> bool:
        """Whether two of ``members`` use the same GPU (NCCL refuses that), warned once by the first of them.

        Every member publishes its current device's UUID under the group's prefix and reads all of
        them, so every member reaches the same verdict and builds the same kind of group.
        """
        import torch
        import torch.distributed as dist

        store = dist.PrefixStore(prefix + "/gpus", self._store)
        store.set(str(self.rank), str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid))
        owners: dict[str, list[int]] = {}
        for rank in members:
            owners.setdefault(store.get(str(rank)).decode(), []).append(rank)
        shared = [ranks for ranks in owners.values() if len(ranks) > 1]
        if shared and self.rank == members[0]:
            print(f"hvdrun: ranks {', '.join(map(str, shared[0]))} share one GPU, which NCCL refuses; device "
                  "tensors go through gloo instead (slower). Give each rank its own GPU with --gpus-per-node, "
                  f"or set {DEVICE_BACKEND}=gloo to choose this yourself.", file=sys.stderr, flush=True)
        return bool(shared)

    def abort(self) -> None:
        """End the communicators of a backend whose waits never look at the job's abort (NCCL, XCCL: a collective
        whose peer died waits on the device, and ``work.wait()`` returned long before): their pending kernels end
        in an error instead of hanging the device until NCCL's watchdog. gloo's waits look at the flag themselves
        (:mod:`hvdrun.runtime.gloo_abort`)."""
        if self.backend == "gloo":
            return
        for group in [self._group, *self._set_groups.values()]:
            inner = getattr(group, "group", None)
            end = getattr(inner, "abort", None) or getattr(inner, "_abort", None)
            if callable(end):
                end()

    def close(self) -> None:
        """Let go of the process group and its store (see :meth:`TorchGroup.close`)."""
        for group in [self._group, *self._set_groups.values()]:
            if group is not None:
                group.close()
        self._group, self._store, self._set_groups = None, None, {}
        self.buffers.clear()

    def execute(self, kind: str, batch: list[Entry], tensors: list[Any]) -> list[Any]:
        """One result per tensor of ``batch``, on the device's side stream: a batch of several allreduces,
        broadcasts or allgathers (the plan fuses only ops that agree) runs as one collective on a fusion buffer. A
        rank outside the ops' process set has nothing to do (its stand-ins are returned as they are)."""
        if batch[0].members and self.rank not in batch[0].members:
            return tensors
        with self.streams.running(tensors):
            if len(batch) > 1 and kind == "allgather":
                return self._fused_allgather(batch, tensors)
            if len(batch) > 1 and kind in ("allreduce", "broadcast"):
                return getattr(self, f"_fused_{kind}")(batch[0], tensors)
            return [getattr(self, f"_{kind}")(entry, tensor) for entry, tensor in zip(batch, tensors, strict=True)]

    def _fused_allreduce(self, entry: Entry, tensors: list[Any]) -> list[Any]:
        """Tensors of one dtype and device reduced as one flat buffer, scaled there (one pass each way)."""
        import torch

        flat, views = self.buffers.views(tensors)
        flattened = [t.view(-1) for t in tensors]
        torch._foreach_copy_(views, flattened)
        self.allreduce(entry.first, flat, entry.members)
        torch._foreach_copy_(flattened, views)
        return tensors

    def _fused_broadcast(self, entry: Entry, tensors: list[Any]) -> list[Any]:
        """Tensors of any dtypes broadcast from one root as one buffer of bytes."""
        import torch

        pieces = [as_rows_of_bytes(t).view(-1) for t in tensors if t.numel()]
        if not pieces:
            return tensors
        flat, views = self.buffers.views(pieces)
        root = entry.first.root
        if self.rank == root:
            torch._foreach_copy_(views, pieces)
        self.group_of(entry.members).broadcast(flat, list(entry.members).index(root))
        if self.rank != root:
            torch._foreach_copy_(pieces, views)
        return tensors

    def _fused_allgather(self, batch: list[Entry], tensors: list[Any]) -> list[Any]:
        """Allgathers of any dtypes and shapes as one: each rank's tensors packed as bytes, one gather of the packs
        (padded to the largest), then every rank's piece of every tensor taken out in rank order."""
        import torch

        row_bytes = [math.prod(t.shape[1:]) * t.element_size() for t in tensors]
        rows = [[entry.requests[r].shape[0] for r in range(self.size)] for entry in batch]
        packs = [sum(rows[i][r] * row_bytes[i] for i in range(len(batch))) for r in range(self.size)]
        shapes = [(sum(rows[i]),) + tuple(t.shape[1:]) for i, t in enumerate(tensors)]
        if not max(packs):
            return [t.new_empty(shape) for t, shape in zip(tensors, shapes, strict=True)]
        pieces = [as_rows_of_bytes(t).reshape(-1) for t in tensors]
        flat, views = self.buffers.views(pieces)
        torch._foreach_copy_(views, pieces)
        gathered = self.group.allgather(flat.view(-1, 1), packs).view(-1)
        parts: list[list[Any]] = [[] for _ in batch]
        offset = 0
        for rank in range(self.size):
            for i in range(len(batch)):
                size = rows[i][rank] * row_bytes[i]
                parts[i].append(gathered[offset:offset + size])
                offset += size
        return [torch.cat(part).view(t.dtype).reshape(shape) for part, t, shape in zip(parts, tensors, shapes,
                                                                                        strict=True)]

    def _allreduce(self, entry: Entry, tensor: Any) -> Any:
        return self.allreduce(entry.first, tensor, entry.members)

    def allreduce(self, request: Request, tensor: Any, members: Sequence[int] = ()) -> Any:
        """Allreduce ``tensor`` in place among ``members`` (global ranks; none given: the whole job), by
        ``request``'s op and scale factors."""
        group = self.group_of(members) if members else self.group
        scale_tensor(tensor, request.prescale)
        group.allreduce(tensor, request.op)
        scale_tensor(tensor, final_factor(request.op, request.postscale, group.size))
        return tensor

    def _broadcast(self, entry: Entry, tensor: Any) -> Any:
        if tensor.numel():
            members = list(entry.members)
            self.group_of(members).broadcast(as_rows_of_bytes(tensor), members.index(entry.first.root))
        return tensor

    def _allgather(self, entry: Entry, tensor: Any) -> Any:
        rows = [entry.requests[r].shape[0] for r in range(self.size)]
        if not math.prod(tensor.shape[1:]) or not max(rows):
            return tensor.new_empty((sum(rows),) + tuple(tensor.shape[1:]))
        gathered = self.group.allgather(as_rows_of_bytes(tensor), rows)
        return gathered.view(tensor.dtype).reshape((sum(rows),) + tuple(tensor.shape[1:]))

    def _alltoall(self, entry: Entry, tensor: Any) -> Any:
        import torch

        splits = [_splits(entry.requests[r], self.size) for r in range(self.size)]
        received = [splits[r][self.rank] for r in range(self.size)]
        output = torch.empty((sum(received),) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        if output.numel() or tensor.numel():
            self.group.alltoall(as_rows_of_bytes(output), as_rows_of_bytes(tensor[:sum(splits[self.rank])]),
                                received, splits[self.rank])
        return output, torch.tensor(received, dtype=torch.int32)

    def _reducescatter(self, entry: Entry, tensor: Any) -> Any:
        request, work = entry.first, tensor.clone()
        scale_tensor(work, request.prescale)
        self.group.allreduce(work, request.op)
        first, last = chunk_bounds(tensor.shape[0], self.size)[self.rank]
        out = work[first:last].clone()
        scale_tensor(out, final_factor(request.op, request.postscale, self.size))
        return out


def _splits(request: Request, size: int) -> list[int]:
    return list(request.splits) if request.splits else default_splits(request.shape[0], size)
