"""What runs on the hosts, next to or as the ranks; the launcher side stays in :mod:`hvdrun.launch`.

* ``guard.py``: leads each rank's process group and stops it when hvdrun's lifeline ends
  (run as a script, standard library only);
* ``escapees.py``: the guard's hold on what its rank starts: a cgroup of its own, else a child subreaper, so
  processes that leave the rank's process group and environment are still stopped with it;
* ``cpubind.py``: which cores ``--cpu-bind`` gives each local rank (the launcher checks it, the guard applies it);
* ``forkserver.py``: forks each rank's guard (one Python start per host, not per rank), and its client;
* ``zygote.py``: a local fork server forked by a process that already imported torch (a test suite's), not spawned;
* ``host_agent/``: a host's agent under one SSH channel (``python -m hvdrun.launch.remote.host_agent.main``): runs
  the host's ranks, reaches the hosts beneath it, speaks hvdrun's frames and tagged lines;
* ``connections.py``: SSH connections with verified host keys, for hvdrun and for the agents alike;
* ``mpirank.py``: the shim mpiexec starts as each rank (``python -m hvdrun.launch.remote.mpirank``);
* ``task.py``: a rank of :func:`hvdrun.run` (``python -m hvdrun.launch.remote.task``);
* ``hostfacts.py``: what a host says about itself before ranks start there
  (``python -m hvdrun.launch.remote.hostfacts``, and the agents' first answer);
* ``lines.py``: byte streams cut into lines and tagged lines, which the shim, the agents and the launcher's
  output router share.
"""
