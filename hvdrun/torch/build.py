"""Build and runtime probes (Horovod's ``nccl_built()``, ``mpi_enabled()``, ...), answered truthfully."""

from __future__ import annotations

import importlib.util

import torch

from hvdrun.runtime import context


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def mpi_built() -> bool:
    """mpi4py is importable, so the ``mpi`` backend can be used under mpiexec."""
    return _has_module("mpi4py")


def gloo_built() -> bool:
    """torch.distributed has gloo (the ``gloo`` backend)."""
    return bool(torch.distributed.is_available() and torch.distributed.is_gloo_available())


def nccl_built() -> int:
    """The NCCL version code torch was built with (e.g. 21903), 0 without NCCL or CUDA."""
    if not (torch.cuda.is_available() and torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return major * 10000 + minor * 100 + patch if major >= 2 and minor >= 9 else major * 1000 + minor * 100 + patch


def cuda_built() -> bool:
    """torch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """torch was built with ROCm."""
    return getattr(torch.version, "hip", None) is not None


def ddl_built() -> bool:
    """IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """oneCCL is not supported."""
    return False


def mpi_enabled() -> bool:
    """The running job uses the ``mpi`` backend (False before ``init()``, as in Horovod)."""
    return context.is_initialized() and context.current().backend.name == "mpi"


def gloo_enabled() -> bool:
    """The running job's controller is not MPI (False before ``init()``).

    Horovod answers True when its gloo controller runs (``horovodrun --gloo``, the default without
    MPI); in hvdrun that place is taken by the ring (or torch.distributed gloo): TCP, no MPI.
    """
    return context.is_initialized() and context.current().backend.name != "mpi"


def mpi_threads_supported() -> bool:
    """MPI provides MPI_THREAD_MULTIPLE (ValueError when the job does not use MPI)."""
    if not mpi_enabled():
        raise ValueError("MPI is not enabled in this job")
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)
