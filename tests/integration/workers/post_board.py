"""The host's post board under the merged negotiation (3 hosts x 3 ranks): a cycle whose announcements are too
long for a post takes the host's ring on every rank of the host; steady blocking allreduces go through the board;
a local rank that comes late is waited for (its peers sleep and are woken by its post); results exact throughout.
Prints one line per rank."""

import time

import torch

import hvdrun.torch as hvd
from hvdrun.runtime import context

hvd.init()
rank, size, local = hvd.rank(), hvd.size(), hvd.local_rank()
board = context.current().engine.backend.hierarchy.board
assert board is not None, "no post board on a host of several ranks"

# 1. a flood: one grouped op of 800 tensors with a long name, announced in one cycle (800 uncached requests, each
# with the name: past a post's 256 KiB on every rank)
tensors = [torch.full((3,), float(rank + i), dtype=torch.float64) for i in range(800)]
hvd.grouped_allreduce_(tensors, name="flood." + "x" * 400, op=hvd.Sum)
for i, result in enumerate(tensors):
    assert torch.equal(result, torch.full((3,), float(sum(range(size)) + size * i), dtype=torch.float64)), (i, result)
flooded = board.too_long
assert flooded >= 1, "no cycle was too long for the board"

# 2. steady state: blocking allreduces, each one round of the board
before = board.round
for step in range(60):
    t = torch.full((1024,), float(rank * step), dtype=torch.float64)
    hvd.allreduce_(t, name="steady", op=hvd.Sum)
    assert torch.all(t == float(step * sum(range(size)))), (step, t[:3])
assert board.round - before >= 60, (before, board.round)

# 3. a late local rank: its peers post, wait, sleep on their bells and are woken by its post; meanwhile the late
# rank's engine, idle, sees their posts and joins their cycles (announcing nothing), as it would on ring bytes
engine = context.current().engine
for step in range(3):
    if local == step:  # late until its engine has joined a peers' cycle (at most 10 s: 9 ranks share 2 cores in CI)
        before, deadline = engine.cycles, time.monotonic() + 10
        time.sleep(0.3)
        while engine.cycles == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.cycles > before, "an idle rank's engine did not join its local peers' cycle"
    t = torch.tensor([float(rank)])
    hvd.allreduce_(t, name=f"late.{step}", op=hvd.Sum)
    assert t.item() == sum(range(size)), t
assert board.too_long == flooded, "a steady cycle took the ring"
print(f"rank {rank}: post board ok, {board.round} rounds, {flooded} too long", flush=True)
hvd.shutdown()
