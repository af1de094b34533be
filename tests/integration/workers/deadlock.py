"""Rank 0 waits in a barrier while the others wait in an allreduce rank 0 never submits: every rank raises,
naming what each waits for; then a rank that is merely slow is waited for without an error."""

import time

import torch

import hvdrun.torch as hvd

hvd.init()
rank = hvd.rank()
try:
    if rank == 0:
        hvd.barrier()
    else:
        hvd.allreduce(torch.ones(3), name="x")
except hvd.HorovodInternalError as e:
    print(f"rank {rank} raised: {e}", flush=True)
else:
    raise AssertionError("the deadlock was not reported")
assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after").tolist() == [hvd.size()] * 2
if rank == 1:
    time.sleep(2.5)  # computing, not waiting: the others wait for it without a deadlock error
assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name="slow").tolist() == [hvd.size()] * 2
print(f"rank {rank}: deadlock ok", flush=True)
hvd.shutdown()
