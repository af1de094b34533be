"""Scheduler jobs: ``hvdrun qsub`` renders, checks and submits a job script; ``qstat``/``qdel`` follow it.

- :mod:`spec` turns the command line and the cluster YAML into a validated :class:`JobSpec`;
- :mod:`render` fills a Jinja2 template from ``templates/`` (layout only; every value is quoted here)
  and checks the script against the scheduler's directive rules;
- :mod:`pbs`, :mod:`cobalt`, :mod:`slurm`: one :class:`~hvdrun.jobs.base.Scheduler` each (directives,
  submit, status, cancel);
- :mod:`follow`: submit, wait and the job registry behind ``hvdrun qstat`` / ``hvdrun qdel``.

This module is the one list of schedulers: their names (the CLI's choices, the cluster YAML's
``scheduler.kind``) and the back-end of each. It imports no back-end, so the CLI can read the names
without loading them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hvdrun.jobs.base import Scheduler

# name -> (module, class) of its back-end, loaded when first asked for
_BACKENDS = {
    "pbs": ("hvdrun.jobs.pbs", "Pbs"),
    "cobalt": ("hvdrun.jobs.cobalt", "Cobalt"),
    "slurm": ("hvdrun.jobs.slurm", "Slurm"),
}
SCHEDULERS: tuple[str, ...] = tuple(_BACKENDS)
DEFAULT_SCHEDULER = "pbs"  # when nothing names one: a cluster YAML without scheduler.kind, qstat of an unrecorded job


def scheduler_class(kind: str) -> type[Scheduler]:
    """The back-end class of scheduler ``kind`` (one of :data:`SCHEDULERS`)."""
    module, name = _BACKENDS[kind]
    backend: type[Scheduler] = getattr(importlib.import_module(module), name)
    return backend


def scheduler_for(kind: str) -> Scheduler:
    """A back-end of scheduler ``kind`` (one of :data:`SCHEDULERS`)."""
    return scheduler_class(kind)()
