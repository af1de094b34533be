"""A rank (argv[1]) dies in the middle of the job; every other rank must raise, naming it, within seconds. argv[2]:
the elements of the named ops that follow (default 100,000: the ring's path; a few thousand go eager, whole in the
compiled module where it is built: the survivors then wait inside it, on the host's board or a partner's socket);
argv[3]: the op of that loop in which the victim dies (default: before the loop; 50: once the op is cached and
every rank runs it whole); argv[4] "grouped": the loop's op is a grouped allreduce of two tensors (on the device
path: one fused collective)."""

import os
import signal
import sys
import time

import torch

import hvdrun.torch as hvd
from hvdrun.runtime import context

hvd.init()
rank = hvd.rank()
elements = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
dies_at = int(sys.argv[3]) if len(sys.argv) > 3 else -1
grouped = len(sys.argv) > 4 and sys.argv[4] == "grouped"
start = time.monotonic()
try:
    # the victim dies once this op returned to it: a peer still finishing it (waiting on its host's leader for the
    # result) may see the death already here
    hvd.allreduce(torch.ones(1000))
    victim = rank == int(sys.argv[1])
    if victim and dies_at < 0:
        os.kill(os.getpid(), signal.SIGKILL)
    for i in range(10_000):
        if victim and i == dies_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if grouped:
            hvd.grouped_allreduce([torch.ones(elements), torch.ones(7, dtype=torch.float32)], name="step")
        else:
            hvd.allreduce(torch.ones(elements), name="step")
except hvd.HorovodInternalError as e:
    steps = context.current().engine.compiled
    wholes = steps.wholes if steps is not None else 0
    print(f"rank {rank} raised after {time.monotonic() - start:.1f} s ({wholes} whole ops): {e}", flush=True)
    sys.exit(0)
print(f"rank {rank} never raised", flush=True)
sys.exit(1)
