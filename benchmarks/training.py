"""Training step time: hvdrun's DistributedOptimizer vs torch DDP (gloo), same model and batch, one run.

    python benchmarks/training.py            # 2 ranks
    python benchmarks/training.py --ranks 2 --steps 30 --batch-size 32
    python benchmarks/training.py --model many-small   # 200 parameter tensors of 1-16 KB
    python benchmarks/training.py --device-path         # the route a GPU model's gradients take (gloo for NCCL)
    python benchmarks/training.py --device cuda --ranks 4 --model resnet   # GPUs: NCCL under both (gpu.py --training)

One job started by ``hvdrun`` runs both, in the same processes, on identical models of
``examples/synthetic_benchmark.py`` (SmallConvNet, SGD, synthetic 3x64x64 images): blocks of DDP
steps and of DistributedOptimizer steps alternate, so the host's noise hits both alike. A step is
zero_grad + forward + backward + step; the time is rank 0's median over the measured steps.

``--device-path`` sends CPU tensors down the device path (``HVDRUN_CPU_VIA_DEVICE_BACKEND=1``, gloo in NCCL's
place: the stand-in for a GPU node), and ``--overlap both`` (the default) times two DistributedOptimizers in the
same job: one reducing during backward (what GPU parameters get) and one at ``step()`` (the CPU default). Each
row also gives the device path's collectives per step (none on the native path).

``--device cuda`` (or ``xpu``) trains on the GPUs, one a rank (``hvdrun --gpus-per-node``): DDP on NCCL (XCCL) and
hvdrun's device path on the same backend; a step's time then ends with the device's synchronize.
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


def hvdrun_optimizer(model_class: type, overlap: str, device: str = "cpu") -> tuple:
    """A model and its DistributedOptimizer, reducing during backward (``overlap`` "on") or at step() ("off")."""
    import torch

    import hvdrun.torch as hvd
    from hvdrun.envvars import OVERLAP

    torch.manual_seed(0)
    model = model_class().to(device)
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


def resnet_like_class() -> type:
    """A ResNet-like model (a stem, 4 stages of 2 residual blocks with batch norm, 64-512 channels; 62 parameter
    tensors, 11 M parameters, ResNet-18's shape) for 3x64x64 images: the case of convolutional training."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, inputs: int, outputs: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU(),
                nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False), nn.BatchNorm2d(outputs))
            self.skip = (nn.Identity() if stride == 1 and inputs == outputs else
                         nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.body(x) + self.skip(x))

    class ResNetLike(nn.Module):
        def __init__(self, classes: int = 100) -> None:
            super().__init__()
            widths, layers, inputs = (64, 128, 256, 512), [], 64
            for index, width in enumerate(widths):
                layers += [Block(inputs, width, 1 if index == 0 else 2), Block(width, width, 1)]
                inputs = width
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
            self.stages = nn.Sequential(*layers)
            self.head = nn.Linear(inputs, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.stages(self.stem(x)).mean((2, 3)))

    return ResNetLike


MODELS = {"convnet": load_model_class, "many-small": many_small_tensors_class, "resnet": resnet_like_class}
DDP_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl"}


def device_synchronize(device: str) -> None:
    """Wait for the device's queued work (nothing on the CPU)."""
    import torch

    if device != "cpu":
        getattr(torch, device).synchronize()


def worker(steps: int, warmup: int, batch_size: int, rounds: int, model_name: str = "convnet",
           overlap: str = "both", device: str = "cpu") -> None:
    """Inside one job: DDP and DistributedOptimizer (overlap on, off or both) on identical models, on one backend,
    in interleaved blocks."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import hvdrun.torch as hvd

    hvd.init()
    if device != "cpu":  # the GPU hvdrun's launcher gave this rank (it pinned LOCAL_RANK's)
        getattr(torch, device).set_device(hvd.local_rank() % getattr(torch, device).device_count())
    dist.init_process_group(DDP_BACKENDS[device], init_method="env://")
    model_class = MODELS[model_name]()
    torch.manual_seed(0)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model_class().to(device))
    pairs = {"ddp": (ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.01))}
    for setting in (("on", "off") if overlap == "both" else (overlap,)):
        pairs[f"hvdrun-overlap-{setting}"] = hvdrun_optimizer(model_class, setting, device)
    data = torch.randn(batch_size, 3, 64, 64, device=device)
    target = torch.randint(0, 100, (batch_size,), device=device)
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
                device_synchronize(device)
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
    """One job of ``ranks`` ranks: rank 0's result of every mode (``ddp``, ``hvdrun-overlap-on``, ...)."""
    pinning = ["--gpus-per-node", str(ranks)] if args.device != "cpu" else []
    command = [sys.executable, "-m", "hvdrun", "-np", str(ranks), *pinning, "--no-prefix",
               str(Path(__file__).resolve()), "--worker", "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch-size", str(args.batch_size), "--rounds", str(args.rounds), "--model", args.model,
               "--overlap", args.overlap, "--device", args.device]
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
    parser.add_argument("--model", choices=tuple(MODELS), default="convnet",
                        help="convnet: SmallConvNet of examples/synthetic_benchmark.py; many-small: 200 tensors; "
                             "resnet: ResNet-18's shape")
    parser.add_argument("--device", choices=tuple(DDP_BACKENDS), default="cpu",
                        help="where the models train (cuda, xpu: one GPU a rank, DDP on NCCL or XCCL)")
    parser.add_argument("--overlap", choices=("on", "off", "both"), default="both",
                        help="DistributedOptimizer reducing during backward (on), at step() (off), or both timed")
    parser.add_argument("--device-path", action="store_true",
                        help="the device path with gloo in NCCL's place (what a GPU model's gradients take)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.warmup, args.batch_size, args.rounds, args.model, args.overlap, args.device)
        return
    print(TABLE_HEAD)
    print(table_rows(run_job(args.ranks, args), args))


TABLE_HEAD = ("| model | path | overlap | ranks | batch/rank | hvdrun step | DDP step | DDP time / hvdrun time "
              "| device collectives / step |\n|---|---|---|---|---|---|---|---|---|")


def table_rows(results: dict[str, dict], args: argparse.Namespace) -> str:
    """A markdown row for each DistributedOptimizer mode of one job, against its DDP."""
    if args.device == "cpu":
        path = "device (gloo stand-in)" if args.device_path else "native"
    else:
        path = f"{args.device} ({DDP_BACKENDS[args.device]})"
    ddp_s, rows = results["ddp"]["step_s"], []
    for mode, row in results.items():
        if mode != "ddp":
            hvd_s = row["step_s"]
            rows.append(f"| {row['model']} | {path} | {mode.rsplit('-', 1)[1]} | {row['ranks']} | {row['batch']} "
                        f"| {hvd_s * 1e3:.1f} ms | {ddp_s * 1e3:.1f} ms | {ddp_s / hvd_s:.2f}x "
                        f"| {row['collectives_per_step']:.1f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
