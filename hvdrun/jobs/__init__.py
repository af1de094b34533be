"""Scheduler jobs: ``hvdrun qsub`` renders, checks and submits a job script; ``qstat``/``qdel`` follow it.

- :mod:`spec` turns the command line and the cluster YAML into a validated :class:`JobSpec`;
- :mod:`render` fills a Jinja2 template from ``templates/`` (layout only; every value is quoted here)
  and checks the script against the scheduler's directive rules;
- :mod:`pbs`, :mod:`cobalt`, :mod:`slurm`: one :class:`~hvdrun.jobs.base.Scheduler` each (directives,
  submit, status, cancel);
- :mod:`follow`: submit, wait and the job registry behind ``hvdrun qstat`` / ``hvdrun qdel``.
"""
