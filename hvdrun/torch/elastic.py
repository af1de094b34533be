"""Horovod's elastic API for PyTorch (``hvd.elastic``): training that survives workers leaving and joining.

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                step()
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    train(state)

:func:`run` calls the function; when a collective fails because a peer died
(:class:`HorovodInternalError`) it restores the last commit, when the launcher reports new or
removed hosts at a commit (:class:`HostsUpdatedInterrupt`) it keeps the current state; either way
it re-forms the job (``shutdown()`` then ``init()``: new ranks, new size), broadcasts the state
from the new rank 0 (a worker of the previous round) and calls the function again. Outside an
elastic job (no ``--min-np``/``--max-np``/``--host-discovery-script``) it calls the function once.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hvdrun.errors import CollectiveError as HorovodInternalError
from hvdrun.errors import HostsUpdatedInterrupt
from hvdrun.runtime import context
from hvdrun.runtime.membership import WorkerRemoved, host_updates
from hvdrun.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from hvdrun.torch.lasting_state import keep_at_commit, resume


def _rank() -> int:
    return context.current().world.rank


class State:
    """What an elastic run keeps across resets: ``save()`` at each commit, ``restore()`` after a failure,
    ``sync()`` from rank 0 after each reset. Subclasses say what is saved."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after every reset (e.g. to scale the learning rate to the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (the job has just re-formed)."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state, keep it in ``--state-dir`` when due (:mod:`hvdrun.torch.lasting_state`: at the warning
        before the walltime the job then ends), then check whether hosts were added or removed (all ranks call it
        together)."""
        self.save()
        keep_at_commit(self)
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank when the launcher changed the workers.

        Rank 0 asks the launcher and broadcasts the answer, so every rank decides the same.
        """
        runtime = context.current()
        if runtime.assignment is None:
            return
        count = host_updates(os.environ) if runtime.world.rank == 0 else None
        count = broadcast_object(count, 0, name="hvdrun.elastic.host_updates")
        if count > runtime.assignment.updates:
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Keep a copy of the state (the last commit)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last commit."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's."""
        raise NotImplementedError

    def snapshot(self) -> dict[str, Any]:
        """The last commit, as plain data ``torch.save`` can write (what ``--state-dir`` keeps across jobs)."""
        raise NotImplementedError

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Make ``snapshot`` (from :meth:`snapshot`) the last commit and go back to it."""
        raise NotImplementedError


class ObjectState(State):
    """Plain attributes (``epoch=0, batch=0``), broadcast with one ``broadcast_object``."""

    def __init__(self, bcast_object: Callable[..., Any] = broadcast_object, get_rank: Callable[[], int] = _rank,
                 **kwargs: Any) -> None:
        self._bcast_object, self._get_rank = bcast_object, get_rank
        self._saved_state = dict(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        super().__init__()

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self) -> None:
        if self._saved_state:
            values = self._bcast_object({name: getattr(self, name) for name in self._saved_state}, 0,
                                        name="hvdrun.elastic.object_state")
            for name, value in values.items():
                setattr(self, name, value)
            self.save()

    def snapshot(self) -> dict[str, Any]:
        return {"attributes": copy.deepcopy(self._saved_state)}

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        self._saved_state.update({name: value for name, value in snapshot.get("attributes", {}).items()
                                  if name in self._saved_state})
        self.restore()


class _Handler:
    """How one kind of value (a model, an optimizer, a sampler) is saved, restored and synced."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        raise NotImplementedError


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def restore(self) -> None:
        super().restore()
        reset_pending = getattr(self.value, "reset_pending", None)
        if reset_pending is not None:  # a DistributedOptimizer: drop what went to the failed runtime
            reset_pending()

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0, name="hvdrun.elastic.sampler"))


def _handler_for(value: Any) -> _Handler | None:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class TorchState(ObjectState):
    """A model, an optimizer, samplers and plain attributes, saved and restored together.

    ``state.model = new_model`` replaces a handled value and saves it at once.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        values = {"model": model, "optimizer": optimizer, **kwargs}
        handlers = {name: _handler_for(value) for name, value in values.items() if value is not None}
        self._handlers: dict[str, _Handler] = {name: h for name, h in handlers.items() if h is not None}
        plain = {name: value for name, value in values.items() if name not in self._handlers}
        for name, handler in self._handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name] = _handler_for(value) or handlers[name]
        object.__setattr__(self, name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()
        for handler in self._handlers.values():
            handler.save()

    def snapshot(self) -> dict[str, Any]:
        return {**super().snapshot(), "handled": {name: h.saved for name, h in self._handlers.items()}}

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        for name, saved in snapshot.get("handled", {}).items():
            if name in self._handlers:
                self._handlers[name].saved = saved
        super().load_snapshot(snapshot)  # restores the handled values too


class ElasticSampler(torch.utils.data.Sampler):
    """Like ``DistributedSampler``, but after a reset it splits only the samples not yet processed this
    epoch among the new ranks.

    Call ``record_batch(batch_idx, batch_size)`` after each batch and ``set_epoch(epoch)`` at each
    epoch's end; put the sampler in the :class:`TorchState` so its progress is committed.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: nothing of it is processed yet."""
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a batch every rank processed."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        """``{epoch, processed_num}``."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from a :meth:`state_dict`, re-split for the current ranks."""
        self.epoch, self.processed_num = state["epoch"], state["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Re-split the remaining samples for the current rank and size."""
        runtime = context.current() if context.is_initialized() else None
        self.num_replicas = runtime.world.size if runtime else 1
        self.rank = runtime.world.rank if runtime else 0
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            indices = list(range(len(self.dataset)))
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        indices += indices[:self.total_size - len(indices)]  # pad so every rank gets as many
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``func(state, *args, **kwargs)`` to run elastically (see the module's description)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        context.init()
        resume(state)
        if context.current().assignment is None:  # not an elastic job: nothing to recover from
            state.sync()
            return func(state, *args, **kwargs)
        try:
            return _run_elastic(func, state, args, kwargs)
        except WorkerRemoved as e:
            print(f"hvdrun: elastic: this worker leaves the job: {e}", file=sys.stderr, flush=True)
            raise SystemExit(0) from None

    return wrapper


def _run_elastic(func: Callable[..., Any], state: State, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    reset, skip_sync = False, False
    while True:
        try:
            if reset:
                context.shutdown()
                context.init()
                state.on_reset()
                reset = False
            if not skip_sync:
                state.sync()
            return func(state, *args, **kwargs)
        except HorovodInternalError:
            state.restore()
            reset, skip_sync = True, False
        except HostsUpdatedInterrupt as e:
            reset, skip_sync = True, e.skip_sync


__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState",
           "run"]
