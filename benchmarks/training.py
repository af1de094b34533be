"""Training step time: hvdrun's DistributedOptimizer vs torch DDP (gloo), same model and batch, one run.

    python benchmarks/training.py            # 2 ranks
    python benchmarks/training.py --ranks 2 --steps 30 --batch-size 32
    python benchmarks/training.py --model many-small   # 200 parameter tensors of 1-16 KB
    python benchmarks/training.py --device-path         # the route a GPU model's gradients take (gloo for NCCL)

One job started by ``hvdrun`` runs both, in the same processes, on identical models of
``examples/synthetic_benchmark.py`` (SmallConvNet, SGD, synthetic 3x64x64 images): blocks of DDP
steps and of DistributedOptimizer steps alternate, so the host's noise hits both alike. A step is
zero_grad + forward + backward + step; the time is rank 0's median over the measured steps.

``--device-path`` sends CPU tensors down the device path (``HVDRUN_CPU_VIA_DEVICE_BACKEND=1``, gloo in NCCL's
place: the stand-in for a GPU node), and ``--overlap both`` (the default) times two DistributedOptimizers in the
same job: one reducing during backward (what GPU parameters get) and one at ``step()`` (the CPU default). Each
row also gives the device path's collectives per step (none on the native path).
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

from hvdrun.envvars import CPU_VIA_DEVICE, DEVICE_BACKEND

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


def hvdrun_optimizer(model_class: type, overlap: str) -> tuple:
    """A model and its DistributedOptimizer, reducing during backward (``overlap`` "on") or at step() ("off")."""
    import torch

    import hvdrun.torch as hvd
    from hvdrun.envvars import OVERLAP

    torch.manual_seed(0)
    model = model_class()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    os.environ[OVERLAP] = "1" if overlap == "on" else "0"  # read when the optimizer is built
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    return model, optimizer


def device_collectives() -> int:
    """Collectives the device path has run on this rank so far (0 off it)."""
    from hvdrun.runtime import context

    device = context.current().device
    return device.collectives if device is not None else 0


def worker(steps: int, warmup: int, batch_size: int, rounds: int, model_name: str = "convnet",
           overlap: str = "both") -> None:
    """Inside one job: DDP (gloo) and DistributedOptimizer (overlap on, off or both) on identical models, in
    interleaved blocks."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import hvdrun.torch as hvd

    dist.init_process_group("gloo", init_method="env://")
    hvd.init()
    model_class = many_small_tensors_class() if model_name == "many-small" else load_model_class()
    torch.manual_seed(0)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model_class())
    pairs = {"ddp": (ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.01))}
    for setting in (("on", "off") if overlap == "both" else (overlap,)):
        pairs[f"hvdrun-overlap-{setting}"] = hvdrun_optimizer(model_class, setting)
    data, target = torch.randn(batch_size, 3, 64, 64), torch.randint(0, 100, (batch_size,))
    times: dict[str, list[float]] = {mode: [] for mode in pairs}
    calls: dict[str, int] = dict.fromkeys(pairs, 0)
    per_block = max(steps // rounds, 1)
    for round_index in range(rounds + 1):  # round 0 warms both up
        for mode, (model, optimizer) in pairs.items():
            for _ in range(warmup if round_index == 0 else per_block):
                before = device_collectives()
                start = time.perf_counter()
                optimizer.zero_grad()
                F.cross_entropy(model(data), target).backward()
                optimizer.step()
                if round_index:
                    times[mode].append(time.perf_counter() - start)
                    calls[mode] += device_collectives() - before
    if hvd.rank() == 0:
        for mode, values in times.items():
            print("RESULT " + json.dumps({"mode": mode, "ranks": hvd.size(), "batch": batch_size, "model": model_name,
                                          "step_s": statistics.median(values),
                                          "collectives_per_step": calls[mode] / len(values)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    hvd.shutdown()


def run_job(ranks: int, args: argparse.Namespace) -> dict[str, dict]:
    command = [sys.executable, "-m", "hvdrun", "-np", str(ranks), "--no-prefix", str(Path(__file__).resolve()),
               "--worker", "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch-size", str(args.batch_size), "--rounds", str(args.rounds), "--model", args.model,
               "--overlap", args.overlap]
    env = dict(os.environ)
    if args.device_path:
        env.update({CPU_VIA_DEVICE: "1", DEVICE_BACKEND: "gloo"})
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
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
    parser.add_argument("--overlap", choices=("on", "off", "both"), default="both",
                        help="DistributedOptimizer reducing during backward (on), at step() (off), or both timed")
    parser.add_argument("--device-path", action="store_true",
                        help="the device path with gloo in NCCL's place (what a GPU model's gradients take)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.warmup, args.batch_size, args.rounds, args.model, args.overlap)
        return
    results = run_job(args.ranks, args)
    path = "device (gloo stand-in)" if args.device_path else "native"
    print("| model | path | overlap | ranks | batch/rank | hvdrun step | DDP (gloo) step | DDP time / hvdrun time "
          "| device collectives / step |")
    print("|---|---|---|---|---|---|---|---|---|")
    ddp_s = results["ddp"]["step_s"]
    for mode, row in results.items():
        if mode != "ddp":
            hvd_s = row["step_s"]
            print(f"| {args.model} | {path} | {mode.rsplit('-', 1)[1]} | {args.ranks} | {args.batch_size} "
                  f"| {hvd_s * 1e3:.1f} ms | {ddp_s * 1e3:.1f} ms | {ddp_s / hvd_s:.2f}x "
                  f"| {row['collectives_per_step']:.1f} |")


if __name__ == "__main__":
    main()
