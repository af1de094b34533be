"""Gradients through allreduce, allgather, broadcast, alltoall and reducescatter follow Horovod's rules."""

import torch

import hvdrun.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
weights = [torch.arange(6, dtype=torch.float64) * (r + 1) for r in range(SIZE)]  # rank r's loss weights
mean_w = sum(weights) / SIZE


def check(name, got, want):
    assert torch.allclose(got, want, atol=1e-12), f"{name}: {got} != {want}"
    print(f"rank {RANK} {name} ok", flush=True)


for op, factor in ((hvd.Sum, SIZE), (hvd.Average, 1)):
    x = torch.ones(6, dtype=torch.float64, requires_grad=True)
    (hvd.allreduce(x, op=op, name=f"ar{op}") * weights[RANK]).sum().backward()
    check(f"allreduce op={op}", x.grad, mean_w * factor)  # allreduce of the gradients with the same op

x = torch.ones(RANK + 1, 2, dtype=torch.float64, requires_grad=True)
gathered = hvd.allgather(x, name="ag")
upstream = torch.arange(gathered.numel(), dtype=torch.float64).reshape(gathered.shape) * (RANK + 1)
(gathered * upstream).sum().backward()
start = sum(r + 1 for r in range(RANK))
mean_upstream = torch.arange(gathered.numel(), dtype=torch.float64).reshape(gathered.shape) * (SIZE + 1) / 2
check("allgather", x.grad, mean_upstream[start:start + RANK + 1])

x = torch.ones(6, dtype=torch.float64, requires_grad=True)
(hvd.broadcast(x, root_rank=0, name="bc") * weights[RANK]).sum().backward()
check("broadcast", x.grad, mean_w if RANK == 0 else torch.zeros(6, dtype=torch.float64))

x = torch.arange(2.0 * SIZE, dtype=torch.float64, requires_grad=True)
out, received = hvd.alltoall(x, splits=[2] * SIZE, name="a2a")
(out * (RANK + 1)).sum().backward()
check("alltoall", x.grad, torch.cat([torch.full((2,), float(r + 1), dtype=torch.float64) for r in range(SIZE)]))

x = torch.ones(2 * SIZE, dtype=torch.float64, requires_grad=True)
(hvd.reducescatter(x, op=hvd.Sum, name="rs") * (RANK + 1)).sum().backward()
check("reducescatter", x.grad, torch.cat([torch.full((2,), float(r + 1) * SIZE, dtype=torch.float64)
                                          for r in range(SIZE)]))
print(f"rank {RANK}: autograd ok", flush=True)
hvd.shutdown()
