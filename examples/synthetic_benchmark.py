"""Images per second for a small CNN on synthetic data, like Horovod's pytorch_synthetic_benchmark.py.

    hvdrun -np 2 examples/synthetic_benchmark.py --num-iters 5
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import torch
import torch.nn.functional as F

import hvdrun.torch as hvd


class SmallConvNet(torch.nn.Module):
    """A few convolutions and a classifier on 3x64x64 images (no torchvision needed)."""

    def __init__(self, classes: int = 100) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, stride=2, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
            torch.nn.Conv2d(64, 128, 3, stride=2, padding=1), torch.nn.BatchNorm2d(128), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1))
        self.classifier = torch.nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-warmup-batches", type=int, default=3)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--no-cuda", action="store_true", help="stay on the CPU even where CUDA is available")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    cuda = torch.cuda.is_available() and not args.no_cuda
    if cuda:  # one GPU per rank: the local rank's (hvd.init() has made it current already under hvdrun)
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    device = torch.device("cuda" if cuda else "cpu")
    model = SmallConvNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    data = torch.randn(args.batch_size, 3, 64, 64, device=device)
    target = torch.randint(0, 100, (args.batch_size,), device=device)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    unit = "GPU" if cuda else "CPU"
    log(f"Model: SmallConvNet\nBatch size: {args.batch_size}\nNumber of {unit}s: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    rates = []
    for iteration in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / seconds)
        log(f"Iter #{iteration}: {rates[-1]:.1f} img/sec per {unit}")
    mean, spread = statistics.mean(rates), 1.96 * statistics.pstdev(rates)
    log(f"Img/sec per {unit}: {mean:.1f} +-{spread:.1f}")
    log(f"Total img/sec on {hvd.size()} {unit}(s): {hvd.size() * mean:.1f} +-{hvd.size() * spread:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
