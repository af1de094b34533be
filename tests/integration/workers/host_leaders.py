"""Ranks on several hosts, each host's ranks joined through its leader: one exact allreduce, then by argv[1]:
``ok`` (shut down), ``die R`` (rank R is SIGKILLed and every other rank must raise, naming why), ``stacks`` (rank 0
gathers every rank's report through the leaders), ``report FILE`` (the rank the test writes in FILE reports a
failure; the others wait in a collective until they hear it). numpy only: no torch import, so the ranks start fast."""

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
if mode == "report":  # the rank named in the file argv[2] (once it exists) reports a failure; the others wait in a
    flag = sys.argv[2]  # collective until the abort reaches them (rank 0 is stopped meanwhile: it relays nothing)
    print(f"rank {rank} in the loop", flush=True)
    while not os.path.exists(flag) or not open(flag).read().strip():
        time.sleep(0.05)
    if rank == int(open(flag).read()):
        runtime.rendezvous.report_failure(f"rank {rank} gives up")
        time.sleep(60)
    start = time.monotonic()
    try:
        allreduce("never")
    except CollectiveError as e:
        print(f"rank {rank} raised after {time.monotonic() - start:.1f} s: {e}", flush=True)
        os._exit(0)
if mode == "stacks" and rank == 0:
    reports, absent = runtime.rendezvous.gather_reports()
    print(f"reports from ranks {[r['rank'] for r in reports]}, absent {sorted(absent)}", flush=True)
    server = runtime.rendezvous._server
    print(f"rank 0 admitted {len(server.conns)} connections for {len(server.members)} ranks", flush=True)
allreduce("last")
print(f"rank {rank}: ok", flush=True)
context.shutdown()
