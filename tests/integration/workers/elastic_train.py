"""An elastic training whose result does not depend on the world size: the test compares it with a
single-process reference.

Every step uses one global batch of GLOBAL rows (divisible by 1..6 ranks), split evenly; the
averaged gradient is the global batch's. With float64 the trajectory equals single-process
full-batch descent, however many ranks take part and whatever step the job resumed from.

Environment (set by the tests):
    ELASTIC_STEPS: steps in all; ELASTIC_COMMIT_EVERY: steps between commits.
    ELASTIC_KILL_WORKER / ELASTIC_KILL_STEP: that worker SIGKILLs itself in the middle of that step
        (after its backward, before the optimizer's allreduce); ELASTIC_KILLS="W:S,W:S" for several.
    ELASTIC_STEP_SLEEP: seconds each step sleeps (so a test can change discovery mid-training).
    ELASTIC_MARK_DIR: rank 0 touches STEP files there, for tests that wait for progress.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch

import hvdrun.torch as hvd

GLOBAL = 60
FEATURES = 4
LR = 0.05


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank and in the reference)."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL, FEATURES, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64) + 0.25
    return x, y.unsqueeze(1)


def reference(steps: int) -> list[float]:
    """Single-process full-batch descent: the weights every elastic run must end with."""
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [float(v) for v in torch.cat([p.detach().flatten() for p in model.parameters()])]


def main() -> None:
    steps = int(os.environ.get("ELASTIC_STEPS", "40"))
    commit_every = int(os.environ.get("ELASTIC_COMMIT_EVERY", "4"))
    listed = [item.split(":") for item in os.environ.get("ELASTIC_KILLS", "").split(",") if item]
    kills = {int(worker): int(step) for worker, step in listed}
    if os.environ.get("ELASTIC_KILL_WORKER"):
        kills[int(os.environ["ELASTIC_KILL_WORKER"])] = int(os.environ["ELASTIC_KILL_STEP"])
    sleep_s = float(os.environ.get("ELASTIC_STEP_SLEEP", "0"))
    marks = Path(os.environ["ELASTIC_MARK_DIR"]) if os.environ.get("ELASTIC_MARK_DIR") else None
    me = os.environ.get("HVDRUN_WORKER_ID")

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1).double()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0, resets=0)

    def on_reset() -> None:
        state.resets += 1
        print(f"worker {me}: reset -> rank {hvd.rank()} of {hvd.size()}", flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.step < steps:
            x, y = batch(state.step)
            share = GLOBAL // hvd.size()
            rows = slice(hvd.rank() * share, (hvd.rank() + 1) * share)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            if me is not None and kills.get(int(me)) == state.step:
                print(f"worker {me}: killing myself at step {state.step} t={time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.step()
            state.step += 1
            if hvd.rank() == 0:
                print(f"step {state.step} size {hvd.size()} t={time.time():.3f}", flush=True)
                if marks is not None:
                    (marks / f"step{state.step}").touch()
            if state.step % commit_every == 0:
                state.commit()
            time.sleep(sleep_s)

    train(state)
    weights = [float(v) for v in torch.cat([p.detach().flatten() for p in model.parameters()])]
    expected = reference(steps)
    difference = max(abs(a - b) for a, b in zip(weights, expected, strict=True))
    print(f"FINAL rank {hvd.rank()} size {hvd.size()} worker {me} resets {state.resets} "
          f"diff {difference:.3e} weights {json.dumps(weights)}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
