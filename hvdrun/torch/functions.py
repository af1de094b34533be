"""Helpers around the collectives: broadcast of model and optimizer state, of objects, and checkpoints."""

from __future__ import annotations

import glob
import os
import pickle
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from hvdrun.runtime import context
from hvdrun.torch.ops import allgather, broadcast_, broadcasts_async_, synchronize


def _rank() -> int:
    return context.current().world.rank


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite every tensor of ``params`` with root's, in place.

    Args:
        params: ``model.state_dict()`` (processed in sorted key order), or a list of tensors or of
            ``(name, tensor)`` pairs such as ``model.named_parameters()``.
        root_rank: the rank whose values win.
    """
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = [p if isinstance(p, tuple) else (f"param.{i}", p) for i, p in enumerate(params)]
    else:
        raise ValueError(f"params must be a dict or a list of tensors or (name, tensor) pairs, got {type(params)}")
    named = [(f"broadcast.param.{name}", tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor)
             for name, tensor in items if isinstance(tensor, torch.Tensor)]
    for handle in broadcasts_async_(named, root_rank):  # one announcement: fused on the device path
        synchronize(handle)


def _part(name: str | None, part: str) -> str | None:
    """The name of one of a helper's ops: ``NAME.part``, or None (named in call order, on every rank alike:
    never from the object, whose type may differ on a non-root rank)."""
    return f"{name}.{part}" if name is not None else None


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None) -> Any:
    """Root's ``obj`` on every rank of ``process_set`` (pickled; ranks of one job trust each other).

    ``root_rank`` is a global rank, a member of the set.
    """
    payload = pickle.dumps(obj) if _rank() == root_rank else b""
    length = broadcast_(torch.tensor([len(payload)], dtype=torch.int64), root_rank, name=_part(name, "length"),
                        process_set=process_set)
    buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(
        int(length.item()), dtype=torch.uint8)
    broadcast_(buffer, root_rank, name=_part(name, "bytes"), process_set=process_set)
    return obj if _rank() == root_rank else pickle.loads(buffer.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Every member's ``obj``, in the order of the set's ranks (every rank's, by rank, for the global set)."""
    payload = pickle.dumps(obj)
    sizes = allgather(torch.tensor([len(payload)], dtype=torch.int64), name=_part(name, "sizes"),
                      process_set=process_set).tolist()
    data = allgather(torch.frombuffer(bytearray(payload), dtype=torch.uint8), name=_part(name, "bytes"),
                     process_set=process_set).numpy()
    objects, start = [], 0
    for size in sizes:
        objects.append(pickle.loads(data[start:start + size].tobytes()))
        start += size
    return objects


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Make every rank's optimizer state and hyper-parameters equal to root's, in place.

    State that does not exist yet (before the first step) is created first by a step of the base
    optimizer on zero gradients, as Horovod does; non-tensor values (betas, lr, step counts kept
    as numbers) travel in one broadcast object.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state_dict()["state"]:
        _create_state(optimizer)
    state_dict = optimizer.state_dict()
    tensors, others = {}, {}
    for pid, state in state_dict["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{key}"] = value
            else:
                others[(pid, key)] = value
    broadcast_parameters(tensors, root_rank)
    options = [{k: v for k, v in group.items() if k != "params"} for group in state_dict["param_groups"]]
    options, others = broadcast_object((options, others), root_rank, name="optimizer.options")
    for group, values in zip(optimizer.param_groups, options, strict=True):
        group.update(values)
    by_index = _params_by_index(optimizer)
    for (pid, key), value in others.items():
        optimizer.state[by_index[pid]][key] = value


def _params_by_index(optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return dict(enumerate(params))


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """A step of the base optimizer on zero gradients creates its state. The zero gradients stay, as in
    Horovod (sparse ones for SparseAdam), so ``hvd.broadcast(p.grad, 0)`` works afterwards."""
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param).to_sparse() if sparse else torch.zeros_like(param)
    base_step = getattr(optimizer, "_base_step", optimizer.step)  # bypass DistributedOptimizer's allreduce
    base_step()


_TEMP_MARK = "hvdrun-tmp."


def save_checkpoint(obj: Any, path: str | os.PathLike[str]) -> Path | None:
    """On rank 0, write ``torch.save(obj)`` to ``path`` atomically (temp file, fsync, rename); others do nothing.

    The object is streamed into ``.NAME.hvdrun-tmp.*`` beside ``path``; such files left by a save
    that was killed mid-write are removed by the next save.

    Returns:
        The path written on rank 0, None elsewhere.
    """
    if _rank() != 0:
        return None
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}.{_TEMP_MARK}"
    for stale in target.parent.glob(f"{glob.escape(prefix)}*"):  # left by a save that was killed mid-write
        stale.unlink(missing_ok=True)
    fd, temp = tempfile.mkstemp(prefix=prefix, dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)  # streamed: the checkpoint is never held in memory a second time
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return target
