"""Multivariate linear regression, data-parallel on hvdrun's ring allreduce.

    hvdrun -np 2 examples/linear_regression.py

Synthetic data: 1000 samples of 4 float64 features with means 0, 1, 2, 3 and coefficients
[5, 3, 2, 1]. Each rank holds a shard; every epoch each rank computes the gradient of its
shard's squared error and the ranks average them with ``hvd.allreduce``, so every rank follows
single-process full-batch gradient descent (400 epochs, lr 0.01) and ends with its coefficients.
``--check`` also runs that single-process descent and prints the largest difference.

Longer than a walltime (``hvdrun qsub --chain 3 -t 60 --warn-before 20 -- linear_regression.py --checkpoint
ckpt.pt``): the run resumes from ``--checkpoint`` where it exists, and on the warning hvdrun sends before the
allocation ends (SIGUSR1) every rank stops at the same epoch, rank 0 saves the checkpoint, and the job exits 0;
the next job of the chain resumes. The result is bit for bit an uninterrupted run's (``exact=`` prints it).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch

import hvdrun.torch as hvd

TRUE_COEFFICIENTS = [5.0, 3.0, 2.0, 1.0]


def make_data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(samples, 4, generator=generator, dtype=torch.float64) + torch.arange(4.0)
    noise = 0.1 * torch.randn(samples, generator=generator, dtype=torch.float64)
    return features, features @ torch.tensor(TRUE_COEFFICIENTS, dtype=torch.float64) + noise


def gradient(weights: torch.Tensor, features: torch.Tensor, targets: torch.Tensor, total: int) -> torch.Tensor:
    """This shard's part of the full-batch gradient of the mean squared error."""
    return 2.0 * features.T @ (features @ weights - targets) / total


def descend(features: torch.Tensor, targets: torch.Tensor, total: int, epochs: int, lr: float,
            distributed: bool) -> torch.Tensor:
    weights = torch.zeros(4, dtype=torch.float64)
    for _ in range(epochs):
        weights = step(weights, features, targets, total, lr, distributed)
    return weights


def step(weights: torch.Tensor, features: torch.Tensor, targets: torch.Tensor, total: int, lr: float,
         distributed: bool) -> torch.Tensor:
    """One epoch of full-batch gradient descent."""
    grad = gradient(weights, features, targets, total)
    if distributed:  # each shard's part sums to the full-batch gradient
        grad = hvd.allreduce(grad, op=hvd.Sum, name="gradient")
    return weights - lr * grad


STOP = {"asked": False}


def descend_resumably(features: torch.Tensor, targets: torch.Tensor, total: int, args: argparse.Namespace
                      ) -> torch.Tensor | None:
    """The documented stop loop (docs/launching.md): resume from ``--checkpoint``; at the warning every rank stops
    at the same epoch and rank 0 saves. Returns the weights, or None when stopped before the last epoch."""
    signal.signal(signal.SIGUSR1, lambda *_: STOP.update(asked=True))  # only a flag in the handler
    weights, start = torch.zeros(4, dtype=torch.float64), 0
    if os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint)
        weights, start = saved["weights"], saved["epoch"]
        if hvd.rank() == 0:
            print(f"resumed at epoch {start} from {args.checkpoint}", flush=True)
    for epoch in range(start, args.epochs):
        weights = step(weights, features, targets, total, args.lr, distributed=True)
        time.sleep(args.seconds_per_epoch)
        last = epoch + 1 == args.epochs  # warned at the last epoch: finish instead
        if not last and hvd.allreduce(torch.tensor(float(STOP["asked"])), op=hvd.Max, name="stop").item():
            hvd.save_checkpoint({"weights": weights, "epoch": epoch + 1}, args.checkpoint)
            if hvd.rank() == 0:
                print(f"warned: saved epoch {epoch + 1} of {args.epochs} to {args.checkpoint}", flush=True)
            return None
    hvd.save_checkpoint({"weights": weights, "epoch": args.epochs}, args.checkpoint)  # a next job has nothing to do
    return weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=400)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--check", action="store_true", help="compare with single-process gradient descent")
    parser.add_argument("--checkpoint", help="resume from this file; save it and stop at hvdrun's warning")
    parser.add_argument("--seconds-per-epoch", type=float, default=0.0, help="sleep this long each epoch")
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    features, targets = make_data(args.samples)
    shard = slice(rank * args.samples // size, (rank + 1) * args.samples // size)
    if args.checkpoint:
        found = descend_resumably(features[shard], targets[shard], args.samples, args)
        if found is None:
            hvd.shutdown()
            return
        weights = found
    else:
        weights = descend(features[shard], targets[shard], args.samples, args.epochs, args.lr, distributed=True)
    mse = torch.mean((features @ weights - targets) ** 2).item()
    coefficients = ", ".join(f"{w:.6f}" for w in weights.tolist())
    exact = ",".join(w.hex() for w in weights.tolist())
    print(f"rank {rank}/{size}: coefficients=[{coefficients}] mse={mse:.6f} exact={exact}", flush=True)
    if args.check:
        reference = descend(features, targets, args.samples, args.epochs, args.lr, distributed=False)
        print(f"rank {rank}: max |distributed - single process| = {(weights - reference).abs().max().item():.3e}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
