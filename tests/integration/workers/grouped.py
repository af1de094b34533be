"""Grouped allgather and reducescatter, and sparse allreduce."""

import torch

import hvdrun.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
gathered = hvd.grouped_allgather([torch.full((RANK + 1,), RANK), torch.full((1, 2), RANK)])
assert gathered[0].tolist() == [r for r in range(SIZE) for _ in range(r + 1)]
assert gathered[1].tolist() == [[r, r] for r in range(SIZE)]
scattered = hvd.grouped_reducescatter([torch.ones(SIZE * 2), torch.ones(SIZE, 3)], op=hvd.Sum)
assert scattered[0].tolist() == [float(SIZE)] * 2 and scattered[1].tolist() == [[float(SIZE)] * 3]
sparse = torch.sparse_coo_tensor([[RANK]], [float(RANK + 1)], (SIZE,))
total = hvd.sparse_allreduce_async(sparse, name="sparse", op=hvd.Sum)()
assert total.to_dense().tolist() == [float(r + 1) for r in range(SIZE)]
print(f"rank {RANK}: grouped ok", flush=True)
hvd.shutdown()
