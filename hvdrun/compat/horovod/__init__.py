"""``import horovod`` under ``hvdrun --horovod-compat``: hvdrun standing in for Horovod."""

from hvdrun.launch.function import run
from hvdrun.version import __version__ as _hvdrun_version

__version__ = f"0.28.1+hvdrun{_hvdrun_version}"
__all__ = ["run"]
