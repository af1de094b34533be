"""``hvdrun check``: can these hosts run a job?

- :mod:`check`: plans the check on the job's hosts, runs it, and judges the result (:class:`CheckReport`);
- :mod:`host_checks`: every host at once (reach, Python, hvdrun, torch, GPUs, disk, a port), from the launcher;
- :mod:`on_host`: what runs on each host for that (``python -m hvdrun.health.on_host facts|listen|connect|clock``);
- :mod:`node_health` (on the host, stdlib only) and :mod:`node_checks` (the verdicts): ``--health``, a node's
  network interface, mounts, node-local space, GPU vendor tools and clock;
- :mod:`preflight`: ``hvdrun --preflight``, the node checks on every host of a job before its ranks start;
- :mod:`verdict`: :class:`Check`, one verdict;
- :mod:`check_job`: the allreduce job run on every slot (``python -m hvdrun.health.check_job``);
- :mod:`report`: the report on a terminal (rich).

Timing collectives and running a job whose output is read are shared with ``hvdrun bench``
(:mod:`hvdrun.measure`).
"""
