"""Mismatched collectives raise HorovodInternalError on every rank, naming the op and the ranks."""

import torch

import hvdrun.torch as hvd

hvd.init()
rank = hvd.rank()
cases = {
    "shape": lambda: hvd.allreduce(torch.ones(3 if rank == 0 else 4), name="shape"),
    "dtype": lambda: hvd.allreduce(torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64), name="dtype"),
    "op": lambda: hvd.allreduce(torch.ones(3), name="op", op=hvd.Sum if rank == 0 else hvd.Max),
    "root": lambda: hvd.broadcast(torch.ones(3), root_rank=rank, name="root"),
    "kind": lambda: (hvd.allreduce(torch.ones(2), name="kind") if rank == 0
                     else hvd.allgather(torch.ones(2), name="kind")),
}
for case, call in cases.items():
    try:
        call()
    except hvd.HorovodInternalError as e:
        print(f"rank {rank} {case}: {e}")
    else:
        raise AssertionError(f"{case} mismatch did not raise")
assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2  # still usable afterwards
hvd.shutdown()
