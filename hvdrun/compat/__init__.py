"""Holds the ``horovod`` package that ``hvdrun --horovod-compat`` puts first on the workers' import path.

This directory itself is never imported as ``hvdrun.compat.horovod``; the guard that starts each
rank prepends it to ``PYTHONPATH`` (see :func:`compat_path`), so that ``import horovod.torch as hvd``
in an unchanged Horovod script resolves to :mod:`hvdrun.torch`.
"""

from pathlib import Path


def compat_path() -> str:
    """The directory to prepend to ``PYTHONPATH``: it contains the ``horovod`` shim package."""
    return str(Path(__file__).resolve().parent)
