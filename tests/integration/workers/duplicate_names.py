"""A name is taken on a rank from submission until its op finishes there (Horovod's rule).

Rank 0 submits each name twice while the first op cannot finish yet (rank 1 submits it only after a barrier
that follows rank 0's second try): the second submit raises every time. Once an op has finished, its name is
free again whether or not its handle was synchronized: a handle left behind (a metric nobody waits for) does
not block the name, in the next step or under another kind of collective.
"""

import time

import torch

import hvdrun.torch as hvd

hvd.init()
rank = hvd.rank()
caught = 0
for i in range(40):
    if rank == 0:
        handle = hvd.allreduce_async(torch.ones(4), name=f"dup{i}")
        try:
            hvd.allreduce_async(torch.ones(4), name=f"dup{i}")
        except ValueError:
            caught += 1
        hvd.barrier()
    else:
        hvd.barrier()
        handle = hvd.allreduce_async(torch.ones(4), name=f"dup{i}")
    hvd.synchronize(handle)
print(f"rank {rank} caught {caught}", flush=True)


def finished(handle: int) -> None:
    deadline = time.monotonic() + 30
    while not hvd.poll(handle):
        assert time.monotonic() < deadline, "the op never finished"
        time.sleep(0.001)


for step in range(3):  # the same name every step, the handle never synchronized
    left_behind = hvd.allreduce_async(torch.full((2,), float(step)), op=hvd.Sum, name="metric")
    finished(left_behind)
gathered = hvd.allgather(torch.tensor([rank]), name="metric")  # another kind of collective, the same name
assert gathered.tolist() == list(range(hvd.size())), gathered
assert hvd.broadcast(torch.tensor([rank + 5]), root_rank=1, name="metric").tolist() == [6]
print(f"rank {rank} reused names of finished ops", flush=True)
assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after").tolist() == [hvd.size()] * 2
hvd.shutdown()
