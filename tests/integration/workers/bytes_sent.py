"""Each rank sends exactly 2 (N - 1) / N * S bytes for an allreduce of S bytes."""

import sys

import numpy as np

from hvdrun.runtime import context
from hvdrun.runtime.negotiation import Request

runtime = context.init()
size, rank = runtime.world.size, runtime.world.rank
elements = int(sys.argv[1]) * size * 2  # S divisible by N and every chunk a multiple of 8 bytes
array = np.full(elements, rank + 1, np.float32)
with runtime.engine.paused() as backend:
    tx = backend.ring.tx
    before = tx.bytes_sent
    backend.allreduce(array, np.add)
    sent = tx.bytes_sent - before
expected = 2 * (size - 1) * array.nbytes // size
assert np.all(array == size * (size + 1) / 2), array[:4]
assert sent == expected, f"rank {rank} sent {sent} bytes, expected {expected}"
print(f"rank {rank}: sent {sent} bytes for S={array.nbytes} N={size} over {type(tx).__name__}")
runtime.engine.run(Request("done", "barrier"))
context.shutdown()
