"""Scheduler jobs: ``hvdrun qsub`` renders, checks and submits a job script; ``qstat``/``qdel`` follow it.

- :mod:`spec` turns the command line and the cluster YAML into a validated :class:`JobSpec`;
- :mod:`render` fills a Jinja2 template from ``templates/`` (layout only; every value is quoted here)
  and checks the script against the scheduler's directive rules;
- :mod:`pbs`, :mod:`cobalt`, :mod:`slurm`: one :class:`~hvdrun.jobs.scheduler.Scheduler` each (directives,
  submit, status, cancel);
- :mod:`follow`: submit, wait and the job registry behind ``hvdrun qstat`` / ``hvdrun qdel``.

The schedulers themselves are listed once, in :mod:`hvdrun.schedulers` (names, default, back-end of
each); this module loads a back-end when first asked for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hvdrun.schedulers import BACKENDS, DEFAULT_SCHEDULER, SCHEDULERS

if TYPE_CHECKING:
    from hvdrun.jobs.scheduler import Scheduler

__all__ = ["DEFAULT_SCHEDULER", "SCHEDULERS", "scheduler_class", "scheduler_for"]


def scheduler_class(kind: str) -> type[Scheduler]:
    """The back-end class of scheduler ``kind`` (one of :data:`SCHEDULERS`)."""
    module, name = BACKENDS[kind].split(":")
    backend: type[Scheduler] = getattr(importlib.import_module(module), name)
    return backend


def scheduler_for(kind: str) -> Scheduler:
    """A back-end of scheduler ``kind`` (one of :data:`SCHEDULERS`)."""
    return scheduler_class(kind)()
