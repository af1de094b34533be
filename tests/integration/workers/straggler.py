"""STEPS allreduces of a small gradient, as a training loop makes them; the ranks in SLOW (comma-separated, or
'none') sleep 30 ms before each, as a slow node would."""

import sys
import time

import torch

import hvdrun.torch as hvd

hvd.init()
slow = {int(rank) for rank in sys.argv[1].split(",") if rank != "none"}
for _step in range(int(sys.argv[2])):
    if hvd.rank() in slow:
        time.sleep(0.03)
    hvd.allreduce(torch.ones(4), name="grad")
print(f"rank {hvd.rank()} done", flush=True)
hvd.shutdown()
