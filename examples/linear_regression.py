"""Multivariate linear regression, data-parallel on hvdrun's ring allreduce.

    hvdrun -np 2 examples/linear_regression.py

Synthetic data: 1000 samples of 4 float64 features with means 0, 1, 2, 3 and coefficients
[5, 3, 2, 1]. Each rank holds a shard; every epoch each rank computes the gradient of its
shard's squared error and the ranks average them with ``hvd.allreduce``, so every rank follows
single-process full-batch gradient descent (400 epochs, lr 0.01) and ends with its coefficients.
``--check`` also runs that single-process descent and prints the largest difference.
"""

from __future__ import annotations

import argparse

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
        grad = gradient(weights, features, targets, total)
        if distributed:  # each shard's part sums to the full-batch gradient
            grad = hvd.allreduce(grad, op=hvd.Sum, name="gradient")
        weights -= lr * grad
    return weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=400)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--check", action="store_true", help="compare with single-process gradient descent")
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    features, targets = make_data(args.samples)
    shard = slice(rank * args.samples // size, (rank + 1) * args.samples // size)
    weights = descend(features[shard], targets[shard], args.samples, args.epochs, args.lr, distributed=True)
    mse = torch.mean((features @ weights - targets) ** 2).item()
    coefficients = ", ".join(f"{w:.6f}" for w in weights.tolist())
    print(f"rank {rank}/{size}: coefficients=[{coefficients}] mse={mse:.6f}", flush=True)
    if args.check:
        reference = descend(features, targets, args.samples, args.epochs, args.lr, distributed=False)
        print(f"rank {rank}: max |distributed - single process| = {(weights - reference).abs().max().item():.3e}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
