"""The one list of batch schedulers hvdrun knows: their names, the default, and where each back-end lives.

Read by the CLI (its ``--scheduler`` choices), the cluster YAML (``scheduler.kind``) and
:mod:`hvdrun.jobs` (which loads a back-end only when asked: :func:`hvdrun.jobs.scheduler_for`). It
imports nothing, so every floor of the package can read it.
"""

from __future__ import annotations

# name -> "module:class" of its back-end (a hvdrun.jobs.scheduler.Scheduler)
PBS, COBALT, SLURM = "pbs", "cobalt", "slurm"
BACKENDS: dict[str, str] = {
    PBS: "hvdrun.jobs.pbs:Pbs",
    COBALT: "hvdrun.jobs.cobalt:Cobalt",
    SLURM: "hvdrun.jobs.slurm:Slurm",
}
SCHEDULERS: tuple[str, ...] = tuple(BACKENDS)
DEFAULT_SCHEDULER = PBS  # when nothing names one: a cluster YAML without scheduler.kind, qstat of an unrecorded job
