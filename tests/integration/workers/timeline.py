"""Collectives under a timeline; with HOROVOD_TIMELINE=DYNAMIC also start/stop_timeline."""

import os
import sys

import torch

import hvdrun.torch as hvd

hvd.init()
if os.environ.get("HOROVOD_TIMELINE") == "DYNAMIC":
    hvd.start_timeline(sys.argv[1], mark_cycles=True)
hvd.allreduce(torch.ones(10), name="small")
hvd.allreduce(torch.ones(100_000), name="large")
hvd.allgather(torch.ones(2, 2), name="gathered")
if os.environ.get("HOROVOD_TIMELINE") == "DYNAMIC":
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(3), name="after_stop")
    if len(sys.argv) > 2:  # a timeline that cannot be written: one line at its stop, the job goes on
        hvd.start_timeline(sys.argv[2])
        hvd.allreduce(torch.ones(3), name="unwritten")
        hvd.stop_timeline()
else:
    try:
        hvd.start_timeline(sys.argv[1])
    except ValueError as e:
        print(f"refused: {e}")
hvd.shutdown()
