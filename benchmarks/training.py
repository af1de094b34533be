"""Training step time: hvdrun's DistributedOptimizer vs torch DDP (gloo), same model and batch, one run.

    python benchmarks/training.py            # 2 ranks
    python benchmarks/training.py --ranks 2 --steps 30 --batch-size 32

Both jobs are started by ``hvdrun`` on this machine with the model of
``examples/synthetic_benchmark.py`` (SmallConvNet, SGD, synthetic 3x64x64 images). A step is
zero_grad + forward + backward + step; the time is rank 0's median over the measured steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "synthetic_benchmark.py"
MODES = ("hvdrun", "ddp")


def load_model_class() -> type:
    spec = importlib.util.spec_from_file_location("synthetic_benchmark", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SmallConvNet


def worker(mode: str, steps: int, warmup: int, batch_size: int) -> None:
    """Run inside a job: time ``steps`` training steps; rank 0 prints a JSON line."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = load_model_class()()
    if mode == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://")
        rank, size = dist.get_rank(), dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        import hvdrun.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                             named_parameters=model.named_parameters())
    data, target = torch.randn(batch_size, 3, 64, 64), torch.randint(0, 100, (batch_size,))
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    if rank == 0:
        print("RESULT " + json.dumps({"mode": mode, "ranks": size, "batch": batch_size,
                                      "step_s": statistics.median(times)}), flush=True)
    if mode == "ddp":
        dist.barrier()
        dist.destroy_process_group()
    else:
        hvd.shutdown()


def run_job(mode: str, ranks: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "hvdrun", "-np", str(ranks), "--no-prefix", str(Path(__file__).resolve()),
               "--worker", mode, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch-size", str(args.batch_size)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=dict(os.environ))
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return next(json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.batch_size)
        return
    results = {mode: run_job(mode, args.ranks, args) for mode in MODES}
    print("| ranks | batch/rank | hvdrun step | DDP (gloo) step | DDP time / hvdrun time |")
    print("|---|---|---|---|---|")
    hvd_s, ddp_s = results["hvdrun"]["step_s"], results["ddp"]["step_s"]
    print(f"| {args.ranks} | {args.batch_size} | {hvd_s * 1e3:.1f} ms | {ddp_s * 1e3:.1f} ms | {ddp_s / hvd_s:.2f}x |")


if __name__ == "__main__":
    main()
