"""Rank 1 dies in the middle of the job; every other rank must raise, naming it, within seconds."""

import os
import signal
import sys
import time

import torch

import hvdrun.torch as hvd

hvd.init()
rank = hvd.rank()
start = time.monotonic()
try:
    # the victim dies once this op returned to it: a peer still finishing it (waiting on its host's leader for the
    # result) may see the death already here
    hvd.allreduce(torch.ones(1000))
    if rank == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    for i in range(10_000):
        hvd.allreduce(torch.ones(100_000), name=f"step.{i}")
except hvd.HorovodInternalError as e:
    print(f"rank {rank} raised after {time.monotonic() - start:.1f} s: {e}", flush=True)
    sys.exit(0)
print(f"rank {rank} never raised", flush=True)
sys.exit(1)
