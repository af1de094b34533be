"""A job whose first device op is a process set's (a rank outside it): the set's group is made by its members
alone, the rank outside holds no placeholder of a dtype numpy lacks (bfloat16), and the global op after works."""

import torch

import hvdrun.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
first_two = hvd.add_process_set([0, 1])
if rank in (0, 1):
    t = torch.full((5,), float(rank + 1), dtype=torch.bfloat16)
    hvd.allreduce_(t, op=hvd.Sum, process_set=first_two, name="set.first")
    print(f"rank {rank}: set bf16 {t.tolist()}", flush=True)
out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="global.after")
print(f"rank {rank}: global {out.tolist()}", flush=True)
hvd.shutdown()
