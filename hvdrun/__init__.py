"""hvdrun: launch data-parallel PyTorch jobs and run Horovod-style collectives.

``import hvdrun`` stays light: torch, paramiko and click are imported only by the
modules that need them.
"""

__version__ = "0.1.0"
