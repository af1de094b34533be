"""Calls before init raise; init -> op -> shutdown a hundred times in one process."""

import torch

import hvdrun.torch as hvd

for call in (hvd.rank, hvd.size, lambda: hvd.allreduce(torch.ones(1))):
    try:
        call()
    except ValueError as e:
        assert "not been initialized" in str(e), e
    else:
        raise AssertionError("a call before init() must raise ValueError")
for i in range(100):
    hvd.init()
    assert hvd.is_initialized()
    value = hvd.allreduce(torch.tensor([float(i)]), op=hvd.Sum).item()
    assert value == i * hvd.size(), (i, value)
    hvd.shutdown()
    assert not hvd.is_initialized()
print(f"lifecycle ok: 100 cycles of {hvd.__name__}")
