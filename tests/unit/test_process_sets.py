"""Process sets in a one-rank job: registration, refusal of unregistered, invalid and duplicate sets."""

import pytest
import torch

import hvdrun.torch as hvd


@pytest.fixture
def single_rank(monkeypatch):
    for name in ("HVDRUN_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PALS_RANKID", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    hvd.init()
    yield
    hvd.shutdown()


def test_registration_and_clear_refusals(single_rank):
    assert hvd.allreduce(torch.ones(2), process_set=hvd.global_process_set).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="is not registered: call hvd.add_process_set"):
        hvd.allreduce(torch.ones(2), process_set=hvd.ProcessSet([0]))
    with pytest.raises(ValueError, match="distinct ranks in 0..0"):
        hvd.add_process_set([0, 1])
    with pytest.raises(ValueError, match="ranks \\[0\\] is already registered"):  # [0] is the global set here
        hvd.add_process_set([0])
    assert hvd.remove_process_set(hvd.global_process_set) is False
    with pytest.raises(ValueError, match="must be an hvd.ProcessSet"):
        hvd.allreduce(torch.ones(1), process_set=[0])
