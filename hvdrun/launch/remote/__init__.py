"""What runs on the hosts, next to or as the ranks; the launcher side stays in :mod:`hvdrun.launch`.

* ``guard.py``: leads each rank's process group and stops it when hvdrun's lifeline ends
  (run as a script, standard library only);
* ``mpirank.py``: the shim mpiexec starts as each rank (``python -m hvdrun.launch.remote.mpirank``);
* ``task.py``: a rank of :func:`hvdrun.run` (``python -m hvdrun.launch.remote.task``);
* ``hostfacts.py``: what a host says about itself before ranks start there
  (``python -m hvdrun.launch.remote.hostfacts``);
* ``lines.py``: byte streams cut into lines, which the shim and the launcher's output router share.
"""
