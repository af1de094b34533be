"""Async ops submitted in different orders on different ranks, named and auto-named."""

import torch

import hvdrun.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
names = [f"grad.{i}" for i in range(20)]
order = names if rank % 2 == 0 else list(reversed(names))  # odd ranks submit in reverse
handles = {name: hvd.allreduce_async(torch.full((10 + i,), float(rank)), name=name, op=hvd.Sum)
           for i, name in sorted(enumerate(names), key=lambda p: order.index(p[1]))}
for i, name in enumerate(names):
    result = hvd.synchronize(handles[name])
    assert result.shape == (10 + i,) and torch.all(result == sum(range(size))), (name, result)
assert all(hvd.poll(h) is not None for h in [])  # poll of finished handles is exercised below
handle = hvd.allreduce_async(torch.ones(3), op=hvd.Sum)  # auto-named: same call order on every rank
assert hvd.synchronize(handle).tolist() == [float(size)] * 3
handle = hvd.broadcast_async(torch.tensor([rank]), root_rank=0, name="last")
while not hvd.poll(handle):
    pass
assert hvd.synchronize(handle).item() == 0
try:
    hvd.poll(handle)
except ValueError:
    pass
else:
    raise AssertionError("poll of a released handle must raise ValueError")
print(f"rank {rank}: order ok")
hvd.shutdown()
