"""Data-parallel linear regression with torch.distributed (env://) and DDP, unchanged from torchrun.

Run it with ``hvdrun -np 2 examples/torch_ddp_regression.py`` (or ``torchrun --nproc-per-node 2``).
The data set (1000 samples, 4 features with means 0..3, coefficients [5, 3, 2, 1], float64) is
sharded across ranks; DDP averages the gradients, so every rank follows full-batch gradient
descent and ends with the same coefficients as a single process would.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist

TRUE_COEFFICIENTS = [5.0, 3.0, 2.0, 1.0]


def make_data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(samples, 4, generator=generator, dtype=torch.float64) + torch.arange(4.0)
    noise = 0.1 * torch.randn(samples, generator=generator, dtype=torch.float64)
    return features, features @ torch.tensor(TRUE_COEFFICIENTS, dtype=torch.float64) + noise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=400)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--samples", type=int, default=1000)
    args = parser.parse_args()

    dist.init_process_group("gloo", init_method="env://")
    rank, size = dist.get_rank(), dist.get_world_size()
    features, targets = make_data(args.samples)
    shard = slice(rank * args.samples // size, (rank + 1) * args.samples // size)
    model = torch.nn.Linear(4, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    for _ in range(args.epochs):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(features[shard]).squeeze(1), targets[shard])
        loss.backward()
        optimizer.step()
    mse = torch.nn.functional.mse_loss(model(features).squeeze(1), targets).detach()
    dist.all_reduce(mse)
    if rank == 0:
        coefficients = ", ".join(f"{c:.4f}" for c in model.weight.detach()[0].tolist())
        print(f"ranks={size} epochs={args.epochs} coefficients=[{coefficients}] mse={mse.item() / size:.6f}")
    # Tear down in order: DDP's reducer holds the gloo group, and a group still alive when the
    # interpreter exits can abort in torch's C++ destructors ("terminate called without an
    # active exception"; torchrun shows it too, under load). Free DDP first, then every rank
    # leaves gloo together.
    del ddp, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
