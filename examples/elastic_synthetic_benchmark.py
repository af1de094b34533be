"""Horovod's pytorch_synthetic_benchmark_elastic.py logic with hvdrun's import: images per second that
survive workers leaving and joining.

    hvdrun -np 4 --min-np 2 -H localhost:4 examples/elastic_synthetic_benchmark.py
    hvdrun --min-np 2 --host-discovery-script ./discover.sh examples/elastic_synthetic_benchmark.py
"""

from __future__ import annotations

import argparse
import timeit

import torch
import torch.nn.functional as F
from synthetic_benchmark import SmallConvNet

import hvdrun.torch as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-warmup-batches", type=int, default=2)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--batches-per-commit", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=10)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    model = SmallConvNet()
    lr = 0.01
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                         named_parameters=model.named_parameters())
    data = torch.randn(args.batch_size, 3, 64, 64)
    target = torch.randint(0, 100, (args.batch_size,))

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    def benchmark_step(state: hvd.elastic.TorchState) -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()
        state.batch += 1
        if state.batch % args.batches_per_commit == 0:
            state.commit()

    @hvd.elastic.run
    def run_benchmark(state: hvd.elastic.TorchState) -> None:
        if not state.warm:
            log("Running warmup...")
            timeit.timeit(lambda: benchmark_step(state), number=args.num_warmup_batches)
            state.warm = True
            state.commit()
        if state.iter == 0:
            log("Running benchmark...")
        for iteration in range(state.iter, args.num_iters):
            seconds = timeit.timeit(lambda: benchmark_step(state), number=args.num_batches_per_iter)
            img_sec = args.batch_size * args.num_batches_per_iter / seconds
            log(f"Iter #{iteration}: {img_sec:.1f} img/sec per CPU ({hvd.size()} workers)")
            state.img_secs.append(img_sec)
            state.iter = iteration + 1
            state.commit()

    def on_state_reset() -> None:
        for group in optimizer.param_groups:  # the learning rate follows the number of workers
            group["lr"] = lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, img_secs=[], iter=0, batch=0, warm=False)
    state.register_reset_callbacks([on_state_reset])
    run_benchmark(state)
    log(f"Img/sec per CPU: {sum(state.img_secs) / len(state.img_secs):.1f} over {len(state.img_secs)} iterations; "
        f"{hvd.size()} workers at the end")
    hvd.shutdown()


if __name__ == "__main__":
    main()
