"""Optimizer steps counted for the live view (``hvdrun top``): every ``optimizer.step()`` of the process, wrapped
in a :func:`~hvdrun.torch.DistributedOptimizer` or not, through torch's global step hooks.

A ``DistributedOptimizer`` is a subclass of the user's optimizer whose ``step()`` calls the parent's, and torch
runs the hooks around both (pre, pre, post, post): a step counts at the first post hook after a pre hook, which
also holds when a step raised and left its post hooks out.
"""

from __future__ import annotations

from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from hvdrun.runtime import context

_stepping = False  # a step() began and none of its calls returned yet
_installed = False


def count_optimizer_steps() -> None:
    """Count this process's optimizer steps in its runtime's flight recorder (idempotent)."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_entered)
        register_optimizer_step_post_hook(_left)
        _installed = True


def _entered(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _stepping
    _stepping = True


def _left(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _stepping
    runtime = context.current_or_none()
    if _stepping and runtime is not None:
        runtime.engine.recorder.steps += 1
    _stepping = False
