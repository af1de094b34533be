"""Rank 1 never submits 'late': a warning names it, then every rank raises."""

import time

import torch

import hvdrun.torch as hvd

hvd.init()
rank = hvd.rank()
if rank == 1:
    time.sleep(6)
    try:
        hvd.allreduce(torch.ones(1), name="after")
    except hvd.HorovodInternalError as e:
        print(f"rank {rank} raised: {e}", flush=True)
else:
    try:
        hvd.allreduce(torch.ones(1), name="late")
    except hvd.HorovodInternalError as e:
        print(f"rank {rank} raised: {e}", flush=True)
