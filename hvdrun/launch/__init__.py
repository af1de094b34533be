"""Launchers: start the workers of a job and supervise them (see ``base.py``).

What runs on the hosts, next to or as the ranks (the guard, the mpiexec rank shim, a rank of
:func:`hvdrun.run`, the host probe), lives in :mod:`hvdrun.launch.remote`; an elastic job's driver, pool,
discovery and membership service in :mod:`hvdrun.launch.elastic`.
"""
