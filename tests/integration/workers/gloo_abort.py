"""Ranks 0 and 1 wait in an allreduce that rank 2, alive and holding its gloo connections, never joins; rank 2 then
reports a failure, as a rank that caught an error tells the job before it cleans up. Without the abort reaching
into gloo, ranks 0 and 1 would go on negotiating with rank 2's engine, or wait inside a gloo op for its whole
timeout (HVDRUN_START_TIMEOUT, set far beyond the test's patience): they must raise, naming rank 2's reason."""

import sys
import time

import torch

import hvdrun.torch as hvd
from hvdrun.runtime import context

hvd.init()
rank = hvd.rank()
hvd.allreduce(torch.ones(10), name="warm-up")  # every connection made
if rank == 2:
    time.sleep(1.0)  # ranks 0 and 1 are in the allreduce by now
    context.current().rendezvous.report_failure("rank 2 gave up on purpose")
    print("rank 2 reported its failure", flush=True)
    time.sleep(300)  # alive: the test ends it
    sys.exit(0)
try:
    hvd.allreduce(torch.ones(1000), name="never")
    print(f"rank {rank} completed the allreduce rank 2 never joined", flush=True)
except hvd.HorovodInternalError as e:
    print(f"rank {rank} raised: {e}", flush=True)
