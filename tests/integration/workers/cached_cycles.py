"""The bytes a rank sends over TCP to coordinate a negotiation cycle once every op is cached (held): eight named
allreduces a step, as a DistributedOptimizer's gradients, each checked exactly. Each cycle's exchange of
announcements is measured on its own (the TCP bytes this rank sent during it); prints one line per rank:
``rank R: H hosts x L; cycles C, held-only N, median B bytes, most M bytes``."""

import gc
import statistics
import sys

import numpy as np

from hvdrun.runtime import context
from hvdrun.runtime.negotiation import Request
from hvdrun.runtime.transport.tcp import TcpTx

GRADIENTS, WARM_STEPS, STEPS = 8, 2, int(sys.argv[1]) if len(sys.argv) > 1 else 8
runtime = context.init()
engine, rank, size = runtime.engine, runtime.world.rank, runtime.world.size
channels = [channel for channel in gc.get_objects() if isinstance(channel, TcpTx)]
measured: list[tuple[int, bool]] = []  # per cycle: bytes sent, whether anything travelled in the general form
announcements = engine._cycle._announcements
exchange = announcements.exchange


def measured_exchange(*args, **kwargs):
    before = sum(channel.bytes_sent for channel in channels)
    agreed = exchange(*args, **kwargs)
    measured.append((sum(channel.bytes_sent for channel in channels) - before, agreed.general))
    return agreed


def step(number: int) -> None:
    handles = [engine.submit(Request(f"grad.{g}", "allreduce", "int64", (4,)), np.full(4, rank + g + number, np.int64))
               for g in range(GRADIENTS)]
    for g, handle in enumerate(handles):
        assert np.all(handle.wait() == sum(r + g + number for r in range(size))), (g, number)


for number in range(WARM_STEPS):  # the first step announces every op whole; then they are numbered (cached)
    step(number)
announcements.exchange = measured_exchange
for number in range(WARM_STEPS, WARM_STEPS + STEPS):
    step(number)
announcements.exchange = exchange
held_only = [sent for sent, general in measured if not general]
assert channels and held_only, (len(channels), measured)
print(f"rank {rank}: {runtime.world.cross_size} hosts x {runtime.world.local_size}; cycles {len(measured)}, "
      f"held-only {len(held_only)}, median {statistics.median(held_only):g} bytes, most {max(held_only)} bytes",
      flush=True)
context.shutdown()
