"""``import horovod.torch as hvd`` under ``hvdrun --horovod-compat``: every name of :mod:`hvdrun.torch`."""

from hvdrun.torch import *  # noqa: F403 - the whole public API, by design
from hvdrun.torch import __all__  # noqa: F401
