"""Ranks on several hosts, each host's ranks joined through its leader: one exact allreduce, then by argv[1]:
``ok`` (shut down), ``die R`` (rank R is SIGKILLed and every other rank must raise, naming why), ``stacks`` (rank 0
gathers every rank's report through the leaders). numpy only: no torch import, so the ranks start fast."""

import os
import signal
import sys
import time

import numpy as np

from hvdrun.errors import CollectiveError
from hvdrun.runtime import context
from hvdrun.runtime.negotiation import Request

runtime = context.init()
size, rank = runtime.world.size, runtime.world.rank


def allreduce(name: str, elements: int = 1000) -> np.ndarray:
    handle = runtime.engine.submit(Request(name, "allreduce", "int64", (elements,)), np.full(elements, rank + 1))
    return handle.wait()


assert np.all(allreduce("first") == size * (size + 1) // 2)
mode = sys.argv[1]
if mode == "die":
    victim = int(sys.argv[2])
    start = time.monotonic()
    try:
        for step in range(100_000):
            allreduce(f"step.{step}", 10_000)
            if rank == victim:  # its step.0 needed every rank's: all are past "first", in this loop
                os.kill(os.getpid(), signal.SIGKILL)
    except CollectiveError as e:
        print(f"rank {rank} raised after {time.monotonic() - start:.1f} s: {e}", flush=True)
        os._exit(0)
    print(f"rank {rank} never raised", flush=True)
    sys.exit(1)
if mode == "stacks" and rank == 0:
    reports, absent = runtime.rendezvous.gather_reports()
    print(f"reports from ranks {[r['rank'] for r in reports]}, absent {sorted(absent)}", flush=True)
    server = runtime.rendezvous._server
    print(f"rank 0 admitted {len(server.conns)} connections for {len(server.members)} ranks", flush=True)
allreduce("last")
print(f"rank {rank}: ok", flush=True)
context.shutdown()
