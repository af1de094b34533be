"""Build probes tell the truth about this installation."""

import importlib.util

import torch

import hvdrun.torch as hvd


def test_probes_match_the_installation():
    assert hvd.mpi_built() == (importlib.util.find_spec("mpi4py") is not None)
    assert hvd.gloo_built() == torch.distributed.is_gloo_available()
    assert hvd.cuda_built() == (torch.version.cuda is not None)
    assert (hvd.nccl_built() > 0) == (torch.cuda.is_available() and torch.distributed.is_nccl_available())
    assert hvd.ddl_built() is False and hvd.ccl_built() is False
