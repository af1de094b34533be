"""Only the global process set is supported: any other set is refused, never silently ignored."""

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


def test_global_set_works_and_subsets_are_refused(single_rank):
    assert hvd.allreduce(torch.ones(2), process_set=hvd.global_process_set).tolist() == [1.0, 1.0]
    assert hvd.global_process_set.ranks == [0] and hvd.global_process_set.included()
    subset = hvd.ProcessSet([0, 1])
    for call in (lambda: hvd.allreduce(torch.ones(2), process_set=subset),
                 lambda: hvd.allgather_async(torch.ones(2), None, subset),
                 lambda: hvd.broadcast_(torch.ones(2), 0, process_set=subset),
                 lambda: hvd.barrier(process_set=subset),
                 lambda: hvd.add_process_set([0])):
        with pytest.raises(ValueError, match="only the global process set"):
            call()
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="only the global process set"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_set=subset)
