"""DistributedOptimizer and the broadcast helpers against single-process training."""

import copy
import sys
from pathlib import Path

import torch

import hvdrun.torch as hvd

torch.manual_seed(0)
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
SAMPLES, STEPS = 72, 5  # divisible by ranks (1..4) x passes (1..3): equal micro-batches everywhere
inputs = torch.randn(SAMPLES, 5, dtype=torch.float64)
targets = torch.randn(SAMPLES, 1, dtype=torch.float64)
shard = slice(RANK * SAMPLES // SIZE, (RANK + 1) * SAMPLES // SIZE)
base_model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def make_optimizer(kind, params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9) if kind == "sgd" else torch.optim.Adam(params, lr=0.05)


def reference(kind):
    model = copy.deepcopy(base_model)
    optimizer = make_optimizer(kind, model.parameters())
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return model


def distributed(kind, passes=1, **options):
    model = copy.deepcopy(base_model)
    optimizer = hvd.DistributedOptimizer(make_optimizer(kind, model.parameters()),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=passes, **options)
    assert isinstance(optimizer, torch.optim.SGD if kind == "sgd" else torch.optim.Adam)
    x, y = inputs[shard], targets[shard]
    for _ in range(STEPS):
        optimizer.zero_grad()
        for part_x, part_y in zip(x.chunk(passes), y.chunk(passes), strict=True):
            (torch.nn.functional.mse_loss(model(part_x), part_y) / passes).backward()
        optimizer.step()
    return model


def max_difference(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


for kind in ("sgd", "adam"):
    want = reference(kind)
    for label, passes, options, tolerance in [
        ("plain", 1, {}, 1e-9), ("accumulate x2", 2, {}, 1e-9), ("accumulate x3", 3, {}, 1e-9),
        ("groups=2", 1, {"groups": 2}, 1e-9), ("predivide 2", 1, {"gradient_predivide_factor": 2.0}, 1e-9),
        ("fp16 compression", 1, {"compression": hvd.Compression.fp16}, 5e-2),
    ]:
        difference = max_difference(distributed(kind, passes, **options), want)
        assert difference < tolerance, f"{kind} {label}: parameters differ by {difference}"
        print(f"rank {RANK} {kind} {label}: max |diff| {difference:.2e}", flush=True)

# more backward passes than backward_passes_per_step before step(): Horovod's AssertionError, on every rank
for passes in (1, 2) if SIZE > 1 else ():  # as in Horovod, a job of one rank installs no hooks
    model = copy.deepcopy(base_model)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), backward_passes_per_step=passes)
    for _ in range(passes):
        torch.nn.functional.mse_loss(model(inputs[shard]), targets[shard]).backward()
    try:
        torch.nn.functional.mse_loss(model(inputs[shard]), targets[shard]).backward()
        raise SystemExit(f"a backward pass beyond backward_passes_per_step={passes} was accepted")
    except AssertionError as e:
        assert "more than backward_passes_per_step" in str(e), e
    optimizer.step()  # the passes that were counted are reduced; the count starts again
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs[shard]), targets[shard]).backward()
    optimizer.step()

# broadcast of parameters and optimizer state (including state not created yet and non-tensor entries)
torch.manual_seed(100 + RANK)
model = torch.nn.Linear(4, 3).double()
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
everyone = hvd.allgather_object({k: v.tolist() for k, v in model.state_dict().items()})
assert all(state == everyone[0] for state in everyone), "parameters differ after broadcast_parameters"
fresh = torch.optim.Adam(model.parameters(), lr=0.01 * (RANK + 1), betas=(0.9, 0.99 - 0.01 * RANK))
hvd.broadcast_optimizer_state(fresh, root_rank=0)
assert fresh.param_groups[0]["lr"] == 0.01 and fresh.param_groups[0]["betas"] == (0.9, 0.99)
model(torch.randn(2, 4, dtype=torch.float64) * (RANK + 1)).sum().backward()
fresh.step()  # rank-dependent gradients make the states differ
hvd.broadcast_optimizer_state(fresh, root_rank=1 % SIZE)
states = hvd.allgather_object({pid: {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in s.items()}
                               for pid, s in fresh.state_dict()["state"].items()})
assert all(state == states[0] for state in states), "optimizer state differs after broadcast_optimizer_state"
assert hvd.broadcast_object({"epoch": RANK}, root_rank=SIZE - 1) == {"epoch": SIZE - 1}
assert hvd.allgather_object(RANK * 10) == [r * 10 for r in range(SIZE)]

path = Path(sys.argv[1]) / "checkpoint.pt"
written = hvd.save_checkpoint({"model": model.state_dict(), "rank": RANK}, path)
assert (written == path) if RANK == 0 else written is None
hvd.barrier()
assert torch.load(path)["rank"] == 0 and not list(path.parent.glob(".checkpoint.pt.*"))
print(f"rank {RANK}: optimizer ok", flush=True)
hvd.shutdown()
