"""``import horovod.torch as hvd`` under ``hvdrun --horovod-compat``: every name of :mod:`hvdrun.torch`.

Horovod's submodules (``mpi_ops``, ``functions``, ``compression``, ``optimizer``, ``sync_batch_norm``,
``elastic``) are attributes too, as in Horovod; ``hvd.elastic`` is this shim's ``elastic`` package, whose
names are :mod:`hvdrun.torch.elastic`'s.
"""

import importlib

from hvdrun.torch import *  # noqa: F403 - the whole public API, by design
from hvdrun.torch import __all__  # noqa: F401

from . import compression, functions, mpi_ops, optimizer, sync_batch_norm  # noqa: F401 - Horovod's attributes

elastic = importlib.import_module(".elastic", __name__)  # not hvdrun.torch.elastic, which the * import bound
