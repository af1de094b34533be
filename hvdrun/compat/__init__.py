"""Holds the ``horovod`` package that ``hvdrun --horovod-compat`` puts first on the workers' import path.

This directory is never imported as ``hvdrun.compat.horovod``: the guard that starts each rank
(:func:`hvdrun.launch.remote.guard.command_env`) prepends it to ``PYTHONPATH``, so that ``import
horovod.torch as hvd`` in an unchanged Horovod script resolves to :mod:`hvdrun.torch`.

Its modules mirror Horovod's layout (``horovod.torch.mpi_ops``, ``horovod.common.exceptions``, ...), names
repeated in two places (``elastic``) included, because scripts import those paths; each module only
re-exports hvdrun's objects.
"""
