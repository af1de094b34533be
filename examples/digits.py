"""Data-parallel training of a small CNN on scikit-learn's bundled digits (no download), Horovod style.

    hvdrun -np 2 examples/digits.py --epochs 5 --checkpoint-dir ckpt
    hvdrun -np 2 examples/digits.py --epochs 8 --checkpoint-dir ckpt --resume

The recipe of Horovod's examples: DistributedSampler shards the data, the learning rate is
scaled by the number of ranks, rank 0's initial state is broadcast, gradients are averaged by
DistributedOptimizer, metrics are averaged with allreduce, and rank 0 writes a checkpoint after
every epoch (atomically). ``--resume`` continues from the newest checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hvdrun.torch as hvd


class Net(torch.nn.Module):
    """Two convolutions and two fully connected layers for 8x8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 2 * 2, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def datasets() -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    split = int(len(labels) * 0.8)
    return TensorDataset(images[:split], labels[:split]), TensorDataset(images[split:], labels[split:])


def average(value: float, name: str) -> float:
    """The mean of ``value`` over all ranks."""
    return hvd.allreduce(torch.tensor(value), name=name).item()


def evaluate(model: torch.nn.Module, loader: DataLoader) -> tuple[float, float]:
    model.eval()
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for images, labels in loader:
            output = model(images)
            loss += F.cross_entropy(output, labels, reduction="sum").item()
            correct += (output.argmax(1) == labels).sum().item()
            count += len(labels)
    return average(loss / count, "val_loss"), average(correct / count, "val_accuracy")


def newest_checkpoint(directory: Path) -> Path | None:
    found = sorted(directory.glob("checkpoint-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return found[-1] if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--fp16-allreduce", action="store_true")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    train, test = datasets()
    sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test, batch_size=256,
                             sampler=DistributedSampler(test, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False))
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)

    start_epoch = 0
    checkpoint = newest_checkpoint(args.checkpoint_dir) if args.resume and hvd.rank() == 0 else None
    if checkpoint is not None:
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0, name="start_epoch")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        for images, labels in train_loader:
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
        loss, accuracy = evaluate(model, test_loader)
        if hvd.rank() == 0:
            print(f"epoch {epoch}: val_loss={loss:.4f} val_accuracy={accuracy:.4f}", flush=True)
        hvd.save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                            args.checkpoint_dir / f"checkpoint-{epoch}.pt")
    hvd.shutdown()


if __name__ == "__main__":
    main()
