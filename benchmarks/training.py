"""Training step time: hvdrun's DistributedOptimizer vs torch DDP (gloo), same model and batch, one run.

    python benchmarks/training.py            # 2 ranks
    python benchmarks/training.py --ranks 2 --steps 30 --batch-size 32
    python benchmarks/training.py --model many-small   # 200 parameter tensors of 1-16 KB

One job started by ``hvdrun`` runs both, in the same processes, on identical models of
``examples/synthetic_benchmark.py`` (SmallConvNet, SGD, synthetic 3x64x64 images): blocks of DDP
steps and of DistributedOptimizer steps alternate, so the host's noise hits both alike. A step is
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


def load_model_class() -> type:
    spec = importlib.util.spec_from_file_location("synthetic_benchmark", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SmallConvNet


def many_small_tensors_class() -> type:
    """A model whose cost is its number of parameter tensors: 200 of 1-16 KB (float32), little compute.

    Every parameter gets a gradient of its full size, so a step allreduces 200 small tensors: the case
    of models with many layers, and the per-op overhead the allreduce pays on each of them.
    """
    import torch

    class ManySmallTensors(torch.nn.Module):
        def __init__(self, count: int = 200) -> None:
            super().__init__()
            sizes = [256 + (i * 3823) % 3841 for i in range(count)]  # 256..4096 floats: 1..16 KB
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n) * 0.01) for n in sizes)
            self.head = torch.nn.Linear(16, 100)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = x.flatten(1)[:, :16]
            for weight in self.weights:
                hidden = hidden + torch.tanh(weight[:16])
            return self.head(hidden)

    return ManySmallTensors


def worker(steps: int, warmup: int, batch_size: int, rounds: int, model_name: str = "convnet") -> None:
    """Inside one job: both DDP (gloo) and DistributedOptimizer on identical models, in interleaved blocks."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import hvdrun.torch as hvd

    dist.init_process_group("gloo", init_method="env://")
    hvd.init()
    model_class = many_small_tensors_class() if model_name == "many-small" else load_model_class()
    torch.manual_seed(0)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model_class())
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    torch.manual_seed(0)
    hvd_model = model_class()
    hvd.broadcast_parameters(hvd_model.state_dict(), root_rank=0)
    hvd_optimizer = hvd.DistributedOptimizer(torch.optim.SGD(hvd_model.parameters(), lr=0.01),
                                             named_parameters=hvd_model.named_parameters())
    data, target = torch.randn(batch_size, 3, 64, 64), torch.randint(0, 100, (batch_size,))
    times: dict[str, list[float]] = {"hvdrun": [], "ddp": []}
    pairs = {"hvdrun": (hvd_model, hvd_optimizer), "ddp": (ddp_model, ddp_optimizer)}
    per_block = max(steps // rounds, 1)
    for round_index in range(rounds + 1):  # round 0 warms both up
        for mode, (model, optimizer) in pairs.items():
            for _ in range(warmup if round_index == 0 else per_block):
                start = time.perf_counter()
                optimizer.zero_grad()
                F.cross_entropy(model(data), target).backward()
                optimizer.step()
                if round_index:
                    times[mode].append(time.perf_counter() - start)
    if hvd.rank() == 0:
        for mode, values in times.items():
            print("RESULT " + json.dumps({"mode": mode, "ranks": hvd.size(), "batch": batch_size, "model": model_name,
                                          "step_s": statistics.median(values)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    hvd.shutdown()


def run_job(ranks: int, args: argparse.Namespace) -> dict[str, dict]:
    command = [sys.executable, "-m", "hvdrun", "-np", str(ranks), "--no-prefix", str(Path(__file__).resolve()),
               "--worker", "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch-size", str(args.batch_size), "--rounds", str(args.rounds), "--model", args.model]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=dict(os.environ))
    if done.returncode != 0:
        raise SystemExit(f"training benchmark failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return {row["mode"]: row for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6, help="interleaved blocks per mode")
    parser.add_argument("--model", choices=("convnet", "many-small"), default="convnet",
                        help="convnet: SmallConvNet of examples/synthetic_benchmark.py; many-small: 200 tensors")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.warmup, args.batch_size, args.rounds, args.model)
        return
    results = run_job(args.ranks, args)
    print("| model | ranks | batch/rank | hvdrun step | DDP (gloo) step | DDP time / hvdrun time |")
    print("|---|---|---|---|---|---|")
    hvd_s, ddp_s = results["hvdrun"]["step_s"], results["ddp"]["step_s"]
    print(f"| {args.model} | {args.ranks} | {args.batch_size} | {hvd_s * 1e3:.1f} ms | {ddp_s * 1e3:.1f} ms "
          f"| {ddp_s / hvd_s:.2f}x |")


if __name__ == "__main__":
    main()
