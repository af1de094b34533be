"""Rank 0 submits each name twice while its first handle is still open: the second submit raises every
time, whether or not the peer has already submitted (and the op executed)."""

import time

import torch

import hvdrun.torch as hvd

hvd.init()
rank = hvd.rank()
caught = 0
for i in range(40):
    if rank == 1 and i % 2:
        time.sleep(0.002)  # odd rounds: rank 0 submits first; even rounds: the peer's op is already in
    handle = hvd.allreduce_async(torch.ones(4), name=f"dup{i}")
    if rank == 0:
        time.sleep(0.01 if i % 2 == 0 else 0)
        try:
            hvd.allreduce_async(torch.ones(4), name=f"dup{i}")
        except ValueError:
            caught += 1
    hvd.synchronize(handle)
print(f"rank {rank} caught {caught}", flush=True)
assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after").tolist() == [hvd.size()] * 2
hvd.shutdown()
