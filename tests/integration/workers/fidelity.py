"""Horovod behaviours hvdrun must match (run with 2 ranks); each check prints 'CHECK name ok' or fails."""

import os

import torch
import torch.distributed as dist

import hvdrun.torch as hvd


def check(name, condition, detail=""):
    assert condition, f"{name}: {detail}"
    print(f"CHECK {name} ok", flush=True)


# -- probes before init (Horovod answers False, not an error) --------------------------------------------------
check("enabled before init", hvd.mpi_enabled() is False and hvd.gloo_enabled() is False)
check("built before init", isinstance(hvd.mpi_built(), bool) and hvd.gloo_built() is True
      and hvd.nccl_built() == 0 and hvd.cuda_built() is (torch.version.cuda is not None))
check("torchelastic", dist.is_torchelastic_launched() and os.environ["ROLE_NAME"] == "default"
      and os.environ["GROUP_WORLD_SIZE"] == "1" and os.environ["ROLE_WORLD_SIZE"] == "2"
      and os.environ["ROLE_RANK"] == os.environ["RANK"] and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
      and os.environ["TORCHELASTIC_MAX_RESTARTS"] == "0" and os.environ["TORCHELASTIC_RUN_ID"])

hvd.init()
rank, size = hvd.rank(), hvd.size()
check("enabled after init", hvd.mpi_enabled() is False and hvd.gloo_enabled() is True)

# -- objects over process sets: disjoint sets, one-rank sets, None on non-root ranks ---------------------------
alone = [hvd.add_process_set([r]) for r in range(size)]
mine = alone[rank]
got = hvd.broadcast_object({"from": rank}, root_rank=rank, process_set=mine)
check("broadcast_object in a one-rank set", got == {"from": rank})
pair = hvd.global_process_set
got = hvd.broadcast_object([1, 2, 3] if rank == 0 else None, root_rank=0, process_set=pair)
check("broadcast_object with None on non-root", got == [1, 2, 3], got)
got = hvd.broadcast_object("text" if rank == 1 else 42.0, root_rank=1)
check("broadcast_object with other types on non-root", got == "text", got)
check("allgather_object in a set", hvd.allgather_object(rank * 10, process_set=mine) == [rank * 10])
check("allgather_object", hvd.allgather_object({"r": rank}) == [{"r": r} for r in range(size)])

# -- broadcast_optimizer_state leaves the gradients it created ---------------------------------------------------
model = torch.nn.Linear(3, 2)
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
check("grads left by broadcast_optimizer_state", all(p.grad is not None and not p.grad.any()
                                                      for p in model.parameters()))
for p in model.parameters():
    hvd.broadcast(p.grad, 0)
embedding = torch.nn.Embedding(10, 4, sparse=True)
sparse_adam = torch.optim.SparseAdam(embedding.parameters(), lr=0.1)
hvd.broadcast_optimizer_state(sparse_adam, root_rank=0)
check("SparseAdam state broadcast", embedding.weight.grad.is_sparse and
      "exp_avg" in sparse_adam.state[embedding.weight])

# -- sparse_as_dense: the averaged gradient is sparse again for the step ---------------------------------------
torch.manual_seed(0)
embedding = torch.nn.Embedding(10, 4, sparse=True)
hvd.broadcast_parameters(embedding.state_dict(), root_rank=0)
before = embedding.weight.detach().clone()
optimizer = hvd.DistributedOptimizer(torch.optim.SparseAdam(embedding.parameters(), lr=0.1),
                                     named_parameters=embedding.named_parameters(), sparse_as_dense=True)
optimizer.zero_grad()
embedding(torch.tensor([rank, 5])).sum().backward()
optimizer.step()
weights = hvd.allgather(embedding.weight.detach().unsqueeze(0))
check("sparse_as_dense with SparseAdam", torch.equal(weights[0], weights[-1]) and
      not torch.equal(embedding.weight.detach()[5], before[5]) and torch.equal(embedding.weight.detach()[9], before[9]))

# -- grouped_allgather and grouped_reducescatter are differentiable ----------------------------------------------
a = torch.full((rank + 1, 2), float(rank + 1), requires_grad=True)
b = torch.ones(3, requires_grad=True)
gathered = hvd.grouped_allgather([a, b], name="g.ag")
check("grouped_allgather values", gathered[0].shape[0] == sum(range(1, size + 1)) and gathered[1].shape[0] == 3 * size)
(gathered[0].sum() * 2 + gathered[1].sum()).backward()
check("grouped_allgather grads", torch.equal(a.grad, torch.full_like(a, 2.0)) and torch.equal(b.grad, torch.ones(3)))
x = torch.arange(4.0 * size, requires_grad=True)
y = torch.ones(2 * size, 3, requires_grad=True)
scattered = hvd.grouped_reducescatter([x, y], name="g.rs", op=hvd.Sum)
check("grouped_reducescatter values", torch.equal(scattered[0], torch.arange(4.0 * rank, 4.0 * rank + 4) * size)
      and torch.equal(scattered[1], torch.full((2, 3), float(size))))
(scattered[0].sum() + 3 * scattered[1].sum()).backward()
check("grouped_reducescatter grads", torch.equal(x.grad, torch.full_like(x, float(size)))
      and torch.equal(y.grad, torch.full_like(y, 3.0 * size)))

hvd.shutdown()
print(f"rank {rank}: fidelity ok", flush=True)
