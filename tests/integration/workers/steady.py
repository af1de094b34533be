"""A training loop that runs until the test releases it: a small model under DistributedOptimizer and, each step,
an allreduce that is the vote to stop. Arguments: SLOW (ranks that sleep 30 ms before each step, comma-separated,
or 'none'), the release file, FAIL (``RANK:STEP``: that rank exits with code 3 at that step, or 'none'). Each rank
prints 'ready' after 40 steps."""

import os
import sys
import time

import torch

import hvdrun.torch as hvd

hvd.init()
slow = {int(rank) for rank in sys.argv[1].split(",") if rank != "none"}
release = sys.argv[2]
fail_rank, fail_step = (int(part) for part in sys.argv[3].split(":")) if sys.argv[3] != "none" else (-1, -1)
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
step = 0
while True:
    if hvd.rank() in slow:
        time.sleep(0.03)
    if hvd.rank() == fail_rank and step == fail_step:
        print("failing on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    optimizer.zero_grad()
    model(torch.ones(8, 16)).sum().backward()
    optimizer.step()
    step += 1
    if step == 40:
        print("ready", flush=True)
    # the ranks stop together: at the first step any of them saw the release file
    if hvd.allreduce(torch.tensor([float(os.path.exists(release))]), op=hvd.Max, name="stop").item():
        break
    time.sleep(0.005)
print(f"rank {hvd.rank()} done after {step} steps", flush=True)
