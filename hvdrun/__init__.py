"""hvdrun: launch data-parallel PyTorch jobs and run Horovod-style collectives.

``import hvdrun`` stays light: torch, paramiko and click are imported only by the
modules that need them.
"""

from hvdrun.version import __version__

__all__ = ["__version__", "run"]


def __getattr__(name: str) -> object:
    """``hvdrun.run`` (Horovod's ``horovod.run``), imported on first use."""
    if name == "run":
        from hvdrun.launch.function import run

        return run
    raise AttributeError(f"module 'hvdrun' has no attribute {name!r}")
