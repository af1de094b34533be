"""``import horovod`` under ``hvdrun --horovod-compat``: hvdrun standing in for Horovod."""

from hvdrun import __version__ as _hvdrun_version
from hvdrun.launch.function import run

__version__ = f"0.28.1+hvdrun{_hvdrun_version}"
__all__ = ["run"]
